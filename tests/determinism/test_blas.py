"""tasks/determinism/blas.py: every element of a portable product is one chain of fused multiply-adds in
order, whatever the vector width and the thread count, and a machine without a compiler still computes
float32 products (the same bytes, in Python)."""

from __future__ import annotations

import itertools
import re
import warnings
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from tasks.core.errors import Refused
from tasks.determinism import blas, kernels
from tests.support.portable import needs_the_op, portable_kernels, replace_ops

# (a, b, whether each is stored row-major): the products a small CNN's convolutions make (forward,
# weight and input gradients), a linear layer's, shapes that leave a short last chunk, edge tiles in
# both directions, an inner dimension across several blocks of 256 (and, b being narrow, of 512: the
# longer blocks of products.h's `depth`), and an empty one
SHAPES = [
    ((4096, 288), (288, 64), True, True),
    ((288, 4096), (4096, 64), False, True),
    ((4096, 64), (64, 288), True, False),
    ((9, 4096), (4096, 32), False, True),
    ((64, 128), (128, 10), True, False),
    ((1001, 77), (77, 333), False, False),
    ((37, 700), (700, 45), True, True),
    ((150, 1300), (1300, 96), False, False),
    ((3, 5), (5, 2), True, True),
    ((5, 0), (0, 3), True, True),
]


