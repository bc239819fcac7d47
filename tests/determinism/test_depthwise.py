"""tasks/determinism/depthwise.py: a depthwise convolution in portable mode computes what torch does, and
blas_pool.cpp's op gives the bytes of the torch loops it replaces, whatever the thread count and dtype."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tasks.determinism import blas, depthwise
from tasks.determinism.kernels import PortableOpError
from tests.support.portable import computes_what_torch_does, needs_the_op, portable_kernels, replace_ops

# (stride, padding, dilation, kernel): mobilenet's and efficientnet's (3x3 and 5x5, stride 1 and 2),
# convnext's (7x7, padding 3: on a 2x2 map most offsets meet only padding), dilated and uneven ones,
# and padding wider than the kernel reaches (outputs no offset reaches: 0)
GEOMETRIES = [
    ((1, 1), (1, 1), (1, 1), (3, 3)),
    ((2, 2), (1, 1), (1, 1), (3, 3)),
    ((2, 2), (2, 2), (1, 1), (5, 5)),
    ((1, 1), (3, 3), (1, 1), (7, 7)),
    ((1, 2), (2, 0), (2, 1), (3, 2)),
    ((1, 1), (4, 4), (1, 1), (3, 3)),
]
SIZES = [(11, 9), (2, 2)]


def _inputs(size: tuple[int, int], kernel: tuple[int, int], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 6, *size, generator=generator).to(dtype)
    w = torch.randn(6, 1, *kernel, generator=generator).to(dtype)
    return x, w, generator


def _at_width(width: int):  # noqa: ANN202
    """The depthwise op with its vectors `width` bits wide (0: the widest this CPU has), for replace_ops."""
    return lambda real: functools.partial(real, width=width)


def _all_parts(x: torch.Tensor, w: torch.Tensor, geometry: tuple, grad: torch.Tensor | None) -> list[torch.Tensor]:
    out = depthwise.forward(x, w, geometry)
    grad = torch.ones_like(out) if grad is None else grad
    return [out, *depthwise.backward(grad, x, w, geometry, (True, True))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("stride", "padding", "dilation", "kernel"), GEOMETRIES)
def test_the_op_gives_the_bytes_of_the_torch_loops_on_any_thread_count(
    stride,
    padding,
    dilation,
    kernel,
    dtype,
    torch_threads,
    monkeypatch,  # noqa: ANN001
) -> None:
    needs_the_op()
    geometry = (stride, padding, dilation)
    for seed, size in enumerate(SIZES):
        x, w, generator = _inputs(size, kernel, dtype, seed)
        oh, ow = ((size[d] + 2 * padding[d] - dilation[d] * (kernel[d] - 1) - 1) // stride[d] + 1 for d in (0, 1))
        if oh < 1 or ow < 1:
            continue
        grad = torch.randn(3, 6, oh, ow, generator=generator).to(dtype)
        made = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            made.append(_all_parts(x, w, geometry, grad))
        with monkeypatch.context() as patch:
            replace_ops(patch, depthwise=None)
            loops = _all_parts(x, w, geometry, grad)
        for parts in made:
            for part, (got, want) in enumerate(zip(parts, loops, strict=True)):
                assert got.dtype == want.dtype == dtype
                assert torch.equal(got, want), (size, part)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", GEOMETRIES)
def test_channels_last_activations_give_the_same_bytes_in_their_own_layout(
    case, dtype, torch_threads, monkeypatch
) -> None:  # noqa: ANN001
    """convnext's activations come channels-last: the op sums a position's channels at once there (blocks of 64,
    16 and single channels: 100 = 64 + 16 + 16 + 4), and a weight gradient over few positions too, over many
    plane by plane (`LAST_POSITIONS` both ways). Each gives the torch loops' bytes, on 1-3 threads and with
    AVX2's 256-bit vectors, and the output and input gradient come back channels-last."""
    needs_the_op()
    stride, padding, dilation, kernel = case
    geometry = (stride, padding, dilation)
    for seed, (size, channels) in enumerate([((11, 9), 100), ((11, 9), 37), ((2, 2), 6)]):
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(3, channels, *size, generator=generator, dtype=dtype)
        w = torch.randn(channels, 1, *kernel, generator=generator, dtype=dtype)
        oh, ow = (depthwise.out_size(size[d], kernel[d], stride[d], padding[d], dilation[d]) for d in (0, 1))
        if oh < 1 or ow < 1:
            continue
        grad = torch.randn(3, channels, oh, ow, generator=generator, dtype=dtype)
        with monkeypatch.context() as patch:
            replace_ops(patch, depthwise=None)
            loops = _all_parts(x, w, geometry, grad)
        last = [t.contiguous(memory_format=torch.channels_last) for t in (x, grad)]
        runs = [(threads, positions, 0) for threads, positions in ((1, 0), (2, 0), (3, 0), (2, 1 << 30))]
        runs += [(2, positions, 256) for positions in (0, 1 << 30)]  # the loops an AVX2 CPU runs
        for threads, positions, width in runs:
            torch.set_num_threads(threads)
            monkeypatch.setattr(depthwise, "LAST_POSITIONS", positions)
            with monkeypatch.context() as patch:
                replace_ops(patch, depthwise=_at_width(width))
                parts = _all_parts(last[0], w, geometry, last[1])
            for part, (got, want) in enumerate(zip(parts, loops, strict=True)):
                assert torch.equal(got, want), (size, channels, threads, positions, width, part)
            assert all(t.is_contiguous(memory_format=torch.channels_last) for t in parts[:2])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("stride", "padding", "dilation", "kernel"), GEOMETRIES)
