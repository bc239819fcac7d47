"""Which of torch's CPU ops determinism.cpu: portable computes with its own kernels, and which it refuses.

`install` registers tasks/determinism/kernels.py's matrix products and convolutions for their ATen ops
(the out= and in-place forms too: an op's CPU kernel may call them, as the fused CPU attention of
nn.MultiheadAttention's inference path writes through aten::bmm.out), activations.py's sigmoid, SiLU
and GELU, reductions.py's sum and mean, normalization.py's batch norm, layer norm, softmax and
log-softmax, sampling.py's normal_ and erfinv, exp_activations.py's mish, softplus and ELU (whose ATen
kernels' values followed the thread count, and whose exp and log differ on arm64), and a refusal for every overload
of the other ops that would compute with MKL, oneDNN, NNPACK or fbgemm (matrix-vector products, LAPACK,
FFT, fused attention, torch's convolution backends called directly, packed-weight products), rather
than let them compute CPU-dependent bytes. `refusal` says which call would be refused, and
tasks/determinism/escapes.py asks it while probing a model before it trains.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from tasks.determinism import activations, exp_activations, kernels, normalization, reductions, sampling

# ATen ops (every overload) that compute with MKL, oneDNN, NNPACK or fbgemm on the CPU and have no
# portable route here; a name this torch does not have is skipped.
_REFUSED = (
    # matrix-vector products, and products added up over a batch
    *("addmv", "addmv_", "mv", "dot", "vdot", "baddbmm", "baddbmm_", "addbmm", "addbmm_"),
    # integer and packed-weight products
    *("_int_mm", "_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu", "_dyn_quant_matmul_4bit"),
    *("fbgemm_linear_fp16_weight", "fbgemm_linear_fp16_weight_fp32_activation"),
    *("fbgemm_linear_int8_weight", "fbgemm_linear_int8_weight_fp32_activation"),
    # fused attention (scaled_dot_product_attention's CPU kernel)
    *("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"),
    # torch's convolution backends, called directly rather than through aten::convolution
    *("mkldnn_convolution", "_nnpack_spatial_convolution", "_slow_conv2d_forward", "_slow_conv2d_backward"),
    *("slow_conv3d_forward", "slow_conv_dilated2d", "slow_conv_dilated3d", "slow_conv_transpose2d"),
    *("slow_conv_transpose3d", "mkldnn_rnn_layer"),
    # LAPACK (MKL's on x86 builds of torch)
    *("linalg_cholesky_ex", "cholesky_inverse", "_cholesky_solve_helper", "linalg_inv_ex", "_linalg_solve_ex"),
    *("linalg_lu_factor_ex", "linalg_lu", "linalg_lu_solve", "_linalg_det", "_linalg_slogdet", "_linalg_eigh"),
    *("linalg_eig", "_linalg_eigvals", "_linalg_svd", "linalg_qr", "geqrf", "orgqr", "ormqr"),
    *("linalg_householder_product", "linalg_lstsq", "linalg_solve_triangular", "triangular_solve"),
    *("linalg_ldl_factor_ex", "linalg_ldl_solve"),
    # FFT (MKL's)
    *("_fft_r2c", "_fft_c2r", "_fft_c2c"),
)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1) -> torch.Tensor:
    if alpha == 1 and beta == 1 and (row := kernels.fusable_bias(bias, a, b)) is not None:
        return kernels.matmul(a, b, row)  # (a linear layer's: the bias added as the product is stored)
    product = kernels.matmul(a, b)  # new memory: scaled and added to in place, as the same ops out of place
    if alpha != 1:
        product.mul_(alpha)
    if beta == 0:  # as torch: `bias` is not read (it may be uninitialised memory, NaN included)
        return product
    return product.add_(bias if beta == 1 else bias * beta)


def _into(out: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """`result` written into an out= tensor, resized first as torch's out= ops resize it."""
    if out.shape != result.shape:
        out.resize_(result.shape)
    return out.copy_(result)


