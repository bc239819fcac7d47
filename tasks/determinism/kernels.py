"""Convolutions and matrix products whose bytes do not depend on the CPU (determinism.cpu: portable).

Why not torch's own CPU paths is in tasks/determinism/cpu_mode.py: MKL's reproducible branches are Intel-only,
oneDNN and NNPACK choose kernels by ISA and cache size. These are CPU kernels for torch's
matrix products and 1-D/2-D convolutions whose products compute each element as one chain of fused
multiply-adds, on torch's threads (tasks/determinism/blas.py; only these ops pay a Python call; autograd
and every other op stay torch's own). A convolution is one matrix product over its im2col columns
(forward, and the weight gradient) and one into columns that are added back in a fixed order (the
input gradient). Without groups the C++ op never writes the columns out (kh * kw times the input):
the products read them from the padded image, and the input gradient's product and adds run at once,
the same bytes (tested). With groups, or where the op cannot be built, the columns are written out
(by ATen's strided copies, pinned to AVX2 like every ATen kernel) and added back by the op (or torch).
A depthwise convolution (one channel per group) is computed directly instead, without columns
(tasks/determinism/depthwise.py). The out= and in-place forms of the products are routed too
(an op's CPU kernel may call them: the fused CPU attention of nn.MultiheadAttention's inference path
writes through aten::bmm.out). The other ops that would compute with MKL, oneDNN, NNPACK or fbgemm
are refused. Which op runs on which kernel, and which is refused, is tasks/determinism/dispatch.py's:
it installs them.

Whether an operand is stored row- or column-major does not change a product's bytes (each element is
the same chain either way), so the kernels pass views, not copies. Temporaries the products fill come
from numpy: torch, in deterministic mode, fills every new tensor first, a pass over memory for nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tasks.core.errors import Refused
from tasks.determinism import blas, depthwise, memory

_NO_NUMPY = (torch.float16, torch.bfloat16)
FLOATS = (*_NO_NUMPY, *memory.NUMPY_DTYPES)  # what the products multiply (dispatch.py refuses other dtypes)


class PortableOpError(Refused):
    """An op with no CPU-independent implementation ran (or, probed as the model was built, would run) in
    portable mode: one line naming the op and the way out (exit 3 at the entry points)."""


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """mm and bmm (2-D or 3-D operands): one `blas.gemm`; half and bfloat16 are multiplied in
    float32, the same way on every CPU. `bias`: `fusable_bias`'s, added as the product is stored."""
    if a.dtype not in FLOATS or b.dtype not in FLOATS:
        raise PortableOpError(
            f"determinism.cpu: portable multiplies floating-point matrices only, not {a.dtype} by {b.dtype}; use native"
        )
    if bias is not None:  # (fusable_bias: 2-D operands of bias's dtype, computed in it)
        return blas.gemm(a.detach(), b.detach(), memory.empty((a.shape[0], b.shape[1]), a), bias=bias)
    compute = torch.float32 if a.dtype in _NO_NUMPY else a.dtype
    a3, b3 = a.detach().to(compute), b.detach().to(compute)
    a3, b3 = (a3, b3) if a.dim() == 3 else (a3.unsqueeze(0), b3.unsqueeze(0))
    out = _product(a3, b3, memory.empty((a3.shape[0], a3.shape[1], b3.shape[2]), a3))
    out = out if a.dim() == 3 else out[0]
    return out if compute == a.dtype else out.to(a.dtype)


