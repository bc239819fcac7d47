"""Depthwise convolutions (one channel per group: mobilenet, efficientnet, convnext) for determinism.cpu: portable.

kernels.py's general path would copy kh * kw columns per channel (im2col) and multiply them by a matrix of
one column: a product whose inner dimension is kh * kw, the shape a product kernel is slowest at, and copies
several times the arithmetic. Here every element is a short sum in one fixed order instead:

- the output: over the kernel's offsets (i, then j), starting from 0;
- the input gradient: the same, added onto the input's positions as col2im adds;
- the weight gradient: the products over (image, row, column) in that order, then added in halves
  (element k plus element k + ceil(L/2), until one is left).

Terms that meet the padding are left out (they would add zeros). Each term is a rounded product and
then a rounded sum, with no fused multiply-add: the same bytes on any CPU. blas_pool.cpp's `depthwise`
op computes them (built without contraction); where it cannot be built, the loops below compute the
same ones with torch's elementwise ops (tested byte for byte).
Half and bfloat16 are computed in float32, as the products are.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from tasks.determinism import blas, memory

_OUTPUT, _INPUT_GRADIENT, _WEIGHT_GRADIENT = 0, 1, 2  # blas_pool.cpp's `part`
# A weight gradient sums each channel over all its output positions. Channels-last, a block of channels is
# read once per kernel offset, from cache while the block's positions fit there; past this many positions
# (images x rows x columns) the channels' planes, copied out, are read better.
LAST_POSITIONS = 4096


def is_depthwise(x: torch.Tensor, weight: torch.Tensor, groups: int) -> bool:
    """Whether a 2-D convolution has one input and one output channel per group."""
    return groups > 1 and x.shape[1] == groups and tuple(weight.shape[:2]) == (groups, 1)


def forward(x: torch.Tensor, weight: torch.Tensor, geometry: tuple) -> torch.Tensor:
    """The output (N, C, oh, ow) of a depthwise convolution of `x` (N, C, H, W) by `weight` (C, 1, kh, kw),
    without bias, in `x`'s memory layout; `geometry` is (stride, padding, dilation), each (rows, columns)."""
    last = memory.channels_last(x)
    (xc,), w = _operands(x, last, x), _weights(x, weight)
    oh, ow = (out_size(x.shape[2 + d], w.shape[2 + d], *(part[d] for part in geometry)) for d in (0, 1))
    out = _empty((x.shape[0], x.shape[1], oh, ow), xc, last)
    return _compute(_OUTPUT, xc, w, out, geometry, last).to(x.dtype)


def backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, geometry: tuple, mask: Sequence[bool]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(input gradient, weight gradient) of `forward`, each if `mask` asks for it (as convolution_backward's);
    computed channels-last where `grad` or `x` is (the input gradient comes back so)."""
    w = _weights(x, weight)
    last = memory.channels_last(grad) or memory.channels_last(x)
    grad_input = grad_weight = None
    if mask[0]:
        (g,) = _operands(x, last, grad)
        grad_input = _compute(_INPUT_GRADIENT, g, w, _empty(tuple(x.shape), g, last), geometry, last).to(x.dtype)
    if mask[1]:
        last = last and grad.shape[0] * grad.shape[2] * grad.shape[3] <= LAST_POSITIONS
        g, xc = _operands(x, last, grad, x)
        grad_weight = _compute(_WEIGHT_GRADIENT, g, xc, memory.empty(tuple(w.shape), g), geometry, last)
        grad_weight = grad_weight.to(weight.dtype)
    return grad_input, grad_weight


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The kernels' dtype for `x`: its own, or float32 for half and bfloat16."""
    return x.dtype if x.dtype in memory.NUMPY_DTYPES else torch.float32


def _operands(x: torch.Tensor, last: bool, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Activations `tensors` as the kernels take them: contiguous (channels-last if `last`), in the compute
    dtype of `x`."""
    layout = torch.channels_last if last else torch.contiguous_format
    return tuple(t.detach().to(_compute_dtype(x)).contiguous(memory_format=layout) for t in tensors)


def _weights(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight.detach().to(_compute_dtype(x)).contiguous()


def _empty(shape: tuple[int, ...], like: torch.Tensor, last: bool) -> torch.Tensor:
    """New memory (N, C, H, W) for a result, channels-last if `last`."""
    if not last:
        return memory.empty(shape, like)
    n, c, h, w = shape
    return memory.empty((n, h, w, c), like).permute(0, 3, 1, 2)


def _compute(
    part: int, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, geometry: tuple, last: bool
) -> torch.Tensor:
    """`out` (all of it written) = `part` of a depthwise convolution, by the op or, where it cannot be built,
    by the same sums in torch loops: the output (a = x, b = w), the input gradient (a = g, b = w) or the
    weight gradient (a = g, b = x). `last`: the activations are channels-last."""
    op = blas.op("depthwise")
    if op is not None:
        op(a, b, out, part, *(value for pair in geometry for value in pair), last)
        return out
    out.zero_()
    if part == _OUTPUT:
        for i, j, at_out, at_in in _taps(a, b, out, geometry):
            out[at_out] += a[at_in] * b[:, :, i, j].view(1, -1, 1, 1)
    elif part == _INPUT_GRADIENT:
        for i, j, at_out, at_in in _taps(out, b, a, geometry):
            out[at_in] += a[at_out] * b[:, :, i, j].view(1, -1, 1, 1)
    else:
        for i, j, at_out, at_in in _taps(b, out, a, geometry):
            out[:, 0, i, j] = _halves((a[at_out] * b[at_in]).transpose(0, 1).reshape(a.shape[1], -1))
    return out


def out_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """A convolution's output length along one dimension."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _span(size: int, extent: int, stride: int, offset: int) -> slice:
    """The positions o in [0, extent) whose input position o * stride + offset lies in [0, size), as
    blas_pool.cpp's `span` (may be empty)."""
    first = 0 if offset >= 0 else (-offset + stride - 1) // stride
    last = 0 if size - 1 - offset < 0 else min(extent, (size - 1 - offset) // stride + 1)
    return slice(first, max(first, last))


def _taps(image: torch.Tensor, w: torch.Tensor, small: torch.Tensor, geometry: tuple) -> Iterator[tuple]:
    """(i, j, where in `small` (the output or its gradient), where in `image` (the input or its gradient)) for
    each of the kernel's offsets in the op's order, over the positions whose input is not padding; offsets
    that meet only padding are left out."""
    stride, padding, dilation = geometry
    for i in range(w.shape[2]):
        rows = _span(image.shape[2], small.shape[2], stride[0], i * dilation[0] - padding[0])
        for j in range(w.shape[3]):
            cols = _span(image.shape[3], small.shape[3], stride[1], j * dilation[1] - padding[1])
            if rows.start == rows.stop or cols.start == cols.stop:
                continue
            top, left = (
                rows.start * stride[0] + i * dilation[0] - padding[0],
                cols.start * stride[1] + j * dilation[1] - padding[1],
            )
            at_in = slice(top, top + (rows.stop - rows.start - 1) * stride[0] + 1, stride[0])
            at_in_cols = slice(left, left + (cols.stop - cols.start - 1) * stride[1] + 1, stride[1])
            yield i, j, (slice(None), slice(None), rows, cols), (slice(None), slice(None), at_in, at_in_cols)


def _halves(terms: torch.Tensor) -> torch.Tensor:
    """Each row of `terms` (C, L) summed as the op sums a weight gradient's terms: element k plus element
    k + ceil(L/2), until one is left."""
    while terms.shape[1] > 1:
        length = terms.shape[1]
        half = (length + 1) // 2
        head = terms[:, :half].clone()
        head[:, : length - half] += terms[:, half:]
        terms = head
    return terms[:, 0]
