"""Mish, softplus and ELU (tasks/determinism/exp_activations.py), softmax along any dimension and batch norm
(normalization.py) in portable mode: torch's values and gradients (float32's within a few units in the last
place of float64's, as ATen's are), and the same bytes on 1, 2 and 3 threads where ATen's own kernels move
with the count."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from tasks.determinism import dispatch, exp_activations
from tests.support.portable import computes_what_torch_does, portable_kernels

# name -> (the op, the input's shape): sizes over several pieces, with an end that is not a whole vector
CASES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], tuple[int, ...]]] = {
    "mish": (F.mish, (100_003,)),
    "mish, transposed input": (lambda x: F.mish(x.t()), (301, 333)),
    "softplus": (F.softplus, (100_003,)),
    "softplus, beta and threshold": (lambda x: F.softplus(x, 2.0, 5.0), (64, 3, 77, 13)),
    "elu": (F.elu, (100_003,)),
    "elu in place": (lambda x: F.elu(x * 1, inplace=True), (100_003,)),
    "selu": (F.selu, (100_003,)),
    "softmax along dim 1": (lambda x: F.softmax(x, 1), (16, 16, 49, 49)),
    "softmax along dim 0": (lambda x: F.softmax(x, 0), (64, 16, 7, 49)),
    "batch norm, channels-last": (
        lambda x: _batch_norm(x.contiguous(memory_format=torch.channels_last)),
        (64, 32, 16, 16),
    ),
    "batch norm": (lambda x: _batch_norm(x), (64, 32, 16, 16)),
}


def _batch_norm(x: torch.Tensor, training: bool = True) -> torch.Tensor:
    """Batch norm of x with fixed affine weights and running statistics, float32 (float64 for float64 x: a
    bfloat16 x has them float32, as a model under autocast has)."""
    channels, dtype = x.shape[1], torch.float64 if x.dtype == torch.float64 else torch.float32
    weight, bias = torch.linspace(0.5, 2, channels, dtype=dtype), torch.linspace(-1, 1, channels, dtype=dtype)
    mean, var = torch.zeros(channels, dtype=dtype), torch.ones(channels, dtype=dtype)
    return F.batch_norm(x, mean, var, weight, bias, training=training)


@pytest.mark.parametrize("case", [*CASES, "softmax of a vector", "softmax of a scalar", "mish in place"])
def test_values_and_gradients_are_torchs(case: str) -> None:
    generator = torch.Generator().manual_seed(0)
    special = {
        "softmax of a vector": (lambda x: F.softmax(x, 0), (300,)),
        "softmax of a scalar": (lambda x: F.softmax(x, 0), ()),
        "mish in place": (lambda x: F.mish(x * 1, inplace=True), (5, 7)),
    }
    op, shape = CASES.get(case) or special[case]
    x = (torch.randn(shape, dtype=torch.float64, generator=generator) * 8).requires_grad_()
    computes_what_torch_does(lambda: op(x), [x], generator)


@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norms_values_gradients_running_statistics_and_layout_are_torchs(
    layout: torch.memory_format, training: bool
) -> None:
    generator = torch.Generator().manual_seed(2)
    made = {}
    for portable in (False, True):
        x = torch.randn(6, 5, 7, 3, dtype=torch.float64, generator=generator).to(memory_format=layout)
        x.requires_grad_()
        weight = torch.randn(5, dtype=torch.float64, generator=generator, requires_grad=True)
        bias = torch.randn(5, dtype=torch.float64, generator=generator, requires_grad=True)
        mean, var = torch.zeros(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64)
        with portable_kernels(portable):
            out = F.batch_norm(x, mean, var, weight, bias, training=training, momentum=0.3)
            grads = torch.autograd.grad(out, [x, weight, bias], x.detach().sin())
        assert out.is_contiguous(memory_format=layout) and grads[0].is_contiguous(memory_format=layout)
        made[portable] = [out, *grads, mean, var]
        generator.manual_seed(2)
    for got, want in zip(made[True], made[False], strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("running", [True, False])
def test_a_bfloat16_batch_norm_keeps_float32_parameters_and_statistics(affine: bool, running: bool) -> None:
    """As under autocast: a bfloat16 input, float32 weights and running statistics (or none of either)."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(8, 4, 5, 5, generator=generator).bfloat16().requires_grad_()
    made = {}
    for portable in (False, True):
        weight, bias = (torch.linspace(0.5, 2, 4), torch.linspace(-1, 1, 4)) if affine else (None, None)
        mean, var = (torch.zeros(4), torch.ones(4)) if running else (None, None)
        with portable_kernels(portable):
            out = F.batch_norm(x, mean, var, weight, bias, training=True)
            (grad,) = torch.autograd.grad(out, [x], torch.ones_like(out))
        made[portable] = [out, grad, *([mean, var] if running else [])]
    for got, want in zip(made[True], made[False], strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)


