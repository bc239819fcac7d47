"""Layer norm's and softmax's backward, for determinism.cpu: portable: the same bytes on any thread count.

ATen's CPU kernel for layer norm's backward adds the weight and bias gradients (sums over every row of the
batch) into one buffer per thread, over the rows that thread was given, and then adds the buffers: the
thread count decided where the sums were cut, so convnext's weights followed it (1 against 2 threads, from
the first step), as did swin's and maxvit's through softmax's backward. Here every sum has one order,
which neither the threads nor the vector width change (normalization.h says which): a row's in 16
interleaved chains, a column's in blocks of `BLOCK_ROWS` rows added in order. The rest is ATen's formulas
(layer_norm_kernel.cpp, SoftMaxKernel.cpp), each operation rounded once. blas_pool.cpp's ops compute it
on torch's threads; where they cannot be built, the functions below compute the same bytes with torch's
elementwise ops (tested), as they do for float64. Half and bfloat16 are computed in float32, as ATen does.

The forward passes stay ATen's: each row is one thread's (layer norm; softmax and log-softmax along the
last dimension), so their bytes never followed the count (tests/determinism/test_zoo_threads.py trains
convnext and swin on 1-3 threads).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tasks.determinism import blas, memory

CHAINS = 16  # a row's sum: element j into chain j % CHAINS (normalization.h's kChains)
BLOCK_ROWS = 64  # a column's sum: blocks of this many rows (blas_pool.cpp's kBlockRows)
_REDUCED = (torch.float16, torch.bfloat16)


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
