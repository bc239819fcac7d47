"""Layer norm's and softmax's backward in portable mode (tasks/determinism/normalization.py): torch's
gradients, one sum order whatever the thread count, the vector width or the compiler's presence, where
ATen's own kernels follow the thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tasks.determinism import blas, dispatch, normalization
from tests.support.portable import computes_what_torch_does, needs_the_op, portable_kernels, replace_ops


@pytest.mark.parametrize(
    ("shape", "normalized", "affine"),
    [((5, 7, 6, 12), (12,), True), ((4, 9, 33), (9, 33), True), ((6, 10), (10,), False), ((70, 17), (17,), True)],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("built", [True, False])
def test_layer_norms_gradients_are_torchs(
    shape: tuple, normalized: tuple, affine: bool, dtype: torch.dtype, built: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float64 (torch's formulas) and float32 (the op, and the same without it) against ATen's kernels; the
    input permuted (not contiguous), as convnext's channels-last layer norm has it."""
    if not built:
        replace_ops(monkeypatch, layer_norm_backward=None)
    generator = torch.Generator().manual_seed(0)
    swapped = (shape[1], shape[0], *shape[2:])
    x = torch.randn(swapped, dtype=dtype, generator=generator).transpose(0, 1).requires_grad_()
    weight = torch.randn(normalized, dtype=dtype, generator=generator, requires_grad=True)
    bias = torch.randn(normalized, dtype=dtype, generator=generator, requires_grad=True)
    if affine:
        computes_what_torch_does(lambda: F.layer_norm(x, normalized, weight, bias), [x, weight, bias], generator)
    else:
        computes_what_torch_does(lambda: F.layer_norm(x, normalized), [x], generator)


def test_only_the_gradients_asked_for_are_computed() -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, dtype=torch.float64, generator=generator)  # no gradient wanted for the input
    weight = torch.randn(16, dtype=torch.float64, generator=generator, requires_grad=True)
    computes_what_torch_does(lambda: F.layer_norm(x, (16,), weight), [weight], generator)


@pytest.mark.parametrize(("shape", "dim"), [((6, 4, 49, 49), -1), ((5, 11, 7), 1), ((300,), 0), ((), 0)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("built", [True, False])
def test_softmaxs_gradient_is_torchs(
    shape: tuple, dim: int, dtype: torch.dtype, built: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not built:
        replace_ops(monkeypatch, softmax_backward=None)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(shape, dtype=dtype, generator=generator, requires_grad=True)
    computes_what_torch_does(lambda: F.softmax(x, dim), [x], generator)


def _rows(seed: int, rows: int, columns: int) -> list[torch.Tensor]:
    """dy, x, mean, rstd, weight: float32, (rows, columns), with the special values among x and dy."""
    generator = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(rows, columns, generator=generator) for _ in range(2))
    x[0, :4], dy[1, :4] = torch.tensor([0.0, -0.0, 1e-40, -1e30]), torch.tensor([-0.0, 1e-38, 3e30, -1e-40])
    mean, rstd = x.mean(1, keepdim=True), torch.rand(rows, 1, generator=generator) + 0.5
    return [dy, x, mean, rstd, torch.randn(columns, generator=generator)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))  # -0 is not 0


@pytest.mark.parametrize(("rows", "columns"), [(517, 96), (64, 16), (130, 37), (3, 5)])
def test_the_ops_give_the_torch_codes_bytes_on_every_width_and_thread_count(rows, columns, torch_threads) -> None:  # noqa: ANN001
    """One order for every sum: the op's vectors at 256 and 512 bits (where the CPU has them) and on 1-3
    threads, and the same operations in torch (what runs without a compiler), agree on every byte, rows and
    columns whole blocks and chains or not."""
    needs_the_op()
    dy, x, mean, rstd, weight = _rows(4, rows, columns)
    emulated = [torch.empty(rows, columns), torch.empty(columns), torch.empty(columns)]
    normalization._layer_norm_backward(dy, x, mean, rstd, weight, *emulated)
    emulated_softmax = x * (dy - normalization._row_sums(dy * x))
    widths = (256, 512) if blas.op("widest")() == 512 else (256,)
    for width in widths:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            made = [torch.empty(rows, columns), torch.empty(columns), torch.empty(columns)]
            blas.op("layer_norm_backward")(dy, x, mean, rstd, weight, *made, width)
            for got, want in zip(made, emulated, strict=True):
                assert _same(got, want), (width, threads)
            softmax = torch.empty(rows, columns)
            blas.op("softmax_backward")(dy, x, softmax, width)
            assert _same(softmax, emulated_softmax), (width, threads)


def _gradients(threads: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Layer norm's and softmax's gradients on `threads` threads, rows short (as swin's attention has them)."""
    generator = torch.Generator().manual_seed(2)

    def draw(*shape: int) -> torch.Tensor:  # (uniform: normal_ is portable's own in one mode, ATen's in the other)
        return ((torch.rand(shape, generator=generator) - 0.5) * 4).to(dtype).requires_grad_()

    x, weight, bias, scores = draw(517, 96), draw(96), draw(96), draw(64, 16, 49, 49)
    torch.set_num_threads(threads)
    made = torch.autograd.grad(F.layer_norm(x, (96,), weight, bias), [x, weight, bias], torch.ones_like(x) * x.detach())
    (softmax,) = torch.autograd.grad(F.softmax(scores, -1), [scores], scores.detach())
    return [*made, softmax]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bytes_do_not_follow_the_thread_count(dtype: torch.dtype, torch_threads: None) -> None:
    with portable_kernels(False):  # ATen's move with the count: the test is not vacuous
        native = {threads: _gradients(threads, torch.float32) for threads in (1, 3)}
    assert not torch.equal(native[1][1], native[3][1]) and not torch.equal(native[1][3], native[3][3])
    with portable_kernels(True):
        made = {threads: _gradients(threads, dtype) for threads in (1, 2, 3)}
    for threads in (2, 3):
        for got, want in zip(made[threads], made[1], strict=True):
            assert torch.equal(got, want), (threads, dtype)
    for got, want in zip(made[1], native[1], strict=True):  # and they are the gradients
        assert got.dtype == dtype
        # (float32: the forward passes are portable's too, rounded otherwise than ATen's, and a weight's
        # gradient adds 517 rows of their outputs)
        tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
        torch.testing.assert_close(got.float(), want, **tolerance)


def test_the_out_forms_compute_what_torch_does() -> None:
    dy, x, mean, rstd, weight = (t.double() for t in _rows(5, 9, 12))
    layer_norm = torch.ops.aten.native_layer_norm_backward.out
    softmax = torch.ops.aten._softmax_backward_data.out
    assert dispatch.handles(layer_norm) and dispatch.handles(softmax)  # routed to normalization.py
    made = {}
    for portable in (False, True):
        with portable_kernels(portable):
            outs = [torch.empty(0, dtype=torch.float64) for _ in range(4)]
            layer_norm(
                dy, x, [12], mean, rstd, weight, weight, [True, True, True], out0=outs[0], out1=outs[1], out2=outs[2]
            )
            softmax(dy, x.softmax(1), 1, torch.float64, grad_input=outs[3])
            made[portable] = outs
    for got, want in zip(made[True], made[False], strict=True):
        torch.testing.assert_close(got, want)
