"""Sums, mean, square root and logarithm in portable mode (tasks/determinism/reductions.py): torch's values
within rounding, one order whatever the thread count or the compiler's presence, sqrt correctly rounded,
and integer sums still ATen's exact ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.determinism import dispatch, kernels, reductions
from tests.support.portable import needs_the_op, portable_kernels, replace_ops

aten = torch.ops.aten


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal in every byte (-0 is not 0, NaN is NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes()


@pytest.mark.parametrize(
    ("shape", "dims", "keepdim"),
    [
        ((8, 5, 7, 9), [0, 2, 3], False),  # batch norm's
        ((8, 5, 7, 9), [-1], True),  # layer norm's
        ((8, 5, 7, 9), [-2, 0], False),  # out of order, negative
        ((8, 5, 7, 9), None, False),  # every dimension
        ((130, 3), [0], False),  # a short last block
        ((0, 4), [0], True),  # nothing to add
        ((), [0], False),  # a scalar
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sums_and_means_are_torchs(shape: tuple, dims: list | None, keepdim: bool, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=generator) * 4).to(dtype)
    for ours, theirs in ((reductions.sum_dim, aten.sum.dim_IntList), (reductions.mean_dim, aten.mean.dim)):
        made, expected = ours(x, dims, keepdim), theirs(x, dims, keepdim)
        assert made.dtype == expected.dtype and made.shape == expected.shape
        torch.testing.assert_close(made, expected, equal_nan=True)


def test_a_dtype_asked_for_is_the_accumulators_and_the_results() -> None:
    x = torch.randn(70, 3, generator=torch.Generator().manual_seed(1)).bfloat16()
    for ours, theirs in ((reductions.sum_dim, aten.sum.dim_IntList), (reductions.mean_dim, aten.mean.dim)):
        made, expected = ours(x, [0], dtype=torch.float64), theirs(x, [0], dtype=torch.float64)
        assert made.dtype == torch.float64
        torch.testing.assert_close(made, expected)


def test_integer_sums_stay_atens_and_complex_ones_are_refused() -> None:
    x = torch.randint(-(2**40), 2**40, (33, 7), generator=torch.Generator().manual_seed(2))
    assert _same(reductions.sum_dim(x, [0]), aten.sum.dim_IntList(x, [0]))
    flags = x > 0
    assert _same(reductions.sum_all(flags), aten.sum(flags)) and reductions.sum_all(flags).dtype == torch.int64
    assert dispatch.refusal(aten.sum.dim_IntList, [flags, [0]]) is None  # (an accuracy count is not refused)
    assert dispatch.refusal(aten.sum.default, [flags.to(torch.complex64)]) == "aten::sum (torch.complex64)"
    with pytest.raises(kernels.PortableOpError, match="complex sum"):
        reductions.sum_all(flags.to(torch.complex64))


@pytest.mark.parametrize(
    ("shape", "dims"),
    [
        ((32, 16, 9, 9), [0, 2, 3]),  # batch norm's: (A, C, B)
        ((7, 300), [1]),  # a row's (layer norm's, log-softmax's): (1, C, B)
        ((300, 7), [0]),  # a column's: (A, C, 1)
        ((1000,), None),  # everything: (A, 1, 1)
        ((5, 1, 3), [1, 2]),
        ((4, 6, 5), [1]),  # between kept dimensions: torch's adds alone
        ((3, 70, 200), [0, 2]),  # more than one chunk of columns
    ],
)
def test_the_bytes_follow_neither_the_threads_nor_the_layout_nor_the_compiler(
    shape, dims, torch_threads, monkeypatch
) -> None:  # noqa: ANN001, E501
    """The same bytes on 1-3 threads, from a channels-last copy, where the caller's tensor is scratch (summed
    in place), and from torch's elementwise adds where blas_pool.cpp cannot be built: one order, of the
    logical indices."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 1e3
    x.view(-1)[:4] = torch.tensor([-0.0, 1e-40, 3e38, -3e38])
    kept = x.clone()
    made = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        made.append(reductions.total(x, dims))
    if x.dim() == 4:
        made.append(reductions.total(x.contiguous(memory_format=torch.channels_last), dims))
    with monkeypatch.context() as patch:
        replace_ops(patch, halving_sums=None)
        made.append(reductions.total(x, dims))
        made.append(reductions.total(x.clone(), dims, owned=True))
    assert all(_same(m, made[0]) for m in made[1:])
    assert _same(x, kept)  # (not summed in place unless owned)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_batch_norms_sums_are_the_torch_codes_on_every_thread_count(layout, torch_threads, monkeypatch) -> None:  # noqa: ANN001
    """channel_total's three terms (x, (x - m)^2, g (x - m) s), from blas_pool.cpp on 1-3 threads and from
    torch's ops, agree on every byte; a channel count that is not whole blocks of the op's."""
    needs_the_op()
    generator = torch.Generator().manual_seed(6)
    x, g = (torch.randn(9, 13, 7, 5, generator=generator).contiguous(memory_format=layout) for _ in range(2))
    center, scale = torch.randn(13, generator=generator), torch.rand(13, generator=generator)
    terms = {"x": {}, "squares": {"center": center}, "products": {"center": center, "scale": scale, "g": g}}
    for name, extra in terms.items():
        made = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            made.append(reductions.channel_total(x, **extra))
        with monkeypatch.context() as patch:
            replace_ops(patch, halving_sums=None)
            made.append(reductions.channel_total(x, **extra))
        assert all(_same(m, made[0]) for m in made[1:]), name
        exact = {"x": x.double(), "squares": (x.double() - center.double().view(1, -1, 1, 1)) ** 2}.get(name)
        if exact is not None:
            torch.testing.assert_close(made[0].double(), exact.sum((0, 2, 3)), rtol=1e-5, atol=1e-4)