def _operand(shape: tuple[int, int], row_major: bool, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if row_major:
        return torch.randn(shape, generator=generator, dtype=dtype)
    return torch.randn(shape[::-1], generator=generator, dtype=dtype).t()


def _widths() -> list[int]:
    """The op's vector widths this CPU can run: 256 always (portable needs AVX2), 512 with AVX-512."""
    needs_the_op()
    blas.gemm(torch.ones(1, 1), torch.ones(1, 1), torch.empty(1, 1))  # loads the op
    return [256, 512] if torch.ops.lockstep_blas.widest() == 512 else [256]


def test_each_element_is_one_chain_of_fused_multiply_adds_at_every_width_and_thread_count(
    torch_threads: None,
) -> None:
    """The op against `blas.emulated` (the definition computed in torch, from float64): equal bytes for
    every shape and layout, at each vector width and on 1-3 threads."""
    generator = torch.Generator().manual_seed(0)
    for a_shape, b_shape, a_rows, b_rows in SHAPES:
        a, b = _operand(a_shape, a_rows, torch.float32, generator), _operand(b_shape, b_rows, torch.float32, generator)
        expected = blas.emulated(a, b)
        torch.testing.assert_close(expected, (a.double() @ b.double()).float(), rtol=1e-4, atol=1e-3)
        for width in _widths():
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                out = blas.gemm(a, b, torch.full_like(expected, float("nan")), width=width)
                assert torch.equal(out, expected), (a_shape, b_shape, a_rows, b_rows, width, threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_bias_added_as_the_product_is_stored_gives_the_bytes_of_adding_it_after(
    dtype: torch.dtype, torch_threads: None
) -> None:
    """addmm's bias (a linear layer's), which the op adds to each element once its chain is complete: the
    bytes of the product and then torch's add, on every shape (edge tiles, k in several blocks or none),
    at each vector width and on 1-3 threads (a chunk of columns takes its part of the bias)."""
    generator = torch.Generator().manual_seed(5)
    for a_shape, b_shape, a_rows, b_rows in SHAPES:
        a, b = _operand(a_shape, a_rows, dtype, generator), _operand(b_shape, b_rows, dtype, generator)
        bias = torch.randn(b_shape[1], generator=generator, dtype=dtype)
        expected = blas.gemm(a, b, torch.empty(a_shape[0], b_shape[1], dtype=dtype)) + bias
        for width in _widths():
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                out = blas.gemm(a, b, torch.full_like(expected, float("nan")), bias=bias, width=width)
                assert torch.equal(out, expected), (a_shape, b_shape, a_rows, b_rows, width, threads)


def test_a_linear_layers_bias_is_added_by_the_product_only_where_that_keeps_torchs_bytes() -> None:
    """dispatch's addmm gives the op the bias of a linear layer (one row for every row, as 1-D, expanded or
    1 x n; float32 or float64, alpha and beta 1): the bytes of the product, then the add. Any other addmm
    (scaled, a full matrix, bfloat16 rounded after its float32 product) keeps the product and the add apart."""
    generator = torch.Generator().manual_seed(6)
    x, weight = torch.randn(50, 300, generator=generator), torch.randn(70, 300, generator=generator)
    bias = torch.randn(70, generator=generator)
    fusable = [bias, bias.expand(50, 70), bias[None]]
    assert all(kernels.fusable_bias(row, x, weight.t()) is not None for row in fusable)
    assert kernels.fusable_bias(torch.randn(50, 70), x, weight.t()) is None
    assert kernels.fusable_bias(bias.bfloat16(), x.bfloat16(), weight.t().bfloat16()) is None
    assert kernels.fusable_bias(bias.double(), x, weight.t()) is None
    product = kernels.matmul(x, weight.t())
    with portable_kernels(True):
        for row in fusable:
            assert torch.equal(torch.addmm(row, x, weight.t()), product + bias)
        assert torch.equal(torch.nn.functional.linear(x, weight, bias), product + bias)
        assert torch.equal(torch.addmm(bias, x, weight.t(), beta=0.5), product + 0.5 * bias)


def test_the_chain_rounds_once_per_term_in_order() -> None:
    """What the definition says, on values where it shows: fma(a, b, c) rounds a * b + c once (a product
    rounded first gives another float32), and the terms are added from the first to the last."""
    x = 1 + 2**-12  # x * x = 1 + 2**-11 + 2**-24: its float32 rounding drops the 2**-24
    a = torch.tensor([[1.0, x]])
    b = torch.tensor([[-1.0], [x]])
    for width in _widths():
        assert blas.gemm(a, b, torch.empty(1, 1), width=width).item() == 2**-11 + 2**-24, width
    assert blas.emulated(a, b).item() == 2**-11 + 2**-24
    big = torch.tensor([[1.0, 2.0**30, -(2.0**30)]])
    ones = torch.ones(3, 1)
    for width in _widths():  # in order: (1 + 2**30) rounds to 2**30, then - 2**30: 0, not 1
        assert blas.gemm(big, ones, torch.empty(1, 1), width=width).item() == 0.0, width


def test_float64_products_are_the_exactly_rounded_chain_at_every_width(torch_threads: None) -> None:
    """float64 has no wider type to emulate fma with: each element checked against the chain in exact
    rational arithmetic (float() of a Fraction rounds once, to nearest), on a small product."""
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(7, 300, generator=generator, dtype=torch.float64)
    b = torch.randn(300, 13, generator=generator, dtype=torch.float64)
    expected = torch.empty(7, 13, dtype=torch.float64)
    for i in range(7):
        for j in range(13):
            c = 0.0
            for k in range(300):
                c = float(Fraction(a[i, k].item()) * Fraction(b[k, j].item()) + Fraction(c))
            expected[i, j] = c
    for width in _widths():
        for threads in (1, 3):
            torch.set_num_threads(threads)
            assert torch.equal(blas.gemm(a, b, torch.empty(7, 13, dtype=torch.float64), width=width), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_grouped_product_in_one_call_gives_each_group_its_own_product_bytes(
    dtype: torch.dtype, torch_threads: None
) -> None:
    """A grouped convolution's products go to the op in one call: each group's bytes are those of its
    own product, made alone, for any thread count."""
    needs_the_op()
    generator = torch.Generator().manual_seed(1)
    for groups, m, k, n in [(96, 2048, 9, 1), (4, 300, 72, 16), (32, 7, 25, 1)]:
        a = torch.randn(groups, m, k, generator=generator, dtype=dtype)
        b = torch.randn(groups, n, k, generator=generator, dtype=dtype).transpose(1, 2)  # transposed matrices
        alone = torch.stack([blas.gemm(a[g], b[g], torch.empty(m, n, dtype=dtype)) for g in range(groups)])
        if dtype == torch.float32:
            assert torch.equal(blas.emulated(a, b), alone)
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
            blas.op("gather_columns")(fields, out, *stride, *padding, *dilation)
            assert torch.equal(out, expected), (fields.is_contiguous(), threads)
    with pytest.raises(RuntimeError, match="lockstep_blas: the fields' size does not follow from the geometry"):
        blas.op("gather_columns")(whole, torch.empty(n, c, h + stride[0], w), *stride, *padding, *dilation)


def test_the_cut_follows_the_longer_side_and_the_threads_in_whole_tiles() -> None:
    assert blas.plan(4096, 64, 2) == (0, 2052) and blas.plan(9, 4096, 8) == (1, 512)
    assert blas.plan(288, 32, 2) == (0, 144)  # a weight gradient's: two chunks for two threads, not three
    for m, n, threads in [(288, 64, 3), (1001, 333, 2), (40, 7, 4), (3, 2, 1), (100, 5000, 64)]:
        dim, chunk = blas.plan(m, n, threads)
        extent = (m, n)[dim]
        chunks = -(-extent // chunk)
        assert extent == max(m, n) and chunk % (12 if dim == 0 else 32) == 0 and chunks <= threads
        assert chunks == 1 or extent // chunks >= 64  # no chunk too small to pay for its packing


def test_an_operand_stored_transposed_gives_the_bytes_of_one_stored_row_major() -> None:
    """kernels._weight_matrix lays a convolution's weights out as (O, K), which the forward reads transposed
    and the input gradient's product row-major: how an operand is stored must not change the bytes."""
    generator = torch.Generator().manual_seed(1)
    for a_shape, b_shape, a_rows, _ in SHAPES:
        a = _operand(a_shape, a_rows, torch.float32, generator)
        b = torch.randn(b_shape, generator=generator)
        row_major = blas.gemm(a, b, torch.empty(a_shape[0], b_shape[1]))
        transposed = blas.gemm(a, b.t().contiguous().t(), torch.empty_like(row_major))
        assert torch.equal(transposed, row_major), (a_shape, b_shape)


def test_an_operand_in_another_layout_is_copied_and_the_op_refuses_one() -> None:
    needs_the_op()
    a = torch.randn(64, 200)[:, ::2]  # every other column: neither row-major nor transposed
    b = torch.randn(100, 30)
    out = blas.gemm(a, b, torch.empty(64, 30))
    torch.testing.assert_close(out, a @ b, rtol=1e-4, atol=1e-4)
    blas.gemm(a.contiguous(), b, out)  # loads the op
    with pytest.raises(RuntimeError, match="lockstep_blas: a is neither row-major nor transposed"):
        torch.ops.lockstep_blas.gemm_chunks(a, b, out, 0, 32)
    with pytest.raises(RuntimeError, match="lockstep_blas: shapes do not match"):
        torch.ops.lockstep_blas.gemm_chunks(b, b, out, 0, 32)
    with pytest.raises(RuntimeError, match="lockstep_blas: width 0, 256 or 512, not 128"):
        torch.ops.lockstep_blas.gemm_chunks(a.contiguous(), b, out, 0, 32, 128)


def test_a_failed_build_says_why_and_float32_products_are_computed_in_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(blas.BuildError, match=re.escape("no C++ compiler (no-such-c++) to build blas_pool.cpp")):
        blas.build(tmp_path, compiler="no-such-c++")
    with pytest.raises(blas.BuildError, match="false failed on blas_pool.cpp"):
        blas.build(tmp_path, compiler="false")
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind
    a, b = torch.randn(50, 300), torch.randn(300, 70)
    needs_the_op()
    with_op = blas.gemm(a, b, torch.empty(50, 70))

    def no_compiler() -> Path:
        raise blas.BuildError("no C++ compiler (g++) to build blas_pool.cpp")

    monkeypatch.setattr(blas, "build", no_compiler)
    blas._library_loaded.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"no C\+\+ compiler .* float32 products run in Python \(same bytes"):
            out = blas.gemm(a, b, torch.empty(50, 70))
        assert torch.equal(out, with_op)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once per process, not per product
            blas.gemm(a, b, out)
        assert blas.backend() == "fma chains in Python, one thread (blas_pool.cpp not built)"
        with pytest.raises(Refused, match=r"portable computes torch.float64 products only in the C\+\+ op"):
            blas.gemm(a.double(), b.double(), torch.empty(50, 70, dtype=torch.float64))
    finally:
        blas._library_loaded.cache_clear()


# (stride, padding, dilation, kernel, image size): 3x3 and 1x1 kernels, strides and dilations of 2, uneven
# padding, a 7x7 stem, an image whose rows come in several blocks (40 rows), and small ones taken several at once
GEOMETRIES = [
    ((1, 1), (1, 1), (1, 1), (3, 3), (9, 11)),
    ((2, 2), (1, 1), (1, 1), (3, 3), (12, 12)),
    ((1, 2), (2, 0), (2, 1), (5, 3), (10, 9)),
    ((1, 1), (0, 0), (1, 1), (1, 1), (8, 8)),
    ((2, 2), (3, 3), (1, 1), (7, 7), (7, 7)),
    ((1, 1), (1, 1), (1, 1), (3, 3), (40, 20)),
    ((1, 1), (1, 1), (1, 1), (3, 3), (4, 4)),
]


def _convolution(geometry: tuple, dtype: torch.dtype, generator: torch.Generator) -> tuple:
    """x (5, C, H, W), weights (O, C, kh, kw), their columns written out (torch's copies, kernels.py's
    fallback) and the weights as the products take them (O, kh*kw*C)."""
    stride, padding, dilation, kernel, size = geometry
    x = torch.randn(5, 6, *size, generator=generator, dtype=dtype)
    weight = torch.randn(7, 6, *kernel, generator=generator, dtype=dtype)
    columns = kernels._copied_columns(x, weight, geometry[:3], 1, lambda shape, like: torch.empty(shape, dtype=dtype))
    return x, weight, columns[0], kernels._weight_matrix(weight, 1)[0]


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_products_of_fields_give_the_bytes_of_the_columns_written_out(geometry: tuple, torch_threads: None) -> None:
    """A convolution's forward and weight-gradient products read its columns from the padded image
    (`blas.Fields`, never written out): the same bytes as the products of the columns written out, float32
    and float64, at each vector width, on 1-3 threads; x in either memory layout."""
    stride, padding, dilation, kernel, _ = geometry
    generator = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64):
        x, _, columns, weights = _convolution(geometry, dtype, generator)
        grad = torch.randn(columns.shape[0], weights.shape[0], generator=generator, dtype=dtype)
        forward = blas.gemm(columns, weights.t(), torch.empty(columns.shape[0], weights.shape[0], dtype=dtype))
        weight_grad = blas.gemm(columns.t(), grad, torch.empty(columns.shape[1], grad.shape[1], dtype=dtype))
        for layout in (x, x.to(memory_format=torch.channels_last)):
            size = (x.shape[0], x.shape[2] + 2 * padding[0], x.shape[3] + 2 * padding[1], x.shape[1])
            image = torch.full(size, float("nan"), dtype=dtype)  # the border must be written too
            blas.op("padded_image")(layout, image, *padding)
            fields = blas.Fields(image, kernel, stride, dilation)
            for width, threads in itertools.product(_widths(), (1, 2, 3)):
                torch.set_num_threads(threads)
                out = blas.field_gemm(fields, weights.t(), torch.full_like(forward, float("nan")), width=width)
                assert torch.equal(out, forward), (dtype, width, threads)
                out = blas.field_gemm(fields, grad, torch.full_like(weight_grad, float("nan")), True, width=width)
                assert torch.equal(out, weight_grad), (dtype, width, threads)


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_the_input_gradient_in_one_op_gives_the_bytes_of_its_columns_gathered(
    geometry: tuple, torch_threads: None
) -> None:
    """The `input_gradient` op (the columns' product and col2im at once, output rows from the last) against the
    columns written out and added back by kernels._add_columns: equal bytes, float32 and float64, at each
    vector width, on 1-3 threads, into an output of either layout."""
    stride, padding, dilation, kernel, _ = geometry
    generator = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.float64):
        x, weight, columns, weights = _convolution(geometry, dtype, generator)
        grad = torch.randn(columns.shape[0], weights.shape[0], generator=generator, dtype=dtype)
        written = blas.gemm(grad, weights, torch.empty(columns.shape, dtype=dtype))
        expected = kernels._add_columns(written.unsqueeze(0), x, weight, geometry[:3])
        for width, threads in itertools.product(_widths(), (1, 3)):
            torch.set_num_threads(threads)
            for out in (
                torch.full_like(x, float("nan")),
                torch.full_like(x, float("nan")).to(memory_format=torch.channels_last),
            ):
                blas.op("input_gradient")(grad, weights, out, *kernel, *stride, *padding, *dilation, width)
                assert torch.equal(out, expected), (dtype, width, threads)


def test_the_convolution_ops_refuse_shapes_that_do_not_follow_from_the_geometry() -> None:
    needs_the_op()
    blas.gemm(torch.ones(1, 1), torch.ones(1, 1), torch.empty(1, 1))  # loads the ops
    x, image = torch.randn(2, 3, 8, 8), torch.empty(2, 10, 10, 3)
    with pytest.raises(RuntimeError, match="padded_image: out is not x's size with its padding, channels-last"):
        blas.op("padded_image")(x, torch.empty(2, 10, 9, 3), 1, 1)
    blas.op("padded_image")(x, image, 1, 1)
    fields = blas.Fields(image, (3, 3), (1, 1), (1, 1))
    with pytest.raises(RuntimeError, match="lockstep_blas: fields: shapes"):
        blas.field_gemm(fields, torch.randn(26, 4), torch.empty(128, 4))
    with pytest.raises(RuntimeError, match="input_gradient: shapes do not follow from the geometry"):
        blas.op("input_gradient")(
            torch.randn(127, 4), torch.randn(4, 27), torch.empty(2, 3, 8, 8), 3, 3, 1, 1, 1, 1, 1, 1, 0
        )


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "columns"])
@pytest.mark.parametrize("geometry", [GEOMETRIES[0], GEOMETRIES[2], GEOMETRIES[5]])
def test_a_convolution_trains_the_same_bytes_with_its_columns_written_out(
    geometry: tuple, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kernels.py end to end (forward with a bias, then the gradients): the ops that never write the columns
    out give the bytes of the path that does (where the op cannot be built, or with groups); the input
    gradient takes the fused op (small weights, kernels._fused) or, with the weights' bound set to nothing,
    writes its columns out and gathers them in the op."""
    needs_the_op()
    if not fused:
        monkeypatch.setattr(kernels, "_FUSED_WEIGHT_BYTES", 0)
    stride, padding, dilation, kernel, size = geometry
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, *size, generator=generator)
    weight = torch.randn(6, 4, *kernel, generator=generator)
    bias = torch.randn(6, generator=generator)

    def step() -> list[torch.Tensor]:
        xs, ws, bs = x.clone().requires_grad_(), weight.clone().requires_grad_(), bias.clone().requires_grad_()
        out = torch.nn.functional.conv2d(xs, ws, bs, stride, padding, dilation)
        out.backward(torch.ones_like(out).cumsum(-1))
        return [out.detach(), xs.grad, ws.grad, bs.grad]

    _, _, oh, ow = kernels._shapes(x, weight, (stride, padding, dilation))
    grad = torch.empty(1, x.shape[0] * oh * ow, weight.shape[0])  # the output gradient, as _input_gradient sees it
    assert kernels._fused(grad, x, weight) == fused
    with portable_kernels(True):
        fused = step()
        replace_ops(monkeypatch, padded_image=None, input_gradient=None)
        written = step()
    for a, b in zip(fused, written, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8])
def test_the_rotated_copy_moves_each_element_where_torchs_permute_puts_it(
    dtype: torch.dtype, torch_threads: None
) -> None:
    """rotated_copy (a weight gradient's product laid out as the weight) against torch's copy of the permuted
    view: equal bytes for each element size, shapes with a short last strip of rows, a non-contiguous x, a
    channel dimension of one (a 1x1 kernel's), and on 1-3 threads; the op refuses a wrong shape and an
    out that overlaps x."""
    needs_the_op()
    blas.gemm(torch.ones(1, 1), torch.ones(1, 1), torch.empty(1, 1))  # loads the ops
    op = blas.op("rotated_copy")
    generator = torch.Generator().manual_seed(3)
    for b, r1, r2, c in [(1, 37, 9, 70), (2, 16, 4, 33), (3, 130, 1, 5), (1, 5, 3, 1000)]:
        product = (torch.rand(b, r2, r1, c, generator=generator) * 200).to(dtype)  # (g, kh*kw, C, O), as kernels.py
        x = product.transpose(1, 2)
        expected = x.permute(0, 3, 1, 2).contiguous()
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = torch.full((b, c, r1, r2), 7).to(dtype)
            op(x, out)
            assert torch.equal(out, expected), ((b, r1, r2, c), threads)
    with pytest.raises(KeyError, match="blas_pool.cpp has no op 'rotated'"):
        blas.op("rotated")
    x = torch.randn(1, 4, 3, 5)
    with pytest.raises(RuntimeError, match="out is not"):
        op(x, torch.empty(1, 5, 3, 4))
    with pytest.raises(RuntimeError, match="single memory location"):
        op(x, x.view(1, 5, 4, 3))


def test_a_weight_gradient_larger_than_the_cache_is_rotated_by_the_op_with_torchs_bytes() -> None:
    """A resnet's last layers' weight gradient (512 x 512 x 3 x 3, past blas._ROTATED_BYTES) goes through
    the op, a small one through torch's copy; both give the layout torch's permute gives."""
    needs_the_op()
    for channels, by_op in ((512, True), (64, False)):
        x = torch.randn(1, 9, channels, channels).transpose(1, 2)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            out = blas.rotated_copy(x, torch.empty(1, channels, channels, 9))
        assert torch.equal(out, x.permute(0, 3, 1, 2))
        names = {event.name for event in profile.events()}
        assert ("lockstep_blas::rotated_copy" in names) == by_op, (channels, sorted(names))


def test_every_op_blas_names_is_one_the_library_defines() -> None:
    needs_the_op()
    for name in blas.OPS:
        assert callable(blas.op(name)), name
