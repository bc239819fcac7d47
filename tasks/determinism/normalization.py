"""Batch norm, layer norm, softmax and log-softmax, forward and backward, for determinism.cpu: portable: the
same bytes on any thread count, and on x86-64 and arm64 alike.

ATen's CPU kernels for these sum with orders the thread count and the vector width decide: layer norm's
backward added its weight and bias gradients into one buffer per thread (convnext's weights followed
the thread count, from the first step; swin's and maxvit's followed it through softmax's backward), batch
norm's channels-last kernels did the same, and on arm64 every one of their sums, and exp, log and sqrt,
gave other bytes than on x86-64 (docs/design-history.md, "arm64: what differs"). Here every sum has one
order (reductions.py's `total`, and normalization.h's for the backward passes blas_pool.cpp computes: a
row's in 16 interleaved chains, a column's in blocks of rows added in order), square roots are correctly
rounded (`reductions.sqrt`), e^x and log are own polynomials, and the rest is ATen's formulas
(layer_norm_kernel.cpp, batch_norm_kernel.cpp, SoftMaxKernel.cpp), each operation rounded once. Where
blas_pool.cpp cannot be built, torch's elementwise ops compute the same bytes (tested), as they do for
float64. Half and bfloat16 are computed in float32, as ATen does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tasks.determinism import activations, blas, memory, reductions

CHAINS = 16  # a row's sum: element j into chain j % CHAINS (normalization.h's kChains)
BLOCK_ROWS = 64  # a column's sum: blocks of this many rows (blas_pool.cpp's kBlockRows)
_REDUCED = reductions.REDUCED


def layer_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    output_mask: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """aten::native_layer_norm_backward: the gradients of the input, the weight and the bias (each None
    where `output_mask` does not ask for it)."""
    columns = math.prod(normalized_shape)
    rows = x.numel() // columns if columns else 0
    compute = torch.float32 if x.dtype in _REDUCED else x.dtype
    dy = grad_out.detach().reshape(rows, columns).to(compute).contiguous()
    xs = x.detach().reshape(rows, columns).to(compute).contiguous()
    a = rstd.detach().reshape(rows, 1).to(compute).contiguous()
    mu = mean.detach().reshape(rows, 1).to(compute).contiguous()
    w = None if weight is None else weight.detach().reshape(columns).to(compute).contiguous()
    dx, dw, db = (
        memory.empty(shape, xs) if wanted else None
        for shape, wanted in zip(((rows, columns), (columns,), (columns,)), output_mask, strict=True)
    )
    op = blas.op("layer_norm_backward") if compute == torch.float32 else None
    if op is not None:
        op(dy, xs, mu, a, w, dx, dw, db)
    else:
        _layer_norm_backward(dy, xs, mu, a, w, dx, dw, db)
    like = weight if weight is not None else (bias if bias is not None else x)
    return (
        None if dx is None else dx.view(x.shape).to(x.dtype),
        None if dw is None else dw.view(normalized_shape).to(like.dtype),
        None if db is None else db.view(normalized_shape).to((bias if bias is not None else like).dtype),
    )


def _layer_norm_backward(dy, xs, mu, a, w, dx, dw, db) -> None:  # noqa: ANN001
    """normalization.h's layer_norm_rows and blas_pool.cpp's block sums, operation for operation."""
    if dx is not None:
        g = dy * w if w is not None else dy
        ds, sum_g = _row_sums(g * xs), _row_sums(g)
        scale = 1.0 / xs.shape[1]
        b = (sum_g * mu - ds) * a * a * a * scale
        c = -b * mu - sum_g * a * scale
        dx.copy_((g * a).add_(xs * b).add_(c))
    if dw is not None:
        dw.copy_(_column_sums(dy * (xs * a).add_(-a * mu)))
    if db is not None:
        db.copy_(_column_sums(dy))


def _row_sums(t: torch.Tensor) -> torch.Tensor:
    """Each row's sum of a (rows, n) tensor, (rows, 1): CHAINS chains from zero, the row padded with zeros to
    whole chains' widths, then the chains added in halves."""
    padded = F.pad(t, (0, -t.shape[1] % CHAINS))
    chain = torch.zeros(t.shape[0], CHAINS, dtype=t.dtype)
    for start in range(0, padded.shape[1], CHAINS):
        chain = chain + padded[:, start : start + CHAINS]
    half = CHAINS // 2
    while half >= 1:
        chain = chain[:, :half] + chain[:, half : 2 * half]
        half //= 2
    return chain


