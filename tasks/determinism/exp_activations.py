"""Mish, softplus and ELU (SELU and CELU are ELUs), forward and backward, for determinism.cpu: portable.

Their ATen kernels' values followed the thread count (each thread's share of a tensor ends in other code
than its body: found by hashing every op's output on 1, 2 and 3 threads), and their exp, log1p, expm1
and tanh are other functions on arm64 than on x86-64. In float32 (half and bfloat16 computed in float32
and rounded once, as ATen computes them) each element here is one fixed sequence of torch's elementwise
operations, each one IEEE rounding, from activations.py's e^x and reductions.py's log: the same bytes on
any thread count and on both architectures. The formulas are ATen's, with three rewritings that keep
float32's precision where the plain ones cancel: log1p(u) = log(1 + u) u / ((1 + u) - 1) (Goldberg's),
expm1(u) = (e^u - 1) u / log(e^u) near 0 (Kahan's), and mish's tanh(softplus(x)) = n(n + 2) / (n(n + 2) + 2)
with n = e^x, which needs no tanh.

float64 keeps ATen's kernels, on pieces of `PIECE` elements that one thread computes: ATen's one-thread
bytes on any thread count, on x86-64 (arm64's float64 exp and log are its own). These routes replace the
ops' functional and in-place forms; an out= call stays ATen's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tasks.determinism import activations, memory, reductions

# Elements per float64 piece: under TensorIterator's grain size (32768, below which one thread computes the
# whole), and a multiple of twice the widest vector of every dtype (ATen's loops take two vectors at a time).
PIECE = 16384
MISH_THRESHOLD = 20.0  # mish's softplus: above it, softplus(x) = x (ATen's), and tanh of it is 1 in float32

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


def _in_float32(formula: Callable[..., torch.Tensor], x: torch.Tensor, *more: torch.Tensor) -> torch.Tensor:
    """`formula` of float32 copies of x (and of `more`, each of x's shape), rounded to x's dtype once."""
    as32 = [t.detach().expand(x.shape).float().contiguous() for t in (x, *more)]
    out = formula(*as32)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def _float32(value: float) -> float:
    """A scalar as ATen's float32 kernels hold it (rounded to float32)."""
    return float(np.float32(value))


def _log1p(u: torch.Tensor) -> torch.Tensor:
    w = u + 1
    return torch.where(w == 1, u, torch.where(torch.isinf(w), w, reductions.log(w) * (u / (w - 1))))


def _expm1(u: torch.Tensor) -> torch.Tensor:
    w = activations.exp(u)
    near = (w - 1) * (u / reductions.log(w))  # (NaN where w is 1: not taken)
    return torch.where(w == 1, u, torch.where(u.abs() < 0.5, near, w - 1))


def _tanh_softplus(x: torch.Tensor) -> torch.Tensor:
    n = activations.exp(x)
    m = n * (n + 2)
    return torch.where(x > MISH_THRESHOLD, 1.0, m / (m + 2))


def mish(x: torch.Tensor) -> torch.Tensor:
    """x tanh(softplus(x))."""
    if x.dtype == torch.float64:
        return _in_pieces(aten.mish.out, x)
    return _in_float32(lambda v: v * _tanh_softplus(v), x)


def mish_(x: torch.Tensor) -> torch.Tensor:
    return x.copy_(mish(x))


def mish_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """torch's math_mish_backward: grad (t + x sigmoid(x) (1 - t^2)), t = tanh(softplus(x))."""
    if x.dtype == torch.float64:
        t = torch.tanh(softplus(x))
        return grad * (t + x * activations.compute("sigmoid", x) * (1 - t * t))

    def formula(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = _tanh_softplus(v)
        return g * (t + (v * activations.compute("sigmoid", v)) * (1 - t * t))

    return _in_float32(lambda v, g: formula(g, v), x, grad)


def softplus(x: torch.Tensor, beta: float = 1, threshold: float = 20) -> torch.Tensor:
    """ATen's: x where x beta > threshold, else log1p(e^(x beta)) / beta."""
    if x.dtype == torch.float64:
        return _in_pieces(lambda piece, out: aten.softplus.out(piece, beta, threshold, out=out), x)
    beta, threshold = _float32(beta), _float32(threshold)

    def formula(v: torch.Tensor) -> torch.Tensor:
        scaled = v * beta
        return torch.where(scaled > threshold, v, _log1p(activations.exp(scaled)) / beta)

    return _in_float32(formula, x)


def softplus_backward(grad: torch.Tensor, x: torch.Tensor, beta: float, threshold: float) -> torch.Tensor:
    """ATen's: grad where x beta > threshold, else grad z / (z + 1), z = e^(x beta)."""
    if x.dtype == torch.float64:

        def compute(g: torch.Tensor, piece: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            return aten.softplus_backward.grad_input(g, piece, beta, threshold, grad_input=out)

        return _in_pieces(compute, grad.expand(x.shape), x)
    beta, threshold = _float32(beta), _float32(threshold)

    def formula(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        scaled = v * beta
        z = activations.exp(scaled)
        return torch.where(scaled > threshold, g, (g * z) / (z + 1))

    return _in_float32(formula, x, grad)


def _elu_coefficients(alpha: float, scale: float, input_scale: float) -> tuple[float, float, float]:
    """(negcoef, poscoef, negiptcoef) as ATen's float32 kernels make them: alpha scale, scale, input_scale."""
    return _float32(_float32(alpha) * _float32(scale)), _float32(scale), _float32(input_scale)


def elu(x: torch.Tensor, alpha: float = 1, scale: float = 1, input_scale: float = 1) -> torch.Tensor:
    """ATen's: expm1(x input_scale) alpha scale where x <= 0, else x scale."""
    if x.dtype == torch.float64:
        return _in_pieces(lambda piece, out: aten.elu.out(piece, alpha, scale, input_scale, out=out), x)
    negcoef, poscoef, negiptcoef = _elu_coefficients(alpha, scale, input_scale)
    return _in_float32(lambda v: torch.where(v <= 0, _expm1(v * negiptcoef) * negcoef, v * poscoef), x)


def elu_(x: torch.Tensor, alpha: float = 1, scale: float = 1, input_scale: float = 1) -> torch.Tensor:
    return x.copy_(elu(x, alpha, scale, input_scale))


def elu_backward(
    grad: torch.Tensor, alpha: float, scale: float, input_scale: float, is_result: bool, x_or_result: torch.Tensor
) -> torch.Tensor:
    """ATen's, from the input x, or (`is_result`, after an in-place ELU) from its result y: where it is
    <= 0, grad input_scale (y + alpha scale), or grad input_scale alpha scale e^(x input_scale); else
    grad scale."""
    if x_or_result.dtype == torch.float64:

        def compute(g: torch.Tensor, piece: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            return aten.elu_backward.grad_input(g, alpha, scale, input_scale, is_result, piece, grad_input=out)

        return _in_pieces(compute, grad.expand(x_or_result.shape), x_or_result)
    negcoef, poscoef, negiptcoef = _elu_coefficients(alpha, scale, input_scale)

    def formula(b: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        if is_result:
            negative = (g * negiptcoef) * (b + negcoef)
        else:
            negative = ((g * negiptcoef) * negcoef) * activations.exp(b * negiptcoef)
        return torch.where(b <= 0, negative, g * poscoef)

    return _in_float32(formula, x_or_result, grad)
