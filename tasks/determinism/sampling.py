"""Draws from the normal distribution, and erfinv, for determinism.cpu: portable: the same bytes on x86-64 and
arm64, so that torchvision's initialisations start both from the same weights.

Uniform draws (torch's Mersenne Twister, `uniform_`) are the same bytes on both machines. torch's normal_
turns them into normal ones by Box-Muller, with Sleef's vectorised log, cos and sin under AVX2 and the C
library's on arm64, wherever 16 or more values are drawn (kaiming_normal_, normal_(0, 0.01)); and
trunc_normal_ inverts erf with ATen's erfinv, compiled another way on each: so the weights a model starts
from differed (docs/design-history.md, "arm64: what differs"). Here the uniform draws are torch's own, in
its order and layout (chunks of 16 values, the first 8 giving u1 and the last 8 u2; a size that is not a
multiple of 16 recomputes its last 16 from 16 fresh draws; fewer than 16 values draw 16), and become
normal ones with reductions.py's log and correctly rounded sqrt and Cephes' sinf and cosf, each
operation rounded once: within a few units in the last place of torch's own values on x86-64 (tested),
from the same generator state. blas_pool.cpp's `box_muller` op (sampling.h) computes the transform where it
is built, the same bytes (tested on every possible draw), ~3 times faster for a whole normal_ (28M values:
1.2 s -> 0.36 s on 2 cores, 2026-12-05); the torch formulas below otherwise. erfinv is Giles'
single-precision approximation ("Approximating the erfinv function", GPU Computing Gems, 2011). float64
uses ATen's log, cos, sin and erfinv in the same formulas: its precision, not a float32 polynomial's.
"""

from __future__ import annotations

import math

import torch

from tasks.determinism import blas, reductions

CHUNK = 16  # values per Box-Muller chunk, as torch's normal_fill_16
# Chunks transformed together: Box-Muller's ~40 elementwise passes then run on 1 MiB that stays in the cache,
# not on the whole tensor streamed through memory for each (a large model's biggest weight is ~100 MB).
# Each chunk is computed alone, so the block changes no byte; 28M values: 5.3 s -> 2.1 s (2026-12-03).
BLOCK = 1 << 14
_TWO_PI = 2 * math.pi  # (u2 times it in float64, then rounded to float32, as torch's normal_fill_16)
# Cephes sinf/cosf: pi/4 in three parts (each exact in float32), and the polynomials, highest power first
_DP1, _DP2, _DP3 = 0.78515625, 2.4187564849853515625e-4, 3.77489497744594108e-8
_FOUR_OVER_PI = 1.27323954473516
_SIN = (-1.9515295891e-4, 8.3321608736e-3, -1.6666654611e-1)
_COS = (2.443315711809948e-5, -1.388731625493765e-3, 4.166664568298827e-2)
# Giles' erfinv: the central (w < 5) and the tail polynomial, highest power first
_ERFINV_CENTRAL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087)
_ERFINV_CENTRAL += (-0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
_ERFINV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773)
_ERFINV_TAIL += (-0.0076224613, 0.00943887047, 1.00167406, 2.83297682)


