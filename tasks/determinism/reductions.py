"""Sums in one fixed order, and square root and logarithm from exact operations, for determinism.cpu: portable:
the same bytes on any thread count, on x86-64 (AVX2 or AVX-512) and on arm64 (NEON) alike.

ATen's reductions (sum, mean, and the sums inside batch norm, layer norm and log-softmax) cut their sums
by vector width and thread count: on arm64 they gave other bytes than x86-64's for some sizes and not for
others (docs/design-history.md, "arm64: what differs"), and no setting makes them agree. Here every sum
of floats is added by halves (`halve`), with torch's elementwise adds only: those (+, -, *, /, each
rounded once) gave the same bytes on both architectures and on any thread count, and a pairwise sum's
error grows with log n, not n. No C++ is needed for it: log2(n) passes over ever smaller halves cost
about what one pass does. sqrt, exp and log did not agree (ATen's vectorised float32 sqrt under avx2 is
not even correctly rounded), so `sqrt` is corrected to the correctly rounded root with exact
arithmetic, `log` is Cephes' polynomial and e^x is activations.py's.

Integer sums are exact in any order: those stay ATen's (its out= kernels, which the dispatcher does not
route here). float64's sqrt and log are ATen's, as activations.py's float64 exp is: its precision, not
a float32 polynomial's, so float64 runs are not claimed to match across architectures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from tasks.determinism import blas, kernels, memory

Scratch = Callable[[tuple[int, ...], torch.Tensor], torch.Tensor]  # memory.temporaries' take

REDUCED = (torch.float16, torch.bfloat16)  # summed in float32, as ATen does
_SQRT_HALF = 0.70710678118654752440  # Cephes' SQRTHF, rounded to float32 where compared
# Cephes logf's polynomial, highest power first, and ln 2 = high + low (high exact in 9 bits); each is
# rounded to float32 where it meets a float32 tensor, alike on every machine
_LOG = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1)
_LOG += (-1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1)
_LN2_HIGH, _LN2_LOW = 0.693359375, -2.12194440e-4


def total(
    x: torch.Tensor,
    dims: Sequence[int] | None = None,
    keepdim: bool = False,
    dtype: torch.dtype | None = None,
    *,
    owned: bool = False,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """The sum of floating-point `x` over `dims` (every dimension if None or empty): each run of adjacent
    summed dimensions taken as one (its elements in row-major order), the outermost run first, each in the
    order `halve` gives. Accumulated in `dtype` or x's (float32 for half and bfloat16, as ATen), returned
    in `dtype` or x's. blas_pool.cpp's halving_sums computes it where the kept dimensions are one run (what
    every model's sums are); else `halve`, in place where `owned` (x is the caller's scratch), the first
    halves otherwise in memory from `scratch` (memory.temporaries' `take`) or new memory."""
    reduced, _ = _split(x, dims)
    accumulate = _accumulator(dtype or x.dtype)
    t = x.to(accumulate)
    owned = owned or t is not x  # (a conversion is a copy of our own)
    shape = [1 if d in reduced else size for d, size in enumerate(x.shape)]  # kept, as keepdim has it
    t, runs = _merged(t, reduced)
    if t.numel() == 0:  # (an empty sum is 0)
        result = t.new_zeros(shape)
    elif (three := _three(t, runs)) is not None and (op := _op(three)) is not None:
        result = torch.empty(three.shape[1], dtype=accumulate)
        op(three, None, None, None, result, 0)
        result = result.view(shape)
    else:
        for d in runs:
            t, owned = halve(t, d, owned, scratch)
        # new compact memory, as torch's result (not a view that keeps a scratch tensor alive)
        result = t.clone(memory_format=torch.contiguous_format).view(shape)
    return (result if keepdim or not reduced else result.squeeze(tuple(reduced))).to(dtype or x.dtype)


def channel_total(
    x: torch.Tensor,
    *,
    center: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """Each channel's `total` of a term of x (N, C, ...), over every dimension but the channels': x,
    (x - center)^2, or g (x - center) scale (center and scale per channel, g shaped as x), each operation
    rounded once: batch norm's sums, computed by blas_pool.cpp without the term's tensor where it can be."""
    kind = 0 if center is None else (1 if scale is None else 2)
    if kind == 2 and g is None:
        raise ValueError("channel_total: g (the output's gradient) goes with scale")
    three = x.reshape(x.shape[0], x.shape[1], -1)
    op = _op(three)
    if op is not None and all(t is None or t.dtype == torch.float32 for t in (center, scale, g)):
        result = torch.empty(x.shape[1], dtype=torch.float32)
        gradient = None if g is None else g.reshape(three.shape)
        op(three, gradient, center, None if scale is None else scale.contiguous(), result, kind)
        return result
    dims, shape = [0, *range(2, x.dim())], [1, -1] + [1] * (x.dim() - 2)
    if kind == 0:
        return total(x, dims, scratch=scratch)
    term = torch.sub(x, center.view(shape), out=(scratch or memory.empty)(tuple(x.shape), x))
    term = term.mul_(term) if kind == 1 else term.mul_(scale.view(shape)).mul_(g)
    return total(term, dims, owned=True)


def _merged(t: torch.Tensor, reduced: list[int]) -> tuple[torch.Tensor, list[int]]:
    """t with each run of adjacent summed dimensions reshaped into one, and where those runs now are."""
    sizes: list[int] = []
    runs: list[int] = []
    d = 0
    while d < t.dim():
        if d in reduced:
            start = d
            while d + 1 in reduced:
                d += 1
            runs.append(len(sizes))
            sizes.append(math.prod(t.shape[start : d + 1]))
        else:
            sizes.append(t.shape[d])
        d += 1
    return (t.reshape(sizes) if len(sizes) != t.dim() else t), runs


def _three(t: torch.Tensor, runs: list[int]) -> torch.Tensor | None:
    """t (runs merged) as (A, C, B): summed over A (its first dimension, if a run) and B (its last, if a
    run), the kept ones between as C; None if a run lies between kept dimensions."""
    last = t.dim() - 1
    if not runs or any(r not in (0, last) for r in runs):
        return None
    a = t.shape[0] if 0 in runs else 1
    b = t.shape[last] if last in runs and last != 0 else 1
    return t.reshape(a, t.numel() // (a * b), b)


def _op(three: torch.Tensor) -> Callable[..., None] | None:
    return blas.op("halving_sums") if three.dtype == torch.float32 else None


def halve(t: torch.Tensor, d: int, owned: bool, scratch: Scratch | None = None) -> tuple[torch.Tensor, bool]:
    """t summed along dimension d (kept, of size 1) by halves: of n elements, element i and element
    i + ceil(n/2) added for i < floor(n/2) (the middle one of an odd n carried as it is), until one is left.
    Only elementwise adds, each rounded once: the same bytes on any thread count, vector width, layout or
    architecture, and log2(n) passes, each over half the last one's data. In place where `owned` (the
    first half of t's memory takes each result), else the first step's into memory from `scratch`; with
    whether the result is memory of our own (not where dimension d was of one already)."""
    while (n := t.shape[d]) > 1:
        pairs, kept = n // 2, n - n // 2
        if not owned:  # the first step, out of the caller's tensor
            shape = list(t.shape)
            shape[d] = kept
            first = (scratch or memory.empty)(tuple(shape), t)
            if kept > pairs:  # (an odd n: the middle element carried)
                first.narrow(d, pairs, 1).copy_(t.narrow(d, pairs, 1))
            torch.add(t.narrow(d, 0, pairs), t.narrow(d, kept, pairs), out=first.narrow(d, 0, pairs))
            t, owned = first, True
            continue
        t.narrow(d, 0, pairs).add_(t.narrow(d, kept, pairs))
        t = t.narrow(d, 0, kept)
    return t, owned


def _split(x: torch.Tensor, dims: Sequence[int] | None) -> tuple[list[int], list[int]]:
    """x's dimensions summed over (`dims`, every one if None or empty, as torch's sum) and kept, in order."""
    if x.dim() == 0:  # (dimension 0 or -1 of a scalar is the scalar: nothing to move)
        return [], []
    reduced = sorted({d % x.dim() for d in dims}) if dims else list(range(x.dim()))
    return reduced, [d for d in range(x.dim()) if d not in reduced]


def sqrt(v: torch.Tensor) -> torch.Tensor:
    """The square root of float32 `v`, correctly rounded: the float64 root rounded to float32 is within one
    unit of it, and comparing the squares of the midpoints to each neighbour (exact in float64: 26-bit
    factors) says which float32 is nearest. Other dtypes: ATen's."""
    if v.dtype != torch.float32:
        return torch.sqrt(v)
    wide = v.double()
    root = torch.sqrt(wide).float()
    up = torch.nextafter(root, torch.full_like(root, math.inf))
    down = torch.nextafter(root, torch.zeros_like(root))
    high = (root.double() + up.double()) * 0.5
    low = (root.double() + down.double()) * 0.5
    root = torch.where(high * high < wide, up, root)
    return torch.where(low * low > wide, down, root)


def log(x: torch.Tensor) -> torch.Tensor:
    """The natural logarithm of float32 `x`, Cephes' logf: x = m 2^e with m in [sqrt(1/2), sqrt(2)), a
    polynomial in m - 1, then e ln 2 in two parts; 0, negatives, infinity and NaN as IEEE says. Other
    dtypes: ATen's."""
    if x.dtype != torch.float32:
        return torch.log(x)
    mantissa, exponent = torch.frexp(x)  # mantissa in [0.5, 1)
    e = exponent.to(torch.float32)
    small = mantissa < _SQRT_HALF
    e = torch.where(small, e - 1, e)
    m = torch.where(small, mantissa + mantissa - 1, mantissa - 1)
    z = m * m
    p = torch.full_like(m, _LOG[0])
    for coefficient in _LOG[1:]:
        p = p * m + coefficient
    y = ((m * z) * p + e * _LN2_LOW) - z * 0.5
    result = (m + y) + e * _LN2_HIGH
    result = torch.where(x == 0, -math.inf, result)
    result = torch.where(x == math.inf, math.inf, result)
    return torch.where(x < 0, math.nan, result)


def _aten_sum(x: torch.Tensor, dims: Sequence[int] | None, keepdim: bool, dtype: torch.dtype | None) -> torch.Tensor:
    """A sum that is not of floats: integers and booleans (exact in any order) by ATen's out= kernel, complex
    refused."""
    if x.is_complex() or (dtype is not None and dtype.is_complex):
        raise kernels.PortableOpError("determinism.cpu: portable has no CPU-independent complex sum; use native")
    result_dtype = dtype or (torch.int64 if not x.is_floating_point() else x.dtype)
    out = torch.empty(0, dtype=result_dtype)
    return torch.ops.aten.sum.IntList_out(x, list(dims or []), keepdim, dtype=dtype, out=out)


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """What a sum of `dtype` adds in: float32 for half and bfloat16 (as ATen's), else the dtype itself."""
    return torch.float32 if dtype in REDUCED else dtype


def _floats(x: torch.Tensor, dtype: torch.dtype | None) -> bool:
    return (dtype or x.dtype).is_floating_point


def sum_dim(
    x: torch.Tensor, dim: Sequence[int] | None, keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """aten::sum.dim_IntList."""
    return total(x, dim, keepdim, dtype) if _floats(x, dtype) else _aten_sum(x, dim, keepdim, dtype)


def sum_all(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """aten::sum."""
    return sum_dim(x, None, dtype=dtype)


def mean_dim(
    x: torch.Tensor, dim: Sequence[int] | None, keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """aten::mean.dim: the sum divided by the count, as ATen's (in the result's dtype, float32 for half)."""
    if not _floats(x, dtype):  # (integers: ATen's out= kernel, which refuses them as torch.mean does)
        return torch.ops.aten.mean.out(x, list(dim or []), keepdim, dtype=dtype, out=torch.empty(0, dtype=x.dtype))
    reduced, _ = _split(x, dim)
    count = math.prod(x.shape[d] for d in reduced)
    accumulate = _accumulator(dtype or x.dtype)
    return (total(x, dim, keepdim, accumulate) / count).to(dtype or x.dtype)


def mean_all(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """aten::mean."""
    return mean_dim(x, None, dtype=dtype)