def _column_sums(t: torch.Tensor) -> torch.Tensor:
    """Each column's sum of a (rows, n) tensor, (n,): each block of BLOCK_ROWS rows from zero in order (the
    last padded with zero rows), then the blocks from zero in order."""
    padded = F.pad(t, (0, 0, 0, -t.shape[0] % BLOCK_ROWS)).view(-1, BLOCK_ROWS, t.shape[1])
    blocks = torch.zeros(padded.shape[0], t.shape[1], dtype=t.dtype)
    for row in range(BLOCK_ROWS):
        blocks = blocks + padded[:, row]
    total = torch.zeros(t.shape[1], dtype=t.dtype)
    for block in blocks:
        total = total + block
    return total


def softmax_backward(
    grad_output: torch.Tensor, output: torch.Tensor, dim: int, input_dtype: torch.dtype
) -> torch.Tensor:
    """aten::_softmax_backward_data: the input's gradient, output * (grad - the sum of grad * output along
    `dim`), in `input_dtype`."""
    if output.dim() == 0:  # one element: a row of one
        return softmax_backward(grad_output.view(1), output.view(1), 0, input_dtype).view(())
    compute = torch.float32 if output.dtype in _REDUCED else output.dtype
    moved = output.detach().movedim(dim, -1)
    y = moved.reshape(-1, moved.shape[-1]).to(compute).contiguous()
    dy = grad_output.detach().movedim(dim, -1).reshape(y.shape).to(compute).contiguous()
    op = blas.op("softmax_backward") if compute == torch.float32 else None
    if op is not None:
        grad = memory.empty(tuple(y.shape), y)
        op(dy, y, grad)
    else:
        grad = y * (dy - _row_sums(dy * y))
    grad = grad.view(moved.shape).movedim(-1, dim).contiguous()
    return grad.to(input_dtype)


def _exp(x: torch.Tensor) -> torch.Tensor:
    """e^x: activations.py's formula for float32 (ATen's exp differs between x86-64 and arm64), ATen's else."""
    return activations.exp(x) if x.dtype == torch.float32 else torch.exp(x)


def softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    """aten::_softmax: e^(x - the row's max) over its sum (`reductions.total`), in float32 for half and
    bfloat16 (returned so where `half_to_float`)."""
    compute = torch.float32 if half_to_float or x.dtype in _REDUCED else x.dtype
    xf = x.to(compute)
    e = _exp(xf - xf.amax(dim, keepdim=True))
    result = e / reductions.total(e, [dim], keepdim=True)
    return result if half_to_float else result.to(x.dtype)


def log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    """aten::_log_softmax: (x - the row's max) - log of the sum of its e^, as `softmax`."""
    compute = torch.float32 if half_to_float or x.dtype in _REDUCED else x.dtype
    xf = x.to(compute)
    shifted = xf - xf.amax(dim, keepdim=True)
    result = shifted - reductions.log(reductions.total(_exp(shifted), [dim], keepdim=True))
    return result if half_to_float else result.to(x.dtype)


def log_softmax_backward(
    grad_output: torch.Tensor, output: torch.Tensor, dim: int, input_dtype: torch.dtype
) -> torch.Tensor:
    """aten::_log_softmax_backward_data: grad - e^output times the sum of grad along `dim`, in `input_dtype`."""
    compute = torch.float32 if output.dtype in _REDUCED else output.dtype
    g = grad_output.to(compute)
    grad = g - _exp(output.to(compute)) * reductions.total(g, [dim], keepdim=True)
    return grad.to(input_dtype)


