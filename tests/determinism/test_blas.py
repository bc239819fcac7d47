"""tasks/determinism/blas.py: the portable products on torch's thread pool give the same bytes as the same calls
made one after another, whatever the thread count, and a machine without a compiler still computes
(the same bytes, on one thread)."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from threadpoolctl import threadpool_limits

from tasks.determinism import blas, kernels
from tests.support.portable import needs_the_op

# (a, b, whether each is stored row-major): the products a small CNN's convolutions make (forward,
# weight and input gradients), a linear layer's, and shapes that leave a short last chunk
SHAPES = [
    ((4096, 288), (288, 64), True, True),
    ((288, 4096), (4096, 64), False, True),
    ((4096, 64), (64, 288), True, False),
    ((9, 4096), (4096, 32), False, True),
    ((64, 128), (128, 10), True, False),
    ((1001, 77), (77, 333), False, False),
    ((3, 5), (5, 2), True, True),
]


def _operand(shape: tuple[int, int], row_major: bool, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if row_major:
        return torch.randn(shape, generator=generator, dtype=dtype)
    return torch.randn(shape[::-1], generator=generator, dtype=dtype).t()


@pytest.fixture()
def one_blas_thread() -> Iterator[None]:
    """As in portable mode (cpu_mode.activate): OpenBLAS itself on one thread."""
    with threadpool_limits(limits=1, user_api="blas"):
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_pool_gives_the_bytes_of_one_thread_for_any_thread_count(
    dtype: torch.dtype, one_blas_thread: None, torch_threads: None
) -> None:
    needs_the_op()
    generator = torch.Generator().manual_seed(0)
    for a_shape, b_shape, a_rows, b_rows in SHAPES:
        a, b = _operand(a_shape, a_rows, dtype, generator), _operand(b_shape, b_rows, dtype, generator)
        one = blas.gemm(a, b, torch.empty(a_shape[0], b_shape[1], dtype=dtype), pool=False)
        torch.testing.assert_close(one, (a.double() @ b.double()).to(dtype), rtol=1e-4, atol=1e-3)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            pooled = blas.gemm(a, b, torch.empty_like(one))
            assert torch.equal(pooled, one), (a_shape, b_shape, a_rows, b_rows, threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_grouped_product_in_one_call_gives_each_group_its_own_product_bytes(
    dtype: torch.dtype, one_blas_thread: None, torch_threads: None
) -> None:
    """A grouped convolution's products go to the op in one call: each group's bytes are those of its
    own product, made alone (kernels.py made one call per group before), for any thread count."""
    needs_the_op()
    generator = torch.Generator().manual_seed(1)
    for groups, m, k, n in [(96, 2048, 9, 1), (4, 300, 72, 16), (32, 7, 25, 1)]:
        a = torch.randn(groups, m, k, generator=generator, dtype=dtype)
        b = torch.randn(groups, n, k, generator=generator, dtype=dtype).transpose(1, 2)  # transposed matrices
        alone = torch.stack([blas.gemm(a[g], b[g], torch.empty(m, n, dtype=dtype)) for g in range(groups)])
        assert torch.equal(blas.gemm(a, b, torch.empty(groups, m, n, dtype=dtype), pool=False), alone)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(blas.gemm(a, b, torch.empty(groups, m, n, dtype=dtype)), alone), (groups, threads)


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize(
    ("stride", "padding", "dilation"),
    [((1, 1), (1, 1), (1, 1)), ((2, 2), (0, 0), (1, 1)), ((1, 2), (2, 1), (2, 1)), ((3, 1), (1, 3), (1, 1))],
)
def test_col2im_in_the_op_adds_in_the_order_of_the_python_loop(
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    channels_last: bool,
    torch_threads: None,
) -> None:
    """The op's col2im (kernels._add_columns) against the loop of strided adds into a zeroed, padded image
    that it replaces: equal bytes, for fields whose rows it reads whole (a convolution's without groups)
    or strided (a grouped one's), an output channel-first or channels-last, and any thread count."""
    needs_the_op()
    blas.gemm(torch.ones(4, 4), torch.ones(4, 4), torch.empty(4, 4))  # loads the ops
    generator = torch.Generator().manual_seed(2)
    n, h, w, kh, kw, c, groups = 3, 7, 9, 3, 3, 8, 4
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    whole = torch.randn(n, oh, ow, kh, kw, c, generator=generator)
    columns = torch.randn(groups, n * oh * ow, kh * kw * c // groups, generator=generator)
    strided = columns.reshape(groups, n, oh, ow, kh, kw, c // groups).permute(1, 2, 3, 4, 5, 0, 6)
    strided = strided.reshape(n, oh, ow, kh, kw, c)  # a copy with the groups' channels side by side
    strided = strided.permute(0, 1, 2, 4, 3, 5).contiguous().permute(0, 1, 2, 4, 3, 5)  # kh, kw strides swapped
    for fields in (whole, strided):
        padded = torch.zeros(n, h + 2 * padding[0], w + 2 * padding[1], c)
        for i in range(kh):
            for j in range(kw):
                rows = slice(i * dilation[0], i * dilation[0] + stride[0] * (oh - 1) + 1, stride[0])
                cols = slice(j * dilation[1], j * dilation[1] + stride[1] * (ow - 1) + 1, stride[1])
                padded[:, rows, cols, :] += fields[:, :, :, i, j, :]
        expected = padded[:, padding[0] : padding[0] + h, padding[1] : padding[1] + w].permute(0, 3, 1, 2)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = (
                torch.full((n, h, w, c), float("nan")).permute(0, 3, 1, 2) if channels_last else torch.empty(n, c, h, w)
            )
            blas.columns_op()(fields, out, *stride, *padding, *dilation)
            assert torch.equal(out, expected), (fields.is_contiguous(), threads)
    with pytest.raises(RuntimeError, match="lockstep_blas: the fields' size does not follow from the geometry"):
        blas.columns_op()(whole, torch.empty(n, c, h + stride[0], w), *stride, *padding, *dilation)


def test_the_cut_follows_the_longer_side_and_no_chunk_is_a_narrow_edge() -> None:
    assert blas.plan(4096, 64) == (0, 512) and blas.plan(9, 4096) == (1, 512)
    for m, n in [(288, 64), (1001, 333), (40, 7), (3, 2)]:
        dim, chunk = blas.plan(m, n)
        extent = (m, n)[dim]
        assert extent == max(m, n) and chunk % 4 == 0 and -(-extent // chunk) <= 8


def test_an_operand_stored_transposed_gives_the_bytes_of_one_stored_row_major(one_blas_thread: None) -> None:
    """kernels._weight_matrix lays a convolution's weights out as (O, K), which the forward reads transposed
    and the input gradient's product row-major (before, the other way round): the golden hashes hold only
    if OpenBLAS's bytes do not depend on how an operand is stored."""
    generator = torch.Generator().manual_seed(1)
    for a_shape, b_shape, a_rows, _ in SHAPES:
        a = _operand(a_shape, a_rows, torch.float32, generator)
        b = torch.randn(b_shape, generator=generator)
        row_major = blas.gemm(a, b, torch.empty(a_shape[0], b_shape[1]))
        transposed = blas.gemm(a, b.t().contiguous().t(), torch.empty_like(row_major))
        assert torch.equal(transposed, row_major), (a_shape, b_shape)


def test_an_operand_in_another_layout_is_copied_and_the_op_refuses_one(one_blas_thread: None) -> None:
    needs_the_op()
    a = torch.randn(64, 200)[:, ::2]  # every other column: neither row-major nor transposed
    b = torch.randn(100, 30)
    out = blas.gemm(a, b, torch.empty(64, 30))
    torch.testing.assert_close(out, a @ b, rtol=1e-4, atol=1e-4)
    blas.gemm(a.contiguous(), b, out)  # binds the op
    with pytest.raises(RuntimeError, match="lockstep_blas: a is neither row-major nor transposed"):
        torch.ops.lockstep_blas.gemm_chunks(a, b, out, 0, 32)
    with pytest.raises(RuntimeError, match="lockstep_blas: shapes do not match"):
        torch.ops.lockstep_blas.gemm_chunks(b, b, out, 0, 32)


def test_a_failed_build_says_why_and_the_products_run_on_one_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_blas_thread: None
) -> None:
    with pytest.raises(blas.BuildError, match=re.escape("no C++ compiler (no-such-c++) to build blas_pool.cpp")):
        blas.build(tmp_path, compiler="no-such-c++")
    with pytest.raises(blas.BuildError, match="false failed on blas_pool.cpp"):
        blas.build(tmp_path, compiler="false")
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind

    def no_compiler() -> Path:
        raise blas.BuildError("no C++ compiler (g++) to build blas_pool.cpp")

    monkeypatch.setattr(blas, "build", no_compiler)
    blas._library_loaded.cache_clear()
    try:
        a, b = torch.randn(500, 40), torch.randn(40, 70)
        with pytest.warns(UserWarning, match=r"no C\+\+ compiler .* products run on one thread \(same bytes, slower\)"):
            out = blas.gemm(a, b, torch.empty(500, 70))
        assert torch.equal(out, blas.gemm(a, b, torch.empty(500, 70), pool=False))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once per process, not per product
            blas.gemm(a, b, out)
        assert blas.backend() == "one thread (blas_pool.cpp not built)"
    finally:
        blas._library_loaded.cache_clear()


@pytest.mark.parametrize(
    ("stride", "padding", "dilation", "kernel"),
    [
        ((1, 1), (1, 1), (1, 1), (3, 3)),
        ((2, 2), (0, 0), (1, 1), (3, 3)),
        ((1, 2), (2, 1), (2, 1), (3, 2)),
        ((3, 1), (1, 3), (1, 2), (1, 4)),
    ],
)
def test_im2col_in_the_op_copies_what_the_torch_copies_do(
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    kernel: tuple[int, int],
    torch_threads: None,
) -> None:
    """The op's im2col (kernels._columns without groups) against the padded, strided copies it replaces:
    the same rows, for an input in either layout, float32 and float64, on any thread count."""
    needs_the_op()
    blas.gemm(torch.ones(4, 4), torch.ones(4, 4), torch.empty(4, 4))  # loads the ops
    generator = torch.Generator().manual_seed(3)
    n, c, h, w = 3, 5, 7, 9
    weight = torch.empty(4, c, *kernel)
    geometry = (stride, padding, dilation)
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(n, c, h, w, generator=generator, dtype=dtype)
        expected = kernels._copied_columns(
            x, weight, geometry, 1, lambda shape, like: torch.empty(shape, dtype=like.dtype)
        )
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for image in (x, x.to(memory_format=torch.channels_last)):
                kh, kw, oh, ow = kernels._shapes(image, weight, geometry)
                out = torch.full((n, oh, ow, kh, kw, c), float("nan"), dtype=dtype)
                blas.image_columns_op()(image, out, *stride, *padding, *dilation)
                assert torch.equal(out.view(1, n * oh * ow, -1), expected), (dtype, threads)
    with pytest.raises(RuntimeError, match="lockstep_blas: the fields' size does not follow from the geometry"):
        blas.image_columns_op()(x, torch.empty(n, oh + 1, ow, kh, kw, c, dtype=x.dtype), *stride, *padding, *dilation)
