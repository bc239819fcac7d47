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


def _columns(x: torch.Tensor, weight: torch.Tensor, geometry: tuple, groups: int) -> tuple[torch.Tensor, tuple]:
    """Every receptive field as a column: (groups, C/groups * kh * kw, N * oh * ow), and (oh, ow)."""
    stride, padding, dilation = geometry
    n, c, h, w = x.shape
    kh, kw = weight.shape[2:]
    padded = F.pad(x, (padding[1], padding[1], padding[0], padding[0])).contiguous()
    oh = _out_size(h, kh, stride[0], padding[0], dilation[0])
    ow = _out_size(w, kw, stride[1], padding[1], dilation[1])
    sn, sc, sh, sw = padded.stride()
    fields = padded.as_strided(
        (c, kh, kw, n, oh, ow), (sc, sh * dilation[0], sw * dilation[1], sn, sh * stride[0], sw * stride[1])
    )
    return fields.reshape(groups, c // groups * kh * kw, n * oh * ow), (oh, ow)


def _add_columns(columns: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, geometry: tuple) -> torch.Tensor:
    """col2im: each column back onto the input positions it was read from, kernel offset by offset."""
    stride, padding, dilation = geometry
    n, c, h, w = x.shape
    kh, kw = weight.shape[2:]
    oh = _out_size(h, kh, stride[0], padding[0], dilation[0])
    ow = _out_size(w, kw, stride[1], padding[1], dilation[1])
    fields = columns.reshape(c, kh, kw, n, oh, ow).permute(3, 0, 1, 2, 4, 5)
    grad = x.new_zeros((n, c, h + 2 * padding[0], w + 2 * padding[1]))
    for i in range(kh):  # a fixed order of additions: the same bytes on any machine
        for j in range(kw):
            top, left = i * dilation[0], j * dilation[1]
            rows = slice(top, top + stride[0] * (oh - 1) + 1, stride[0])
            cols = slice(left, left + stride[1] * (ow - 1) + 1, stride[1])
            grad[:, :, rows, cols] += fields[:, :, i, j]
    return grad[:, :, padding[0] : padding[0] + h, padding[1] : padding[1] + w].contiguous()


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
    """aten.convolution: one product of the weights with the input's columns, per group."""
    if transposed:
        raise PortableOpError("determinism.cpu: portable has no transposed convolution; use native")
    x2, w2, geometry = _to_2d(x, weight, stride, padding, dilation)
    columns, (oh, ow) = _columns(x2, w2, geometry, groups)
    out_channels = weight.shape[0]
    out = _matmul(w2.reshape(groups, out_channels // groups, -1), columns)
    out = out.reshape(out_channels, x.shape[0], oh, ow).permute(1, 0, 2, 3)
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
    out_channels, n = weight.shape[0], x.shape[0]
    per_group = grad2.permute(1, 0, 2, 3).reshape(groups, out_channels // groups, -1)
    grad_input = grad_weight = grad_bias = None
    if mask[1]:
        columns, _ = _columns(x2, w2, geometry, groups)
        grad_weight = _matmul(per_group, columns.transpose(1, 2)).reshape(weight.shape)
    if mask[0]:
        columns = _matmul(w2.reshape(groups, out_channels // groups, -1).transpose(1, 2), per_group)
        grad_input = _add_columns(columns.reshape(-1, n * grad2.shape[2] * grad2.shape[3]), x2, w2, geometry)
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
    if _library is not None:
        _library._destroy()
        _library = None


def installed() -> bool:
    """Whether this process computes with the portable kernels."""
    return _library is not None