def _mm_out(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    return _into(out, kernels.matmul(a, b))


def _addmm_out(bias, a, b, *, beta=1, alpha=1, out):  # noqa: ANN001, ANN202
    return _into(out, _addmm(bias, a, b, beta=beta, alpha=alpha))


def _addmm_inplace(bias, a, b, *, beta=1, alpha=1):  # noqa: ANN001, ANN202
    return bias.copy_(_addmm(bias, a, b, beta=beta, alpha=alpha))


def _addmm_activation(bias, a, b, *, beta=1, alpha=1, use_gelu=False):  # noqa: ANN001, ANN202
    """aten::_addmm_activation: addmm, then GELU (exact, as torch's CPU kernel; CUDA's approximates) or ReLU."""
    result = _addmm(bias, a, b, beta=beta, alpha=alpha)
    return torch.nn.functional.gelu(result) if use_gelu else torch.relu(result)


def _addmm_activation_out(bias, a, b, *, beta=1, alpha=1, use_gelu=False, out):  # noqa: ANN001, ANN202
    return _into(out, _addmm_activation(bias, a, b, beta=beta, alpha=alpha, use_gelu=use_gelu))


def _layer_norm_backward_out(*args: Any, out0: torch.Tensor, out1: torch.Tensor, out2: torch.Tensor) -> tuple:
    results = normalization.layer_norm_backward(*args)
    for out, result in zip((out0, out1, out2), results, strict=True):
        if result is not None:  # (a gradient the output mask did not ask for: its out= tensor untouched)
            _into(out, result)
    return out0, out1, out2


def _softmax_backward_out(grad_output, output, dim, input_dtype, *, grad_input):  # noqa: ANN001, ANN202
    return _into(grad_input, normalization.softmax_backward(grad_output, output, dim, input_dtype))


def _convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups, *backend_flags):  # noqa: ANN001, ANN201
    """aten::_convolution (aten::convolution's inner entry, with flags for torch's backends): `convolution`."""
    return kernels.convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


def _activation(kind: str, backward: bool = False, inplace: bool = False):  # noqa: ANN202
    """The route for an overload of an activation (tasks/determinism/activations.py): forward (self) or backward
    (grad_output, self), gelu's `approximate` naming its kind; in place, into `out` (or a backward's
    `grad_input`), or new."""

    def kernel(*args: Any, approximate: str = "none", out: Any = None, grad_input: Any = None) -> torch.Tensor:
        if approximate not in ("none", "tanh"):
            raise ValueError(f"aten::{kind}: approximate is 'none' or 'tanh', not {approximate!r}")
        name = (f"{kind}_tanh" if approximate == "tanh" else kind) + ("_backward" if backward else "")
        x = args[1] if backward else args[0]
        if kind == "sigmoid" and not x.is_floating_point():  # as torch: integers give the default float dtype
            x = x.to(torch.get_default_dtype())
        result = activations.compute(name, x, args[0] if backward else None)
        target = out if out is not None else grad_input
        if inplace:
            return args[0].copy_(result)
        return result if target is None else _into(target, result)

    return kernel


def _refuse(name: str):  # noqa: ANN202
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise kernels.PortableOpError(f"determinism.cpu: portable has no CPU-independent aten::{name}; use native")

    kernel.refuses = True
    return kernel