def layer_norm(
    x: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None, bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """aten::native_layer_norm: the output, and each row's mean and 1/sqrt(variance + eps), shaped and typed
    as ATen's (the parameters' dtype)."""
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    count = math.prod(normalized_shape)
    xf = x.to(torch.float32 if x.dtype in _REDUCED else x.dtype)
    mean = reductions.total(xf, dims, keepdim=True) / count
    centred = xf - mean
    rstd = 1 / reductions.sqrt(reductions.total(centred * centred, dims, keepdim=True) / count + eps)
    out = centred * rstd
    out = out if weight is None else out * weight
    out = out if bias is None else out + bias
    stats = next((t.dtype for t in (weight, bias) if t is not None), x.dtype)
    return out.to(x.dtype), mean.to(stats), rstd.to(stats)


def _channel_shape(x: torch.Tensor) -> list[int]:
    """Where a per-channel vector broadcasts over x (N, C, ...)."""
    return [1, -1] + [1] * (x.dim() - 2)


def _laid_out_as(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`t` laid out as ATen lays out its result for `x`: channels-last where x is, contiguous else."""
    return t.contiguous(memory_format=torch.channels_last if memory.channels_last(x) else torch.contiguous_format)


def _like(x: torch.Tensor, make: reductions.Scratch, dtype: torch.dtype) -> torch.Tensor:
    """Memory from `make` (memory.empty, or a pool's `take`) of x's shape in `dtype`, laid out as x."""
    like = x.new_empty(0, dtype=dtype)
    if memory.channels_last(x):
        n, c, h, w = x.shape
        return make((n, h, w, c), like).permute(0, 3, 1, 2)
    return make(tuple(x.shape), like)


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
    """aten::native_batch_norm: the output laid out as x, and the batch's mean and 1/sqrt(variance + eps) per
    channel (training; empty else), the running statistics updated in place as ATen's (unbiased variance)."""
    # the statistics in the parameters' dtype, as ATen's: float32 for a half or bfloat16 x under autocast
    stats = next((t.dtype for t in (weight, bias, running_mean, running_var) if t is not None), x.dtype)
    compute = torch.float32 if stats in _REDUCED else stats
    shape, xf = _channel_shape(x), x.to(compute)
    count = x.numel() // max(x.shape[1], 1)
    # each sum read from x by blas_pool.cpp (reductions.channel_total), what scratch the torch code needs from
    # the pool (memory.py: a new tensor of megabytes costs its page faults every step), the output new memory
    with memory.temporaries() as take:
        if training:
            mean = reductions.channel_total(xf, scratch=take) / count
            squares = reductions.channel_total(xf, center=mean, scratch=take)
            invstd = 1 / reductions.sqrt(squares / count + eps)
            if running_mean is not None:
                running_mean.copy_(running_mean * (1 - momentum) + mean * momentum)
            if running_var is not None:
                running_var.copy_(running_var * (1 - momentum) + squares / (count - 1) * momentum)
            saved = (mean.to(stats), invstd.to(stats))
        else:
            if running_mean is None or running_var is None:
                raise ValueError("native_batch_norm: running_mean and running_var are needed outside training")
            mean, invstd = running_mean, 1 / reductions.sqrt(running_var + eps)
            saved = (torch.empty(0, dtype=stats), torch.empty(0, dtype=stats))
    scale = (invstd if weight is None else invstd * weight).view(shape)
    out = torch.sub(xf, mean.view(shape), out=_like(x, memory.empty, compute)).mul_(scale)
    out = out if bias is None else out.add_(bias.view(shape))
    return _laid_out_as(out.to(x.dtype), x), *saved


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
    """aten::native_batch_norm_backward: the gradients of the input (laid out as x), the weight and the bias,
    each None where `mask` does not ask for it."""
    mean, invstd = (save_mean, save_invstd) if train else (running_mean, running_var)
    if mean is None or invstd is None:
        raise ValueError("native_batch_norm_backward: the saved (training) or running statistics are needed")
    if not train:
        invstd = 1 / reductions.sqrt(invstd + eps)
    stats, shape = invstd.dtype, _channel_shape(x)
    compute = torch.float32 if stats in _REDUCED else stats
    count = x.numel() // max(x.shape[1], 1)
    g, xc = grad.to(compute), x.to(compute)
    with memory.temporaries() as take:  # (as batch_norm's)
        sum_g = reductions.channel_total(g, scratch=take) if train or mask[2] else None
        wanted = train or mask[1]
        sum_gx = reductions.channel_total(xc, center=mean, scale=invstd, g=g, scratch=take) if wanted else None
        grad_input = None
        if mask[0]:
            scale = (invstd if weight is None else invstd * weight).view(shape)
            dx = _like(x, memory.empty, compute)
            if train:  # (g - mean(g) - x-hat mean(g x-hat)) times the scale
                shifted = torch.sub(xc, mean.view(shape), out=_like(x, take, compute)).mul_(invstd.view(shape))
                shifted.mul_((sum_gx / count).view(shape))
                torch.sub(g, (sum_g / count).view(shape), out=dx).sub_(shifted).mul_(scale)
            else:
                torch.mul(g, scale, out=dx)
            grad_input = _laid_out_as(dx.to(x.dtype), x)
    return grad_input, (sum_gx.to(stats) if mask[1] else None), (sum_g.to(stats) if mask[2] else None)
