"""Sigmoid, SiLU and GELU (exact and tanh), forward and backward, for determinism.cpu: portable.

ATen's CPU kernels compute a tensor's body with vectors and the tail of each thread's share with scalar
code, and for these the two differ (the vectors use a faster exp): an element's value followed where the
thread count cut the tensor, so efficientnet's SiLU and sigmoid trained other bytes on 3 threads than on
1, also where every product was portable. Here each element of float32 (and of half and bfloat16,
computed in float32) is one fixed sequence of operations, each rounded once: e^x from Cephes' polynomial
and a scaling by 2^n, erf by Abramowitz and Stegun 7.1.26 (as ATen's vectorised erf; absolute error under
1.5e-7), 1 + tanh(u) as 2 / (e^-2u + 1). blas_pool.cpp's `activation` op computes it (activations.h), and
where it cannot be built the functions below compute the same bytes with torch's elementwise ops
(tested). float64 uses ATen's own exp, erf and tanh in the same formulas: its precision, not our
polynomials.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tasks.determinism import blas, kernels, memory

# blas_pool.cpp's Activation, by name
KINDS = ("sigmoid", "silu", "silu_backward", "gelu", "gelu_backward", "gelu_tanh", "gelu_tanh_backward")
# float32 values, written in hex as in activations.h: exactly representable, so parsed alike
_LOW, _HIGH = float.fromhex("-0x1.ap+6"), float.fromhex("0x1.64p+6")  # e^x's argument is held to [-104, 89]
_LOG2E, _LN2_HIGH, _LN2_LOW = (float.fromhex(h) for h in ("0x1.715476p+0", "0x1.63p-1", "-0x1.bd0106p-13"))
_EXP = tuple(float.fromhex(h) for h in ("0x1.a0d2cep-13", "0x1.6e879cp-10", "0x1.111210p-7", "0x1.555382p-5"))
_EXP += (float.fromhex("0x1.555554p-3"), 0.5)
_ERF_P = float.fromhex("0x1.4f740ap-2")
_ERF = tuple(float.fromhex(h) for h in ("0x1.0fb844p+0", "-0x1.7401c6p+0", "0x1.6be1c6p+0", "-0x1.23531cp-2"))
_ERF += (float.fromhex("0x1.04f20cp-2"),)


@dataclass(frozen=True)
class _Arithmetic:
    """The constants and functions activations.h's formulas are made of, in one precision."""

    sqrt_half: float  # 1/sqrt(2)
    beta: float  # 1/sqrt(2 pi)
    tanh_beta: float  # sqrt(2/pi)
    kappa: float  # 0.044715
    three_kappa: float
    exp: Callable[[torch.Tensor], torch.Tensor]
    gauss: Callable[[torch.Tensor], torch.Tensor]  # e^-z^2
    erf_given: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # erf(z), given e^-z^2
    one_plus_tanh: Callable[[torch.Tensor], torch.Tensor]