# The ops computed here, by ATen name (overload after the dot).
_ROUTES = {
    "mm": kernels.matmul,
    "mm.out": _mm_out,
    "bmm": kernels.matmul,
    "bmm.out": _mm_out,
    "addmm": _addmm,
    "addmm.out": _addmm_out,
    "addmm_": _addmm_inplace,
    "_addmm_activation": _addmm_activation,
    "_addmm_activation.out": _addmm_activation_out,
    "convolution": kernels.convolution,
    "_convolution": _convolution,
    "convolution_backward": kernels.convolution_backward,
    # backward passes whose ATen kernels' sums followed the thread count (normalization.py)
    "native_layer_norm_backward": normalization.layer_norm_backward,
    "native_layer_norm_backward.out": _layer_norm_backward_out,
    "_softmax_backward_data": normalization.softmax_backward,
    "_softmax_backward_data.out": _softmax_backward_out,
    # activations built on e^x, whose ATen kernels' values followed the thread count and whose exp and
    # log differ on arm64 (exp_activations.py)
    "mish": exp_activations.mish,
    "mish_": exp_activations.mish_,
    "mish_backward": exp_activations.mish_backward,
    "softplus": exp_activations.softplus,
    "softplus_backward": exp_activations.softplus_backward,
    "elu": exp_activations.elu,
    "elu_": exp_activations.elu_,
    "elu_backward": exp_activations.elu_backward,
    # sums (and the sqrt, exp and log beside them) whose ATen kernels' bytes differed between x86-64 and
    # arm64, or followed the thread count (reductions.py, normalization.py)
    "sum": reductions.sum_all,
    "sum.dim_IntList": reductions.sum_dim,
    "mean": reductions.mean_all,
    "mean.dim": reductions.mean_dim,
    "_softmax": normalization.softmax,
    "_log_softmax": normalization.log_softmax,
    "_log_softmax_backward_data": normalization.log_softmax_backward,
    "native_layer_norm": normalization.layer_norm,
    "native_batch_norm": normalization.batch_norm,
    "native_batch_norm_backward": normalization.batch_norm_backward,
    # random draws whose ATen kernels' transcendental functions differ on arm64 (sampling.py): torchvision's
    # kaiming and truncated normal initialisations
    "normal_": sampling.normal_,
    "erfinv": sampling.erfinv,
    "erfinv_": sampling.erfinv_,
    # activations whose ATen kernels compute a tensor's tail otherwise than its body (activations.py)
    **{
        f"{kind}{overload}": _activation(kind, inplace=overload == "_")
        for kind in ("sigmoid", "silu", "gelu")
        for overload in ("", "_", ".out")
    },
    **{
        f"{kind}_backward{overload}": _activation(kind, backward=True)
        for kind in ("silu", "gelu")
        for overload in ("", ".grad_input")
    },
}
_CONVOLUTIONS = {"convolution": 6, "_convolution": 6}  # -> the index of their `transposed` argument
_ANY_DTYPE = frozenset({"sum", "sum.dim_IntList", "mean", "mean.dim"})  # integers too (reductions.py)


@functools.cache
def _table() -> dict[str, Any]:
    """Every ATen op (overload) this module registers a CPU kernel for: `_ROUTES`, and a refusal for each
    overload of `_REFUSED` that this torch has."""
    table = dict(_ROUTES)
    for packet in _REFUSED:
        try:
            overloads = getattr(torch.ops.aten, packet).overloads()
        except (AttributeError, RuntimeError):  # not in this version of torch
            continue
        for overload in overloads:
            name = packet if overload == "default" else f"{packet}.{overload}"
            table[name] = _refuse(name)
    return table


def _aten_name(func: Any) -> str | None:
    """An OpOverload's ATen name ("mm.out" for torch.ops.aten.mm.out); None for another namespace's op."""
    namespace, _, name = func.name().partition("::")
    return name if namespace == "aten" else None


def handles(func: Any) -> bool:
    """Whether the portable kernels decide what `func` (an OpOverload) computes on the CPU: they compute it,
    or refuse it."""
    return _aten_name(func) in _table()


def refusal(func: Any, args: Sequence[Any]) -> str | None:
    """What the portable kernels would refuse in this call of `func` (an OpOverload), "aten::name" and why
    if not the op itself; None if they compute it, or leave it to torch. Reads shapes and dtypes only (it
    runs on fake tensors, tasks/determinism/escapes.py)."""
    name = _aten_name(func)
    kernel = _table().get(name) if name is not None else None
    if kernel is None:
        return None
    if getattr(kernel, "refuses", False):
        return f"aten::{name}"
    tensors = [arg for arg in args[:2] if isinstance(arg, torch.Tensor)]
    if name in _CONVOLUTIONS:
        x, transposed = args[0], args[_CONVOLUTIONS[name]]
        if transposed:
            return f"aten::{name} (transposed)"
        if x.dim() not in (3, 4):
            return f"aten::{name} ({x.dim() - 2}-D)"
    elif name in _ANY_DTYPE:  # integer sums stay ATen's (exact in any order); complex ones are refused
        if tensors and tensors[0].is_complex():
            return f"aten::{name} ({tensors[0].dtype})"
    elif any(t.dtype not in kernels.FLOATS for t in tensors):
        return f"aten::{name} ({', '.join(str(t.dtype) for t in tensors)})"
    return None


_library: torch.library.Library | None = None


def install() -> None:
    """Route the ops to the kernels above, for every CPU tensor of this process, until `uninstall`."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore", UserWarning)
        for name, kernel in _table().items():
            library.impl(name, kernel, "CPU")
    _library = library


def uninstall() -> None:
    """torch's own CPU kernels again (native mode)."""
    global _library
    kernels.clear()
    if _library is not None:
        _library._destroy()
        _library = None


def installed() -> bool:
    """Whether this process computes with the portable kernels."""
    return _library is not None
