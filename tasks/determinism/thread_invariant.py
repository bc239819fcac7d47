"""ATen CPU kernels whose values followed the thread count, run so that it cannot (determinism.cpu: portable).

Portable bytes must not depend on the thread count (`num_threads: auto` takes the cores a process is
given), and hashing every op's output on 1, 2 and 3 threads found these that moved with it:

- mish, softplus (forward and backward) and ELU's backward: ATen computes the end of each thread's share
  of a tensor with other code than its body, so an element's value followed where the thread count cut
  the tensor. Here the tensor is cut in pieces of `PIECE` elements, fewer than TensorIterator shares out
  between threads (one thread computes a piece) and a multiple of every vector width (no end but the
  tensor's own), each computed by ATen's own out= kernel: ATen's one-thread bytes on any thread count.
  Mish's backward has no out= kernel: torch's formula for it (math_mish_backward) over the routed ops.
- softmax along a dimension other than the last: computed along the last of a copy with that dimension
  moved there (ATen's kernel for the last dimension gives each row to one thread).
- batch norm of a channels-last tensor, forward and backward: computed on contiguous copies (ATen's
  per-channel sums of a contiguous tensor do not follow the thread count), the gradient and output laid
  out as the input again.

These call the ops' out= forms (and batch_norm_backward, since native_batch_norm_backward's out= kernel
calls the op itself), which stay ATen's: tasks/determinism/dispatch.py routes the others here. An out= call
of one of them with a large tensor, rare in a model, still follows the thread count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tasks.determinism import activations, memory

# Elements per piece: under TensorIterator's grain size (32768, below which one thread computes the whole),
# and a multiple of twice the widest vector of every dtype (ATen's loops take two vectors at a time).
PIECE = 16384

aten = torch.ops.aten


def _in_pieces(compute: Callable[..., Any], *tensors: torch.Tensor) -> torch.Tensor:
    """`compute(*pieces, out=piece of the result)` over `PIECE`-element pieces of `tensors` (all of one
    shape, read contiguous); the result new memory (`memory.empty`), of the first tensor's shape and dtype."""
    flat = [t.contiguous().view(-1) for t in tensors]
    result = memory.empty(tuple(tensors[0].shape), tensors[0])
    out = result.view(-1)
    for start in range(0, out.numel(), PIECE):
        compute(*(f[start : start + PIECE] for f in flat), out=out[start : start + PIECE])
    return result


def mish(x: torch.Tensor) -> torch.Tensor:
    return _in_pieces(aten.mish.out, x)


def mish_(x: torch.Tensor) -> torch.Tensor:
    return x.copy_(mish(x))


def softplus(x: torch.Tensor, beta: float = 1, threshold: float = 20) -> torch.Tensor:
    return _in_pieces(lambda piece, out: aten.softplus.out(piece, beta, threshold, out=out), x)


def softplus_backward(grad: torch.Tensor, x: torch.Tensor, beta: float, threshold: float) -> torch.Tensor:
    def compute(g: torch.Tensor, piece: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return aten.softplus_backward.grad_input(g, piece, beta, threshold, grad_input=out)

    return _in_pieces(compute, grad.expand(x.shape), x)


def elu_backward(
    grad: torch.Tensor, alpha: float, scale: float, input_scale: float, is_result: bool, x_or_result: torch.Tensor
) -> torch.Tensor:
    def compute(g: torch.Tensor, piece: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return aten.elu_backward.grad_input(g, alpha, scale, input_scale, is_result, piece, grad_input=out)

    return _in_pieces(compute, grad.expand(x_or_result.shape), x_or_result)


def mish_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """torch's math_mish_backward: grad * (tanh(sp) + x * sigmoid(x) * (1 - tanh(sp)^2)), sp = softplus(x)."""
    tanh_softplus = torch.tanh(softplus(x))
    sigmoid = activations.compute("sigmoid", x)
    return grad * (tanh_softplus + x * sigmoid * (1 - tanh_softplus * tanh_softplus))


def softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    """aten::_softmax: along the last dimension of a copy with `dim` moved there (rows whole to a thread)."""
    dtype = torch.float32 if half_to_float else x.dtype
    dim = dim % max(x.dim(), 1)
    moved = x.dim() > 1 and dim != x.dim() - 1
    source = x.movedim(dim, -1).contiguous() if moved else x.contiguous()
    out = memory.empty(tuple(source.shape), source if dtype == source.dtype else source.new_empty(0, dtype=dtype))
    aten._softmax.out(source, -1 if moved else dim, half_to_float, out=out)
    return out.movedim(-1, dim).contiguous() if moved else out


def _channels_last(x: torch.Tensor) -> bool:
    """A 4-D tensor laid out channels-last (and not contiguous as well, as with one channel or 1x1 images)."""
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def _laid_out_as(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`t` (contiguous) laid out as ATen lays out its result for `x`: channels-last where x is."""
    return t.contiguous(memory_format=torch.channels_last) if _channels_last(x) else t


def batch_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """aten::native_batch_norm over a contiguous copy of x (the running statistics updated in place, as
    torch's); the output laid out as x."""
    # the statistics in the parameters' dtype, as ATen's: float32 for a half or bfloat16 x under autocast
    stats = next((t.dtype for t in (weight, bias, running_mean, running_var) if t is not None), x.dtype)
    contiguous = x.contiguous()
    out, mean, invstd = aten.native_batch_norm.out(
        contiguous, weight, bias, running_mean, running_var, training, momentum, eps,
        out=memory.empty(tuple(x.shape), contiguous), save_mean=torch.empty(0, dtype=stats),
        save_invstd=torch.empty(0, dtype=stats),
    )  # fmt: skip
    return _laid_out_as(out, x), mean, invstd


def batch_norm_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    save_mean: torch.Tensor | None,
    save_invstd: torch.Tensor | None,
    train: bool,
    eps: float,
    mask: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """aten::native_batch_norm_backward over contiguous copies (by aten::batch_norm_backward, the same CPU
    kernel); the input gradient laid out as x."""
    no_reserve = torch.empty(0, dtype=torch.uint8)
    grad_input, grad_weight, grad_bias = aten.batch_norm_backward.default(
        grad.contiguous(), x.contiguous(), weight, running_mean, running_var, save_mean, save_invstd, train, eps,
        list(mask), no_reserve,
    )  # fmt: skip
    return (None if grad_input is None else _laid_out_as(grad_input, x)), grad_weight, grad_bias