def compute(kind: str, x: torch.Tensor, grad: torch.Tensor | None = None) -> torch.Tensor:
    """Activation `kind` (one of KINDS) of `x`, or for a backward kind its input gradient, `grad` being its
    output's; in x's dtype, contiguous."""
    if not x.is_floating_point() or (grad is not None and not grad.is_floating_point()):
        raise kernels.PortableOpError(
            f"determinism.cpu: portable computes {kind} of floating-point tensors only, not {x.dtype}; use native"
        )
    if x.dtype == torch.float64:
        return _formulas(kind, x.detach(), None if grad is None else grad.detach(), _FLOAT64)
    x32 = x.detach().float().contiguous()
    g32 = None if grad is None else grad.detach().float().contiguous().expand_as(x32).contiguous()
    op = blas.op("activation")
    if op is None:
        out = _formulas(kind, x32, g32, _FLOAT32)
    else:
        out = memory.empty(tuple(x32.shape), x32)
        op(x32, g32, out, KINDS.index(kind))
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def _formulas(kind: str, x: torch.Tensor, g: torch.Tensor | None, c: _Arithmetic) -> torch.Tensor:
    """activations.h's `activate`, operation for operation, in the arithmetic `c`."""
    if kind == "sigmoid":
        return 1 / (c.exp(-x) + 1)
    if kind == "silu":
        return x / (c.exp(-x) + 1)
    if kind == "silu_backward":
        s = 1 / (c.exp(-x) + 1)
        return g * (s * (x * (1 - s) + 1))
    if kind in ("gelu", "gelu_backward"):
        z = x * c.sqrt_half
        e = c.gauss(z)  # e^-x^2/2: for erf, and the density's own
        if kind == "gelu":
            return (x * 0.5) * (c.erf_given(z, e) + 1)
        cdf = (c.erf_given(z, e) + 1) * 0.5
        return g * (x * (e * c.beta) + cdf)
    inner = ((x * (x * x)) * c.kappa + x) * c.tanh_beta
    plus = c.one_plus_tanh(inner)
    if kind == "gelu_tanh":
        return (x * 0.5) * plus
    if kind == "gelu_tanh_backward":  # 1 - tanh^2 = (1 + tanh)(1 - tanh), without cancelling
        sech2 = plus * c.one_plus_tanh(-inner)
        right = ((x * 0.5) * sech2) * (((x * x) * c.three_kappa + 1) * c.tanh_beta)
        return g * (plus * 0.5 + torch.where(sech2 == 0, 0, right))  # (far out, x^2 overflows: 0 times infinity)
    raise ValueError(f"no activation {kind!r}; one of {KINDS}")


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x of float32 x, the formula of activations.h (Cephes' polynomial, then a scaling by 2^n); also
    normalization.py's softmax and log-softmax."""
    x = x.clamp(_LOW, _HIGH)
    n = torch.round(x * _LOG2E)
    r = (x - n * _LN2_HIGH) - n * _LN2_LOW
    p = torch.full_like(r, _EXP[0])
    for coefficient in _EXP[1:]:
        p = p * r + coefficient
    whole = n.to(torch.int32)  # in [-150, 128]: 2^n in two halves, each a normal float
    low = whole >> 1
    y = (p * (r * r) + r) + 1
    return (y * ((low + 127) << 23).view(torch.float32)) * ((whole - low + 127) << 23).view(torch.float32)


def _gauss(z: torch.Tensor) -> torch.Tensor:
    """e^-z^2."""
    return exp(-(z.abs() * z.abs()))


def _erf_given(z: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """erf(z) given e = e^-z^2."""
    a = z.abs()
    t = 1 / (a * _ERF_P + 1)
    p = torch.full_like(t, _ERF[0])
    for coefficient in _ERF[1:]:
        p = p * t + coefficient
    return torch.copysign(1 - (p * t) * e, z)


def _one_plus_tanh(u: torch.Tensor) -> torch.Tensor:
    """1 + tanh(u) = 2 / (e^-2u + 1). (Python's `2 / t` would be torch's reciprocal times 2, another value
    where 1/t is subnormal.)"""
    t = exp(-(u + u)) + 1
    return torch.full_like(t, 2).div_(t)


_KAPPA32 = float.fromhex("0x1.6e4e26p-5")
_FLOAT32 = _Arithmetic(
    *(float.fromhex(h) for h in ("0x1.6a09e6p-1", "0x1.988454p-2", "0x1.988454p-1")),
    _KAPPA32,
    (torch.tensor(3.0) * _KAPPA32).item(),  # rounded to float32, as activations.h's constant
    exp,
    _gauss,
    _erf_given,
    _one_plus_tanh,
)
# float64: ATen's own exp, erf and tanh (its precision, not our float32 polynomials)
_FLOAT64 = _Arithmetic(
    math.sqrt(0.5),
    1 / math.sqrt(2 * math.pi),
    math.sqrt(2 / math.pi),
    0.044715,
    3 * 0.044715,
    torch.exp,
    lambda z: torch.exp(-(z * z)),
    lambda z, e: torch.erf(z),
    lambda u: 1 + torch.tanh(u),
)