def test_a_depthwise_convolution_computes_what_torch_does(stride, padding, dilation, kernel, bias) -> None:  # noqa: ANN001
    """Through F.conv2d and autograd (the portable kernels route groups == channels here), against torch's own
    kernels, in float64; and the portable result is depthwise.py's, byte for byte."""
    geometry = (stride, padding, dilation)
    x, w, generator = _inputs((11, 9), kernel, torch.float64, 5)
    x, w = x.requires_grad_(), torch.nn.Parameter(w)
    b = torch.nn.Parameter(torch.randn(6, dtype=torch.float64, generator=generator)) if bias else None
    inputs = [x, w] + ([b] if bias else [])

    def conv() -> torch.Tensor:
        return F.conv2d(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=6)

    made, grads, upstream = computes_what_torch_does(conv, inputs, generator)
    direct = depthwise.forward(x, w, geometry)
    assert torch.equal(made, direct if b is None else direct + b.view(1, -1, 1, 1))
    direct_grads = depthwise.backward(upstream, x, w, geometry, (True, True))
    assert all(torch.equal(got, want) for got, want in zip(grads[:2], direct_grads, strict=True))


def test_a_1d_depthwise_convolution_computes_what_torch_does() -> None:
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(2, 4, 17, dtype=torch.float64, generator=generator, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(4, 1, 5, dtype=torch.float64, generator=generator))
    computes_what_torch_does(lambda: F.conv1d(x, w, padding=2, stride=2, groups=4), (x, w), generator)


def test_only_one_channel_per_group_in_and_out_is_depthwise() -> None:
    x = torch.empty(1, 8, 5, 5)
    assert depthwise.is_depthwise(x, torch.empty(8, 1, 3, 3), 8)
    assert not depthwise.is_depthwise(x, torch.empty(16, 1, 3, 3), 8)  # two outputs per channel: general path
    assert not depthwise.is_depthwise(x, torch.empty(4, 2, 3, 3), 4)
    assert not depthwise.is_depthwise(torch.empty(1, 1, 5, 5), torch.empty(1, 1, 3, 3), 1)


def test_the_op_refuses_shapes_that_do_not_follow_from_the_geometry() -> None:
    needs_the_op()
    x, w = torch.randn(1, 4, 6, 6), torch.randn(4, 1, 3, 3)
    with pytest.raises(RuntimeError, match="lockstep_blas: depthwise: the output's size does not follow"):
        blas.op("depthwise")(x, w, torch.empty(1, 4, 5, 5), 0, 1, 1, 1, 1, 1, 1)
    with pytest.raises(RuntimeError, match="lockstep_blas: depthwise: shapes do not match"):
        blas.op("depthwise")(x, torch.randn(3, 1, 3, 3), torch.empty(1, 4, 6, 6), 0, 1, 1, 1, 1, 1, 1)
    with pytest.raises(RuntimeError, match="lockstep_blas: depthwise: contiguous"):
        blas.op("depthwise")(x.transpose(2, 3), w, torch.empty(1, 4, 6, 6), 0, 1, 1, 1, 1, 1, 1)
    with pytest.raises(RuntimeError, match="lockstep_blas: depthwise: contiguous \\(activations channels-last\\)"):
        blas.op("depthwise")(x, w, torch.empty(1, 4, 6, 6), 0, 1, 1, 1, 1, 1, 1, True)


@pytest.mark.parametrize("groups", [1, 4])
def test_a_convolution_of_integers_is_refused_naming_the_dtype(groups: int) -> None:
    """Not computed in float32 behind the caller's back (torch's own CPU kernels have none either)."""
    x, w = torch.ones(1, 4, 5, 5, dtype=torch.int64), torch.ones(4, 4 // groups, 3, 3, dtype=torch.int64)
    with portable_kernels(True), pytest.raises(PortableOpError, match="floating-point tensors only, not torch.int64"):
        F.conv2d(x, w, groups=groups)