def fusable_bias(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """addmm's `bias` as the product's op adds it (one value per column of a @ b, contiguous), where
    that gives the bytes of the product's own add: 2-D float32 or float64 operands and bias of one dtype,
    the bias a row broadcast down the columns (a linear layer's). None otherwise: added after."""
    dtype = a.dtype
    if a.dim() != 2 or b.dim() != 2 or dtype not in memory.NUMPY_DTYPES or b.dtype != dtype or bias.dtype != dtype:
        return None
    broadcast = bias.dim() == 2 and (bias.shape[0] == 1 or bias.stride(0) == 0)  # one row for every row
    row = bias if bias.dim() == 1 else (bias[0] if broadcast else None)
    if row is None or row.shape != (b.shape[1],):
        return None
    return row.detach().contiguous()


def _shapes(x: torch.Tensor, weight: torch.Tensor, geometry: tuple) -> tuple[int, int, int, int]:
    """(kh, kw, oh, ow) of a convolution."""
    stride, padding, dilation = geometry
    kh, kw = weight.shape[2:]
    oh = depthwise.out_size(x.shape[2], kh, stride[0], padding[0], dilation[0])
    ow = depthwise.out_size(x.shape[3], kw, stride[1], padding[1], dilation[1])
    return kh, kw, oh, ow


def _product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` = a @ b per group (3-D), written in place: one `blas.gemm` call for every group (a
    grouped convolution may have dozens); half and bfloat16 as in `matmul`."""
    if out.dtype in _NO_NUMPY:
        a32, b32 = a.float(), b.float()
        out.copy_(blas.gemm(a32, b32, memory.empty(tuple(out.shape), a32)))
    else:
        blas.gemm(a, b, out)
    return out


Columns = torch.Tensor | blas.Fields


def _columns(x: torch.Tensor, weight: torch.Tensor, geometry: tuple, groups: int, take: Any) -> Columns:
    """Every receptive field as a row: (groups, N * oh * ow, kh * kw * C/groups), channels fastest,
    in memory from `take(shape, like)`. Without groups, where the op is built, they are never written
    out: `blas.Fields`, the padded image they are read from (the products gather each strip of them
    where the kernel reads it, the same values), a ninth of their size for a 3x3 kernel."""
    stride, padding, dilation = geometry
    n, c, h, w = x.shape
    op = blas.op("padded_image") if groups == 1 and x.dtype in memory.NUMPY_DTYPES else None
    if op is None:
        return _copied_columns(x, weight, geometry, groups, take)
    image = take((n, h + 2 * padding[0], w + 2 * padding[1], c), x)
    op(x, image, *padding)
    return blas.Fields(image, tuple(weight.shape[2:]), stride, dilation)


def _by_columns(columns: Columns, b: torch.Tensor, out: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """`out` = columns @ b per group, or columns^T @ b (`transposed`): `_product`, or `blas.field_gemm`."""
    if isinstance(columns, blas.Fields):
        blas.field_gemm(columns, b[0], out[0], transposed)
        return out
    return _product(columns.transpose(1, 2) if transposed else columns, b, out)


def _copied_columns(x: torch.Tensor, weight: torch.Tensor, geometry: tuple, groups: int, take: Any) -> torch.Tensor:
    """`_columns` in torch's copies. The padded image is written in one pass and the rows in a second.
    Without groups it is channels-last, so each copied run is kw * C contiguous values rather than a few
    pixels; with groups channel-first, so a group's rows are read from its own planes. Either way the rows
    hold the same values."""
    stride, padding, dilation = geometry
    n, c, h, w = x.shape
    kh, kw, oh, ow = _shapes(x, weight, geometry)
    channels_last = groups == 1
    with memory.temporaries() as temporary:
        padded = _padded_image(x, padding, channels_last, temporary)
        padded[:, padding[0] : padding[0] + h, padding[1] : padding[1] + w].copy_(x.permute(0, 2, 3, 1))
        sn, sh, sw, sc = padded.stride()
        fields = padded.as_strided(
            (n, oh, ow, kh, kw, c), (sn, sh * stride[0], sw * stride[1], sh * dilation[0], sw * dilation[1], sc)
        )
        columns = take((groups, n * oh * ow, kh * kw * (c // groups)), x)
        if channels_last:
            columns.view(n, oh, ow, kh, kw, c).copy_(fields)
        else:
            per_group = fields.reshape(n, oh, ow, kh, kw, groups, c // groups).permute(5, 0, 1, 2, 3, 4, 6)
            columns.view(groups, n, oh, ow, kh, kw, -1).copy_(per_group)
    return columns


def _padded_image(x: torch.Tensor, padding: tuple, channels_last: bool, take: Any) -> torch.Tensor:
    """Memory for `x` with its padding, seen as (N, H, W, C) but laid out channels-last or channel-first;
    the padding zeroed and the inside left to the caller: reused memory holds the last image's values."""
    n, c, h, w = x.shape
    height, width = h + 2 * padding[0], w + 2 * padding[1]
    image = take((n, height, width, c) if channels_last else (n, c, height, width), x)
    image = image if channels_last else image.permute(0, 2, 3, 1)  # (N, H, W, C) either way
    top, left = padding
    if top:
        image[:, :top].zero_()
        image[:, -top:].zero_()
    if left:
        image[:, :, :left].zero_()
        image[:, :, -left:].zero_()
    return image


# Forward columns kept for the same convolution's backward (its weight gradient needs them again):
# keyed by the input tensor itself, which the entry holds, so its memory cannot be reused for another
# tensor, and by its version counter, so an in-place change since makes it a miss. Bounded: a forward
# without a backward (an exception, an abandoned graph) is dropped after _KEPT newer ones. The
# columns' memory is the pool's: it goes back once the backward has used it (or the entry is dropped).
_KEPT = 256
_kept: dict[tuple, tuple[torch.Tensor, Columns, np.ndarray | None]] = {}


def _key(x: torch.Tensor, weight: torch.Tensor, geometry: tuple, groups: int) -> tuple:
    return (x._cdata, x._version, tuple(x.shape), tuple(weight.shape), geometry, groups)


def _forward_columns(x: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, geometry: tuple, groups: int):  # noqa: ANN202
    """`_columns` of `x2` for a forward, and a function to call once the forward is done with them:
    it keeps them for the backward when autograd will ask for the weight gradient, else frees them."""
    arrays: list[np.ndarray | None] = []

    def take(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        tensor, array = memory.pool.take(shape, like)
        arrays.append(array)
        return tensor

    columns = _columns(x2, weight, geometry, groups, take)

    def done() -> None:
        if torch.is_grad_enabled() and weight.requires_grad:
            if len(_kept) >= _KEPT:
                memory.pool.give(_kept.pop(next(iter(_kept)))[2])
            _kept[_key(x, weight, geometry, groups)] = (x, columns, arrays[0])
        else:
            memory.pool.give(arrays[0])

    return columns, done


def _weight_matrix(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """(O, C/g, kh, kw) -> (groups, O/g, kh * kw * C/g): each output channel's weights in the order of
    `_columns`' columns. The forward multiplies by its transpose, which the op reads in place: the copy is
    then a small transpose within each output channel's weights, rather than one across all of them
    (several times slower on large layers). The products' bytes do not depend on the layout the op reads."""
    o, cg, kh, kw = weight.shape
    return weight.permute(0, 2, 3, 1).reshape(groups, o // groups, kh * kw * cg)


# The input gradient's product and col2im run at once (the `input_gradient` op) where the weights take at
# most _FUSED_WEIGHT_BYTES: the op multiplies each strip of output positions by all of them, so larger ones
# (a resnet's 256 and 512 channels) are read from further out than the L2 cache once per strip, where the
# columns' product blocks them and is faster. And where an image has _FUSED_POSITIONS at least: on a 1x1
# map (a squeeze-excitation's) the op's products are a few rows each.
_FUSED_WEIGHT_BYTES = 768 << 10
_FUSED_POSITIONS = 8


def _fused(per_group: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the input gradient takes the `input_gradient` op (see above)."""
    if per_group.shape[0] != 1 or x.dtype not in memory.NUMPY_DTYPES:
        return False
    small = weight.numel() * weight.element_size() <= _FUSED_WEIGHT_BYTES
    return small and per_group.shape[1] // x.shape[0] >= _FUSED_POSITIONS


def _input_gradient(per_group: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, geometry: tuple, take: Any):  # noqa: ANN202
    """The input gradient: the output gradient times the weights, as columns (g, N*oh*ow, kh*kw*C/g), added
    back onto the input positions they were read from (`_add_columns`). Without groups, where the op is
    built, both at once (the `input_gradient` op) for small weights (`_fused`): the same bytes, without the
    columns."""
    groups = per_group.shape[0]
    weights = _weight_matrix(weight, groups)  # (g, O/g, kh*kw*C/g)
    op = blas.op("input_gradient") if _fused(per_group, x, weight) else None
    if op is not None:
        stride, padding, dilation = geometry
        out = memory.empty(tuple(x.shape), x)
        op(per_group[0], weights[0], out, *weight.shape[2:], *stride, *padding, *dilation)
        return out
    columns = _product(per_group, weights, take((groups, per_group.shape[1], weights.shape[2]), per_group))
    return _add_columns(columns, x, weight, geometry)


def _add_columns(columns: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, geometry: tuple) -> torch.Tensor:
    """col2im: each row of (groups, N * oh * ow, kh * kw * C/g) back onto the input positions it was
    read from, kernel offset by kernel offset: a fixed order of additions, the same bytes anywhere.
    The loop below adds into a zeroed, padded image (channels-last without groups, channel-first with, as
    `_columns` reads them); the op sums each input position's terms in the same order, in one pass."""
    stride, padding, dilation = geometry
    n, c, h, w = x.shape
    kh, kw, oh, ow = _shapes(x, weight, geometry)
    groups = columns.shape[0]
    fields = columns.reshape(groups, n, oh, ow, kh, kw, c // groups).permute(1, 2, 3, 4, 5, 0, 6)
    fields = fields.reshape(n, oh, ow, kh, kw, c)
    op = blas.op("gather_columns") if x.dtype in memory.NUMPY_DTYPES else None
    if op is not None:
        out = memory.empty((n, c, h, w), x)
        op(fields, out, *stride, *padding, *dilation)
        return out
    channels_last = groups == 1
    height, width = h + 2 * padding[0], w + 2 * padding[1]
    with memory.temporaries() as temporary:
        grad = temporary((n, height, width, c) if channels_last else (n, c, height, width), x).zero_()
        grad = grad if channels_last else grad.permute(0, 2, 3, 1)  # (N, H, W, C) either way
        for i in range(kh):
            for j in range(kw):
                top, left = i * dilation[0], j * dilation[1]
                rows = slice(top, top + stride[0] * (oh - 1) + 1, stride[0])
                cols = slice(left, left + stride[1] * (ow - 1) + 1, stride[1])
                grad[:, rows, cols, :] += fields[:, :, :, i, j, :]
        grad = grad[:, padding[0] : padding[0] + h, padding[1] : padding[1] + w, :]
        return memory.empty((n, c, h, w), x).copy_(grad.permute(0, 3, 1, 2))


def _geometry_1d(stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]) -> tuple:
    return ((1, stride[0]), (0, padding[0]), (1, dilation[0]))


def _to_2d(
    x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]
):
    if x.dim() == 4:
        return x, weight, (tuple(stride), tuple(padding), tuple(dilation))
    if x.dim() == 3:
        return x.unsqueeze(2), weight.unsqueeze(2), _geometry_1d(stride, padding, dilation)
    raise PortableOpError(f"determinism.cpu: portable has no {x.dim() - 2}-D convolution; use native")


def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):  # noqa: ANN001, ANN201
    """aten.convolution: one product of the input's receptive fields with the weights, per group."""
    if transposed:
        raise PortableOpError("determinism.cpu: portable has no transposed convolution; use native")
    if x.dtype not in FLOATS or weight.dtype not in FLOATS:
        raise PortableOpError(
            f"determinism.cpu: portable convolves floating-point tensors only, not {x.dtype} by {weight.dtype}; "
            "use native"
        )
    x2, w2, geometry = _to_2d(x, weight, stride, padding, dilation)
    if depthwise.is_depthwise(x2, w2, groups):
        out = depthwise.forward(x2, w2, geometry)
        out = out if bias is None else out.add_(bias.view(1, -1, 1, 1))
        return out if x.dim() == 4 else out.squeeze(2)
    n, out_channels = x.shape[0], weight.shape[0]
    _, _, oh, ow = _shapes(x2, w2, geometry)
    columns, done = _forward_columns(x, x2, w2, geometry, groups)
    with memory.temporaries() as temporary:
        product = temporary((groups, n * oh * ow, out_channels // groups), x2)
        _by_columns(columns, _weight_matrix(w2, groups).transpose(1, 2), product)
        done()
        # (g, N, oh, ow, O/g) -> the NCHW output, split by group, in one pass with the bias
        product = product.view(groups, n, oh, ow, -1).permute(1, 0, 4, 2, 3)
        out = memory.empty((n, out_channels, oh, ow), x2)
        grouped = out.view(n, groups, -1, oh, ow)
        if bias is None:
            grouped.copy_(product)
        else:
            torch.add(product, bias.view(1, groups, -1, 1, 1), out=grouped)
    return out if x.dim() == 4 else out.squeeze(2)


def convolution_backward(
    grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask
):  # noqa: ANN001, ANN201, E501
    """aten.convolution_backward: (input, weight, bias) gradients, those `mask` asks for."""
    x2, w2, geometry = _to_2d(x, weight, stride, padding, dilation)
    grad2 = grad if grad.dim() == 4 else grad.unsqueeze(2)
    if depthwise.is_depthwise(x2, w2, groups):
        grad_input, grad_weight = depthwise.backward(grad2, x2, w2, geometry, mask)
    else:
        grad_input, grad_weight = _gradients(grad2, x, x2, w2, geometry, groups, mask)
    grad_input = grad_input if grad_input is None or x.dim() == 4 else grad_input.squeeze(2)
    grad_weight = None if grad_weight is None else grad_weight.reshape(weight.shape)
    grad_bias = grad.sum([d for d in range(grad.dim()) if d != 1]) if mask[2] else None
    return grad_input, grad_weight, grad_bias


def _gradients(
    grad2: torch.Tensor,
    x: torch.Tensor,
    x2: torch.Tensor,
    w2: torch.Tensor,
    geometry: tuple,
    groups: int,
    mask: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(input, weight) gradients of a 2-D convolution through its columns, those `mask` asks for."""
    n, out_channels, oh, ow = grad2.shape
    grad_input = grad_weight = None
    with memory.temporaries() as temporary:
        # (g, N*oh*ow, O/g): the output gradient channels-last, split by group
        per_group = temporary((groups, n * oh * ow, out_channels // groups), grad2)
        per_group.view(groups, n, oh, ow, -1).copy_(grad2.view(n, groups, -1, oh, ow).permute(1, 0, 3, 4, 2))
        if mask[1]:
            grad_weight = _weight_gradient(x, x2, w2, geometry, groups, per_group, temporary)
        if mask[0]:
            grad_input = _input_gradient(per_group, x2, w2, geometry, temporary)
    return grad_input, grad_weight


def _weight_gradient(
    x: torch.Tensor,
    x2: torch.Tensor,
    w2: torch.Tensor,
    geometry: tuple,
    groups: int,
    per_group: torch.Tensor,
    take: Any,
) -> torch.Tensor:
    """(O, C/g, kh, kw), new memory: the forward's columns (kept, or made again) times the output
    gradient, per group, laid out as the weight."""
    kept = _kept.pop(_key(x, w2, geometry, groups), None)
    columns, array = (kept[1], kept[2]) if kept is not None else (_columns(x2, w2, geometry, groups, take), None)
    o, cg, kh, kw = w2.shape
    product = take((groups, kh * kw * cg, per_group.shape[2]), per_group)  # (g, kh*kw*C/g, O/g)
    _by_columns(columns, per_group, product, transposed=True)
    memory.pool.give(array)
    grad_weight = memory.empty((o, cg, kh, kw), w2)
    # (g, kh*kw, C/g, O/g) -> (g, O/g, C/g, kh*kw)
    by_offset = product.view(groups, kh * kw, cg, -1).transpose(1, 2)
    blas.rotated_copy(by_offset, grad_weight.view(groups, -1, cg, kh * kw))
    return grad_weight


def clear() -> None:
    """Drop the columns kept for backward and the pooled temporaries (the kernels are being uninstalled)."""
    _kept.clear()
    memory.pool.clear()
