"""ATen CPU kernels whose values followed the thread count, run so that it cannot (determinism.cpu: portable).

Portable bytes must not depend on the thread count (`num_threads: auto` takes the cores a process is
given), and hashing every op's output on 1, 2 and 3 threads found these that moved with it:

- mish, softplus (forward and backward) and ELU's backward: ATen computes the end of each thread's share
  of a tensor with other code than its body, so an element's value followed where the thread count cut
  the tensor. Here the tensor is cut in pieces of `PIECE` elements, fewer than TensorIterator shares out
  between threads (one thread computes a piece) and a multiple of every vector width (no end but the
  tensor's own), each computed by ATen's own out= kernel: ATen's one-thread bytes on any thread count.
  Mish's backward has no out= kernel: torch's formula for it (math_mish_backward) over the routed ops.

These call the ops' out= forms, which stay ATen's: tasks/determinism/dispatch.py routes the others here. An
out= call of one of them with a large tensor, rare in a model, still follows the thread count. (Softmax and
batch norm, which followed it too, are normalization.py's: their sums are own, for arm64's sake.)
"""

from __future__ import annotations

from collections.abc import Callable
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
