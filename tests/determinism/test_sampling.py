"""normal_ and erfinv in portable mode (tasks/determinism/sampling.py): torch's own draws within rounding, from
the same generator state and leaving it where torch leaves it, on any thread count."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.determinism import blas, dispatch, sampling
from tests.support.portable import portable_kernels


@pytest.mark.parametrize("n", [16, 37, 1000, 4099])
def test_normal_draws_are_torchs_within_rounding_and_leave_the_generator_as_torch_does(n: int) -> None:
    """The same uniform draws, in torch's layout (chunks of 16, a recomputed tail), through other log, sqrt,
    cos and sin: each value within a few units in the last place of torch's."""
    theirs, ours = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    with portable_kernels(False):
        expected = torch.empty(n).normal_(0.5, 2.0, generator=theirs)
    made = sampling.normal_(torch.empty(n), 0.5, 2.0, generator=ours)
    torch.testing.assert_close(made, expected, rtol=0, atol=4e-6)
    assert torch.equal(ours.get_state(), theirs.get_state())


def test_blocks_of_chunks_give_the_bytes_of_one_pass_over_the_whole() -> None:
    n = 3 * sampling.BLOCK * sampling.CHUNK + 40  # three blocks, a short fourth and a recomputed tail
    made = sampling.normal_(torch.empty(n), generator=torch.Generator().manual_seed(6))
    draws = torch.empty(n).uniform_(0, 1, generator=torch.Generator().manual_seed(6))
    whole = n // sampling.CHUNK * sampling.CHUNK
    at_once = sampling._box_muller(draws[:whole].view(-1, 2, sampling.CHUNK // 2)).view(-1)
    kept = n - sampling.CHUNK  # (the last 16 are the tail's, recomputed from fresh draws)
    assert torch.equal(made[:kept], at_once[:kept])


def test_the_c_plus_plus_transform_gives_the_torch_formulas_bytes_for_every_possible_draw() -> None:
    """blas_pool.cpp's box_muller (sampling.h) against `_box_muller`, exhaustively: a float32 uniform draw is
    one of the 2^24 multiples of 2^-24 in [0, 1), the radius follows the first draw of a pair and the angle
    the second, so every possible first draw meets one second draw and every possible second draw one
    first: each factor of every value normal_ can produce is compared, in each vector width the CPU has."""
    op = blas.op("box_muller")
    assert op is not None, "blas_pool.cpp is built in the test environment"
    grid = torch.arange(1 << 24, dtype=torch.float32).mul_(2.0**-24)
    draws = torch.stack([grid.view(-1, 8), grid.flip(0).view(-1, 8)], dim=1).contiguous().view(-1)
    widths = (256, 512) if blas.op("widest")() == 512 else (256,)
    made = {width: torch.empty_like(draws) for width in widths}
    for width, out in made.items():
        op(draws, out, width)
    chunks = draws.view(-1, 2, sampling.CHUNK // 2)
    for first in range(0, chunks.shape[0], sampling.BLOCK):
        expected = sampling._box_muller(chunks[first : first + sampling.BLOCK]).view(-1).view(torch.int32)
        for width, out in made.items():
            got = out.view(-1, 2, sampling.CHUNK // 2)[first : first + sampling.BLOCK].reshape(-1)
            differ = (got.view(torch.int32) != expected).nonzero()
            at = first * sampling.CHUNK + differ[:1].tolist()[0][0] if differ.numel() else None
            assert differ.numel() == 0, f"width {width}: {differ.numel()} values differ, the first at {at}"


def test_few_draws_and_other_dtypes_and_layouts_are_normal_too() -> None:
    generator = torch.Generator().manual_seed(4)
    few = sampling.normal_(torch.empty(5), generator=generator)
    assert few.isfinite().all() and len(set(few.tolist())) == 5
    wide = sampling.normal_(torch.empty(200_000, dtype=torch.float64), 1.0, 3.0, generator=generator)
    assert abs(wide.mean().item() - 1) < 0.05 and abs(wide.std().item() - 3) < 0.05
    strided = torch.zeros(64, 40)[:, ::2]
    sampling.normal_(strided, generator=generator)
    assert strided.std().item() == pytest.approx(1, abs=0.1)
    half = sampling.normal_(torch.empty(100, dtype=torch.bfloat16), generator=generator)
    assert half.dtype == torch.bfloat16 and half.float().abs().max() < 6
    assert sampling.normal_(torch.empty(0)).numel() == 0
    with pytest.raises(TypeError, match="floating-point"):
        sampling.normal_(torch.empty(3, dtype=torch.int64))


def test_the_draws_do_not_follow_the_thread_count(torch_threads: None) -> None:
    made = []
    for threads in (1, 3):
        torch.set_num_threads(threads)
        made.append(sampling.normal_(torch.empty(70_001), generator=torch.Generator().manual_seed(5)))
    assert torch.equal(made[0], made[1])


def test_sine_and_cosine_are_within_two_units_in_the_last_place() -> None:
    angles = torch.rand(1_000_000, dtype=torch.float64).float() * (2 * math.pi)
    cosine, sine = sampling.sincos(angles)
    for made, exact in ((cosine, torch.cos(angles.double())), (sine, torch.sin(angles.double()))):
        assert (made.double() - exact).abs().max() < 1.2e-7


def test_erfinv_is_torchs_within_rounding() -> None:
    x = torch.rand(1_000_000, generator=torch.Generator().manual_seed(6)) * 2 - 1
    exact = torch.erfinv(x.double())
    assert ((sampling.erfinv(x).double() - exact).abs() <= 4e-7 * exact.abs() + 1e-30).all()
    special = torch.tensor([1.0, -1.0, 0.0, -0.0, 1.5, float("nan")])
    torch.testing.assert_close(sampling.erfinv(special), torch.erfinv(special), equal_nan=True)
    assert sampling.erfinv(torch.tensor([0.5], dtype=torch.float64)).dtype == torch.float64


def test_torchvisions_initialisations_draw_through_them() -> None:
    """kaiming_normal_ (normal_) and trunc_normal_ (uniform_, erfinv_) in portable mode: our draws."""
    for op in (torch.ops.aten.normal_.default, torch.ops.aten.erfinv.default, torch.ops.aten.erfinv_.default):
        assert dispatch.handles(op)
    with portable_kernels(True):
        weight = torch.nn.init.kaiming_normal_(torch.empty(64, 32), generator=torch.Generator().manual_seed(7))
        truncated = torch.nn.init.trunc_normal_(torch.empty(4096), std=0.02, generator=torch.Generator().manual_seed(7))
    expected = sampling.normal_(torch.empty(64, 32), 0, math.sqrt(2 / 32), generator=torch.Generator().manual_seed(7))
    assert torch.equal(weight, expected)
    assert truncated.abs().max() <= 2 and truncated.std().item() == pytest.approx(0.02, rel=0.05)