def test_the_order_is_the_documented_one() -> None:
    """By halves: of n, element i and i + ceil(n/2), the middle one of an odd n carried. In float32, 2^24 + 1
    is 2^24: where each 1 meets 2^24 first it is lost, where two ones meet first they are kept."""
    big = 2.0**24
    assert reductions.total(torch.tensor([big, 1.0, 1.0, 1.0])).item() == big + 2  # (big + 1) + (1 + 1)
    assert reductions.total(torch.tensor([big, 1.0, 1.0])).item() == big  # (big + 1) + 1, the middle carried
    assert reductions.total(torch.tensor([1.0, big, 1.0])).item() == big + 2  # (1 + 1) + big
    rows = torch.tensor([[big, 1.0], [1.0, 1.0], [1.0, big], [1.0, 1.0]])
    assert reductions.total(rows, [0]).tolist() == [big + 2, big + 2]  # along a dimension, column by column


def test_sqrt_is_correctly_rounded() -> None:
    """Against numpy's (IEEE's correctly rounded) float32 sqrt, over magnitudes from subnormal to the
    largest float, and the special values; ATen's own vectorised sqrt is not correctly rounded."""
    generator = torch.Generator().manual_seed(4)
    bits = torch.randint(0, 0x7F800000, (400_000,), generator=generator, dtype=torch.int32)
    v = torch.cat([bits.view(torch.float32), torch.tensor([0.0, -0.0, 1.0, 4.0, float("inf"), -1.0, float("nan")])])
    with np.errstate(invalid="ignore"):  # (the root of -1 is NaN: asked for)
        expected = torch.from_numpy(np.sqrt(v.numpy()))
    made = reductions.sqrt(v)
    nan = expected.isnan()  # (a NaN's sign bit is the CPU's: x86-64's default NaN is negative, arm64's positive)
    assert torch.equal(made.isnan(), nan) and _same(made[~nan], expected[~nan])


def test_log_is_within_two_units_of_the_exact_logarithm() -> None:
    generator = torch.Generator().manual_seed(5)
    bits = torch.randint(0x00800000, 0x7F800000, (400_000,), generator=generator, dtype=torch.int32)
    v = bits.view(torch.float32)
    made, exact = reductions.log(v).double(), torch.log(v.double())
    unit = torch.nextafter(exact.float(), torch.tensor(float("inf"))).double() - exact.float().double()
    assert ((made - exact).abs() <= 2 * unit.abs()).all()
    special = torch.tensor([0.0, -0.0, 1.0, float("inf"), -1.0, float("nan"), 1e-40])
    torch.testing.assert_close(reductions.log(special), torch.log(special), equal_nan=True)


def test_the_routes_are_installed() -> None:
    with portable_kernels(True):
        x = torch.arange(100.0).view(10, 10)
        assert x.sum().item() == 4950 and x.mean(0).tolist() == [45.0 + c for c in range(10)]
    for op in ("sum", "sum.dim_IntList", "mean", "mean.dim"):
        assert dispatch.handles(_overload(op))


def _overload(name: str) -> torch._ops.OpOverload:
    packet, _, overload = name.partition(".")
    return getattr(getattr(aten, packet), overload or "default")
