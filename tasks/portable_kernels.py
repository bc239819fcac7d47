"""Convolutions and matrix products whose bytes do not depend on the CPU (determinism.cpu: portable).

Why not torch's own CPU paths is in tasks/cpu_mode.py: MKL's reproducible branches are Intel-only,
oneDNN and NNPACK choose kernels by ISA and cache size. `install` registers CPU kernels for torch's
matrix products and 1-D/2-D convolutions that compute with numpy's OpenBLAS, pinned to its Haswell
kernels (only these ops pay a Python call; autograd and every other op stay torch's own). A
convolution is one matrix product over its im2col columns (forward, and the weight gradient) and
one into columns that are added back in a fixed order (the input gradient); the columns are
strided copies and adds in ATen, pinned to AVX2 like every ATen kernel. The few other ops that
would reach MKL are refused rather than computed with CPU-dependent bytes.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

_NO_NUMPY = (torch.float16, torch.bfloat16)
# ops that compute with MKL or oneDNN and have no portable route here
_REFUSED = ("addmv", "mv", "dot", "baddbmm", "addbmm", "_scaled_dot_product_flash_attention_for_cpu")


class PortableOpError(RuntimeError):
    """An op with no CPU-independent implementation ran in portable mode."""


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # numpy hands contiguous or transposed operands to BLAS as they are and copies others first;
    # half and bfloat16 (which numpy lacks) are multiplied in float32, the same way on every CPU.
    if a.dtype not in _NO_NUMPY:
        return torch.from_numpy(np.matmul(a.detach().numpy(), b.detach().numpy()))
    return torch.from_numpy(np.matmul(a.detach().float().numpy(), b.detach().float().numpy())).to(a.dtype)


def _out_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _shapes(x: torch.Tensor, weight: torch.Tensor, geometry: tuple) -> tuple[int, int, int, int]:
    """(kh, kw, oh, ow) of a convolution."""
    stride, padding, dilation = geometry
    kh, kw = weight.shape[2:]
    oh = _out_size(x.shape[2], kh, stride[0], padding[0], dilation[0])
    ow = _out_size(x.shape[3], kw, stride[1], padding[1], dilation[1])
    return kh, kw, oh, ow


def _columns(x: torch.Tensor, weight: torch.Tensor, geometry: tuple, groups: int) -> torch.Tensor:
    """Every receptive field as a row: (groups, N * oh * ow, kh * kw * C/groups), channels fastest.

    Channels-last, so each copied run is kw * C contiguous values rather than a few pixels.
    """
    stride, padding, dilation = geometry
    n, c = x.shape[:2]
    kh, kw, oh, ow = _shapes(x, weight, geometry)
    padded = F.pad(x, (padding[1], padding[1], padding[0], padding[0])).permute(0, 2, 3, 1).contiguous()
    sn, sh, sw, sc = padded.stride()
    fields = padded.as_strided(
        (n, oh, ow, kh, kw, c), (sn, sh * stride[0], sw * stride[1], sh * dilation[0], sw * dilation[1], sc)
    )
    if groups == 1:
        return fields.reshape(1, n * oh * ow, kh * kw * c)
    per_group = fields.reshape(n * oh * ow, kh * kw, groups, c // groups).permute(2, 0, 1, 3)
    return per_group.reshape(groups, n * oh * ow, -1)


# Forward columns kept for the same convolution's backward (its weight gradient needs them again):
# keyed by the input tensor itself, which the entry holds, so its memory cannot be reused for another
# tensor, and by its version counter, so an in-place change since makes it a miss. Bounded: a forward
# without a backward (an exception, an abandoned graph) is dropped after _KEPT newer ones.
_KEPT = 256
_kept: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _key(x: torch.Tensor, weight: torch.Tensor, geometry: tuple, groups: int) -> tuple:
    return (x._cdata, x._version, tuple(x.shape), tuple(weight.shape), geometry, groups)


def _keep(x: torch.Tensor, weight: torch.Tensor, geometry: tuple, groups: int, columns: torch.Tensor) -> None:
    if torch.is_grad_enabled() and weight.requires_grad:
        if len(_kept) >= _KEPT:
            _kept.pop(next(iter(_kept)))
        _kept[_key(x, weight, geometry, groups)] = (x, columns)


def _columns_again(x: torch.Tensor, weight: torch.Tensor, geometry: tuple, groups: int) -> torch.Tensor:
    kept = _kept.pop(_key(x, weight, geometry, groups), None)
    return kept[1] if kept is not None else _columns(x, weight, geometry, groups)


def _weight_matrix(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """(O, C/g, kh, kw) -> (groups, kh * kw * C/g, O/g), the rows ordered as `_columns`' columns."""
    o, cg, kh, kw = weight.shape
    return weight.reshape(groups, o // groups, cg, kh, kw).permute(0, 3, 4, 2, 1).reshape(groups, kh * kw * cg, -1)


def _add_columns(columns: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, geometry: tuple) -> torch.Tensor:
    """col2im: each row of (groups, N * oh * ow, kh * kw * C/g) back onto the input positions it was
    read from, kernel offset by kernel offset: a fixed order of additions, the same bytes anywhere."""
    stride, padding, dilation = geometry
    n, c, h, w = x.shape
    kh, kw, oh, ow = _shapes(x, weight, geometry)
    groups = columns.shape[0]
    fields = columns.reshape(groups, n, oh, ow, kh, kw, c // groups).permute(1, 2, 3, 4, 5, 0, 6)
    fields = fields.reshape(n, oh, ow, kh, kw, c)
    grad = x.new_zeros((n, h + 2 * padding[0], w + 2 * padding[1], c))
    for i in range(kh):
        for j in range(kw):
            top, left = i * dilation[0], j * dilation[1]
            rows = slice(top, top + stride[0] * (oh - 1) + 1, stride[0])
            cols = slice(left, left + stride[1] * (ow - 1) + 1, stride[1])
            grad[:, rows, cols, :] += fields[:, :, :, i, j, :]
    grad = grad[:, padding[0] : padding[0] + h, padding[1] : padding[1] + w, :]
    return grad.permute(0, 3, 1, 2).contiguous()


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
    x2, w2, geometry = _to_2d(x, weight, stride, padding, dilation)
    _, _, oh, ow = _shapes(x2, w2, geometry)
    columns = _columns(x2, w2, geometry, groups)
    _keep(x, w2, geometry, groups, columns)
    out = _matmul(columns, _weight_matrix(w2, groups))  # (g, N*oh*ow, O/g)
    out = out.permute(1, 0, 2).reshape(x.shape[0], oh, ow, weight.shape[0]).permute(0, 3, 1, 2)
    if bias is not None:
        out = out + bias.view(1, -1, 1, 1)
    out = out.contiguous()
    return out if x.dim() == 4 else out.squeeze(2)


def convolution_backward(
    grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask
):  # noqa: ANN001, ANN201, E501
    """aten.convolution_backward: (input, weight, bias) gradients, those `mask` asks for."""
    x2, w2, geometry = _to_2d(x, weight, stride, padding, dilation)
    grad2 = grad if grad.dim() == 4 else grad.unsqueeze(2)
    n, out_channels, oh, ow = grad2.shape
    # (g, N*oh*ow, O/g): the output gradient channels-last, split by group
    per_group = grad2.permute(0, 2, 3, 1).reshape(n * oh * ow, groups, -1).permute(1, 0, 2).contiguous()
    grad_input = grad_weight = grad_bias = None
    if mask[1]:
        columns = _columns_again(x, w2, geometry, groups)
        product = _matmul(columns.transpose(1, 2), per_group)  # (g, kh*kw*C/g, O/g)
        kh, kw = w2.shape[2:]
        product = product.reshape(groups, kh, kw, -1, out_channels // groups).permute(0, 4, 3, 1, 2)
        grad_weight = product.reshape(weight.shape)
    if mask[0]:
        columns = _matmul(per_group, _weight_matrix(w2, groups).transpose(1, 2))  # (g, N*oh*ow, kh*kw*C/g)
        grad_input = _add_columns(columns, x2, w2, geometry)
        grad_input = grad_input if x.dim() == 4 else grad_input.squeeze(2)
    if mask[2]:
        grad_bias = grad.sum([d for d in range(grad.dim()) if d != 1])
    return grad_input, grad_weight, grad_bias


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1) -> torch.Tensor:
    product = _matmul(a, b)
    product = product if alpha == 1 else product * alpha
    return product + (bias if beta == 1 else bias * beta)


def _refuse(name: str):  # noqa: ANN202
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise PortableOpError(f"determinism.cpu: portable has no CPU-independent aten::{name}; use native")

    return kernel


_ROUTES = {
    "mm": _matmul,
    "bmm": _matmul,
    "addmm": _addmm,
    "convolution": convolution,
    "convolution_backward": convolution_backward,
    **{name: _refuse(name) for name in _REFUSED},
}
_library: torch.library.Library | None = None


def install() -> None:
    """Route the ops to the kernels above, for every CPU tensor of this process, until `uninstall`."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore", UserWarning)
        for name, kernel in _ROUTES.items():
            library.impl(name, kernel, "CPU")
    _library = library


def uninstall() -> None:
    """torch's own CPU kernels again (native mode)."""
    global _library
    _kept.clear()
    if _library is not None:
        _library._destroy()
        _library = None


def installed() -> bool:
    """Whether this process computes with the portable kernels."""
    return _library is not None