def _made(threads: int, dtype: torch.dtype) -> dict[str, list[torch.Tensor]]:
    """Each case's output and input gradient on `threads` threads."""
    torch.set_num_threads(threads)
    made = {}
    for name, (op, shape) in CASES.items():
        generator = torch.Generator().manual_seed(1)
        # (uniform draws: normal_ is portable's own in one mode and ATen's in the other)
        x = ((torch.rand(shape, generator=generator) - 0.5) * 16).to(dtype).requires_grad_()
        out = op(x)
        (grad,) = torch.autograd.grad(out, [x], (torch.rand(out.shape, generator=generator) - 0.5).to(dtype))
        made[name] = [out.detach(), grad]
    return made


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bytes_do_not_follow_the_thread_count(dtype: torch.dtype, torch_threads: None) -> None:
    with portable_kernels(False):  # ATen's move with the count (float32): the test is not vacuous
        native = {threads: _made(threads, torch.float32) for threads in (1, 3)}
    moved = {name for name in CASES if not all(map(torch.equal, native[1][name], native[3][name]))}
    assert {"mish", "softplus", "elu", "softmax along dim 1", "batch norm, channels-last"} <= moved, moved
    with portable_kernels(True):
        made = {threads: _made(threads, dtype) for threads in (1, 2, 3)}
    for threads in (2, 3):
        for name in CASES:
            assert all(map(torch.equal, made[threads][name], made[1][name])), (name, threads, dtype)
    # float32: the own formulas' bytes (exp_activations.py) and own sums (normalization.py), close to ATen's
    if dtype == torch.float32:
        for name in CASES:
            for got, want in zip(made[3][name], native[1][name], strict=True):
                torch.testing.assert_close(got, want)


# Inputs across float32's range, and where the formulas change branch or could cancel (0, tiny values, the
# thresholds, e^x's clamp, overflow): float32 outputs and gradients against torch's in float64
EDGES = (0.0, -0.0, 1e-8, -1e-8, 1e-30, -1e-30, 20.0, 19.999, 20.001, 5.0, 2.5, -87.0, -104.0, 88.0, 89.0, 1e6, -1e6)
FLOAT32_CASES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "mish": F.mish,
    "softplus": F.softplus,
    "softplus, beta and threshold": lambda x: F.softplus(x, 2.0, 5.0),
    "softplus, a threshold past e^x's overflow": lambda x: F.softplus(x, 0.5, 100.0),
    "elu": F.elu,
    "elu, alpha 2": lambda x: F.elu(x, 2.0),
    "selu": F.selu,
    "celu": lambda x: F.celu(x, 0.7),
}


@pytest.mark.parametrize("case", FLOAT32_CASES)
def test_the_float32_formulas_are_as_close_to_float64_as_atens(case: str) -> None:
    op = FLOAT32_CASES[case]
    x = torch.cat([torch.linspace(-120, 120, 20_001), torch.tensor(EDGES)])
    x64 = x.double().requires_grad_()
    reference = op(x64)
    (reference_grad,) = torch.autograd.grad(reference, x64, torch.ones_like(reference))
    with portable_kernels(True):
        x32 = x.clone().requires_grad_()
        out = op(x32)
        (grad,) = torch.autograd.grad(out, x32, torch.ones_like(out))
    torch.testing.assert_close(out, reference.float(), rtol=4e-6, atol=1e-6)
    torch.testing.assert_close(grad, reference_grad.float(), rtol=4e-6, atol=1e-6)
    with portable_kernels(False):  # ATen's own computes other bytes (the formulas are ours), as close
        assert not torch.equal(op(x), out)


def test_the_pieces_are_under_the_grain_and_whole_vectors() -> None:
    grain = 32768  # ATen's internal::GRAIN_SIZE: TensorIterator computes fewer elements on one thread
    widest = 2 * 64  # two vectors of 512 bits of the narrowest dtype (bytes)
    assert exp_activations.PIECE < grain and exp_activations.PIECE % widest == 0


def test_the_routes_are_installed_for_the_ops_that_moved() -> None:
    for op in (
        "mish",
        "mish_",
        "mish_backward",
        "softplus",
        "softplus_backward",
        "elu",
        "elu_",
        "elu_backward",
        "_softmax",
        "native_batch_norm",
        "native_batch_norm_backward",
    ):
        assert dispatch.handles(getattr(torch.ops.aten, op).default), op