def normal_(
    x: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """aten::normal_: x filled in place with draws from N(mean, std^2), computed as the module docstring says."""
    if not x.is_floating_point():
        raise TypeError(f"normal_ fills floating-point tensors, not {x.dtype}")
    n = x.numel()
    if n == 0:
        return x
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    draws = torch.empty(max(n, CHUNK), dtype=compute).uniform_(0, 1, generator=generator)
    whole = draws.numel() // CHUNK * CHUNK
    values = torch.empty_like(draws)  # (each value is written below: the tail's last 16 cover what `whole` leaves)
    _transform(draws[:whole], values[:whole])
    if whole < draws.numel():  # the tail: the last 16 values again, from 16 fresh draws
        fresh = torch.empty(CHUNK, dtype=compute).uniform_(0, 1, generator=generator)
        _transform(fresh, values[-CHUNK:])
    values = values[:n].mul_(std).add_(mean)
    return x.copy_(values.view(x.shape))


def _transform(draws: torch.Tensor, out: torch.Tensor) -> None:
    """Box-Muller of contiguous uniform `draws` (whole chunks) into `out`: blas_pool.cpp's op for float32
    (sampling.h), else `_box_muller` block by block; the same bytes."""
    op = blas.op("box_muller") if draws.dtype == torch.float32 else None
    if op is not None:
        op(draws, out)
        return
    chunks, into = draws.view(-1, 2, CHUNK // 2), out.view(-1, 2, CHUNK // 2)
    for first in range(0, chunks.shape[0], BLOCK):
        into[first : first + BLOCK] = _box_muller(chunks[first : first + BLOCK])


def _box_muller(u: torch.Tensor) -> torch.Tensor:
    """Chunks (k, 2, 8) of uniform draws in [0, 1) -> (k, 2, 8) standard normal ones: for each j,
    r = sqrt(-2 log(1 - u[0, j])), theta = 2 pi u[1, j]; r cos(theta) and r sin(theta)."""
    radius = reductions.sqrt(reductions.log(1 - u[:, 0]) * -2)
    theta = (u[:, 1].double() * _TWO_PI).to(u.dtype)
    cosine, sine = sincos(theta)
    return torch.stack([radius * cosine, radius * sine], dim=1)


def sincos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos(x) and sin(x) of float32 x >= 0 (Box-Muller's angles, in [0, 2 pi)), Cephes' cosf and sinf: x less
    the multiple of pi/4 nearest below (an even one), in three parts, then a polynomial on [-pi/4, pi/4]
    chosen by the octant. Other dtypes: ATen's."""
    if x.dtype != torch.float32:
        return torch.cos(x), torch.sin(x)
    octant = torch.floor(x * _FOUR_OVER_PI)
    octant = octant + torch.remainder(octant, 2)  # (an odd octant: the next one, r then negative)
    r = ((x - octant * _DP1) - octant * _DP2) - octant * _DP3
    z = r * r
    s = torch.full_like(r, _SIN[0])
    for c in _SIN[1:]:
        s = s * z + c
    s = s * z * r + r
    c = torch.full_like(r, _COS[0])
    for coefficient in _COS[1:]:
        c = c * z + coefficient
    c = c * z * z - z * 0.5 + 1
    j = torch.remainder(octant, 8).to(torch.int32)  # 0, 2, 4 or 6
    swap = (j == 2) | (j == 6)  # (a quarter turn: cos is -sin's polynomial and sin cos's)
    cosine, sine = torch.where(swap, s, c), torch.where(swap, c, s)
    cosine = torch.where((j == 2) | (j == 4), -cosine, cosine)
    sine = torch.where(j >= 4, -sine, sine)
    return cosine, sine


def erfinv(x: torch.Tensor) -> torch.Tensor:
    """aten::erfinv of float32 x (Giles' approximation; +-1 give +-infinity, beyond them NaN); float64 and
    the rest: ATen's (through its out= kernel, which the portable dispatcher leaves to ATen)."""
    if x.dtype != torch.float32:
        out = torch.empty_like(x, dtype=torch.promote_types(x.dtype, torch.float32))
        return torch.ops.aten.erfinv.out(x, out=out)
    w = -reductions.log((1 - x) * (1 + x))
    central, tail = w - 2.5, reductions.sqrt(w) - 3
    p = torch.full_like(x, _ERFINV_CENTRAL[0])
    for c in _ERFINV_CENTRAL[1:]:
        p = p * central + c
    q = torch.full_like(x, _ERFINV_TAIL[0])
    for c in _ERFINV_TAIL[1:]:
        q = q * tail + c
    result = torch.where(w < 5, p, q) * x
    return torch.where(x.abs() == 1, torch.copysign(torch.full_like(x, math.inf), x), result)


def erfinv_(x: torch.Tensor) -> torch.Tensor:
    return x.copy_(erfinv(x))
