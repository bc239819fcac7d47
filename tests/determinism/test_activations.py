"""tasks/determinism/activations.py: sigmoid, SiLU and GELU in portable mode give one value per element, whatever
the thread count, the vector width or the compiler's presence, and stay as close to the true functions as
torch's own kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tasks.determinism import activations, blas
from tasks.determinism.kernels import PortableOpError
from tests.support.portable import needs_the_op, portable_kernels, replace_ops

# (kind, torch's function of x) for the forward kinds; a backward kind is its function's gradient
FUNCTIONS = {
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
SPECIAL = [0.0, -0.0, 1e-30, -1e-30, 1e-40, -1e-40, 87.0, 88.5, 88.8, 89.0, 104.0, -87.0, -103.5, -104.0, -105.0]
SPECIAL += [1e30, -1e30, 3.4e38, -3.4e38, float("inf"), float("-inf"), float("nan")]


def _inputs(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` values of x (normal, scaled to reach the functions' tails) and the special ones; a gradient."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.randn(count, generator=generator) * 6, torch.tensor(SPECIAL)])
    return x, torch.randn(x.shape, generator=generator)


def _reference(kind: str, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The function (or its input gradient, for a backward kind) in float64 by torch's own kernels."""
    x64 = x.double().requires_grad_()
    made = FUNCTIONS[kind.removesuffix("_backward")](x64)
    if not kind.endswith("_backward"):
        return made.detach()
    made.backward(grad.double())
    return x64.grad


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte for byte (-0 is not 0), NaN where NaN (which NaN, IEEE leaves to the instructions' operand order)."""
    nan = a.isnan()
    if a.dtype != b.dtype or not torch.equal(nan, b.isnan()):
        return False
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a[~nan].view(bits), b[~nan].view(bits))


@pytest.mark.parametrize("kind", activations.KINDS)
def test_the_op_gives_the_torch_formulas_bytes_on_every_width_and_thread_count(kind, torch_threads) -> None:  # noqa: ANN001
    """Each element is one sequence of float32 operations: the op's vectors at 256 and 512 bits (where the CPU
    has them) and on 1-3 threads, and the same operations in torch (what runs without a compiler), agree on
    every byte, over an odd count and the special values (zeros, subnormals, e^x's clamps, infinities, NaN)."""
    needs_the_op()
    x, grad = _inputs(200_003, seed=1)
    g = grad if kind.endswith("_backward") else None
    emulated = activations._formulas(kind, x, g, activations._FLOAT32)
    op = blas.op("activation")
    widths = (256, 512) if torch.ops.lockstep_blas.widest() == 512 else (256,)
    for width in widths:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = torch.empty_like(x)
            op(x, g, out, activations.KINDS.index(kind), width)
            assert _same(out, emulated), (kind, width, threads)


@pytest.mark.parametrize("kind", activations.KINDS)
def test_values_are_as_close_to_the_function_as_torchs_own(kind, monkeypatch) -> None:  # noqa: ANN001
    """Against float64: within 1.5e-6 absolute for |x| < 30 (a backward's per unit of its gradient; torch's
    float32 kernels are within 1.3e-6 there; erf is Abramowitz and Stegun's, absolute error 1.5e-7), e^x's
    clamps invisible, and special values as the function has them, NaN for NaN. Also where the op cannot be
    built (the torch formulas), and in float64 (ATen's exp, erf and tanh in the same formulas: float64's
    precision)."""
    x, grad = _inputs(100_000, seed=2)
    g = grad if kind.endswith("_backward") else None
    want = _reference(kind, x, grad)
    scale = grad.abs().clamp(min=1).double() if g is not None else 1  # a backward's error scales with its g
    for built in (True, False):
        if not built:
            replace_ops(monkeypatch, activation=None)
        got = activations.compute(kind, x, g).double()
        moderate = x.abs() < 30
        assert ((got - want) / scale)[moderate].abs().max() < 1.5e-6, kind
        rest = ~moderate & ~want.isnan()  # (at x = +-inf, float64's tanh GELU gradient is 0 times infinity)
        torch.testing.assert_close(got[rest], want[rest], atol=1e-6, rtol=1e-5)
        assert got[x.isnan()].isnan().all(), kind
    got64 = activations.compute(kind, x.double(), None if g is None else g.double())
    torch.testing.assert_close(got64[x.abs() < 30], want[x.abs() < 30], atol=1e-12, rtol=1e-12)


def test_the_ops_route_through_torch_in_every_overload(torch_threads) -> None:  # noqa: ANN001
    """F.sigmoid, F.silu (new and in place), F.gelu (both kinds) and their autograd backward run the portable
    activations (they match activations.compute byte for byte, on 1 and 3 threads alike); out= and
    grad_input= forms write their tensor; half precision computes in float32; integers follow torch."""
    x, grad = _inputs(70_001, seed=3)
    with portable_kernels(True):
        for threads in (1, 3):
            torch.set_num_threads(threads)
            for kind, function in FUNCTIONS.items():
                leaf = x.clone().requires_grad_()
                made = function(leaf)
                (made * grad).sum().backward()
                assert _same(made.detach(), activations.compute(kind, x)), kind
                if kind != "sigmoid":  # (sigmoid's backward is arithmetic on its output: ATen's kernel)
                    assert _same(leaf.grad, activations.compute(f"{kind}_backward", x, grad)), kind
            in_place = x.clone()
            F.silu(in_place, inplace=True)
            assert _same(in_place, activations.compute("silu", x))
        out = torch.empty(3)
        torch.sigmoid(x, out=out)
        assert _same(out, activations.compute("sigmoid", x))
        grad_input = torch.empty(x.shape)
        torch.ops.aten.gelu_backward.grad_input(grad, x, approximate="tanh", grad_input=grad_input)
        assert _same(grad_input, activations.compute("gelu_tanh_backward", x, grad))
        half = F.gelu(x.bfloat16())
        assert half.dtype == torch.bfloat16 and _same(
            half, activations.compute("gelu", x.bfloat16().float()).bfloat16()
        )
        assert torch.sigmoid(torch.arange(3)).dtype == torch.get_default_dtype()
        with pytest.raises(ValueError, match="approximate is 'none' or 'tanh', not 'fast'"):
            torch.ops.aten.gelu(x, approximate="fast")
        with pytest.raises(PortableOpError, match="floating-point tensors only, not torch.int64"):
            activations.compute("silu", torch.arange(3))
