"""tasks/ship/quantize.py's graph rewrites around ORT's quantizer, on hand-made graphs (no training)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tasks.ship.onnx_model import INPUT, as_pixels
from tasks.ship.quantize import global_pools, quantized_pixels


def _mean_graph(shape: list[int], axes: list[int], keepdims: int) -> onnx.ModelProto:
    """x -> ReduceMean(axes, keepdims) -> y, with the rank of x known, as quant_pre_process leaves it."""
    node = helper.make_node("ReduceMean", ["x", "axes"], ["y"], keepdims=keepdims)
    reduced = {axis % len(shape) for axis in axes}
    out = [1 if i in reduced else n for i, n in enumerate(shape) if keepdims or i not in reduced]
    graph = helper.make_graph(
        [node],
        "mean",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)],
        [numpy_helper.from_array(np.array(axes, dtype=np.int64), "axes")],
    )
    # IR version 10 (opset 20's), which ONNX Runtime reads; onnx's own default can be newer than it knows
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


def _run(proto: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("axes", [[-1, -2], [2, 3], [3, 2]])
def test_a_mean_over_the_spatial_axes_becomes_global_average_pooling_with_the_same_result(axes: list[int]) -> None:
    proto = _mean_graph([2, 3, 5, 4], axes, keepdims=1)
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 4)).astype(np.float32)
    before = _run(proto, x)
    assert global_pools(proto) == 1
    assert [node.op_type for node in proto.graph.node] == ["GlobalAveragePool"]
    assert not proto.graph.initializer  # the axes went with the ReduceMean that read them
    onnx.checker.check_model(proto)
    np.testing.assert_allclose(_run(proto, x), before, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("shape", "axes", "keepdims"),
    [
        ([2, 3, 5, 4], [1], 1),  # over the channels
        ([2, 3, 5, 4], [-1, -2], 0),  # (N, C): a different shape than GlobalAveragePool's
        ([2, 5, 4], [-1, -2], 1),  # not an image batch
        ([2, 3, 5, 4], [1, 2, 3], 1),
    ],
)
def test_other_means_are_left_as_they_are(shape: list[int], axes: list[int], keepdims: int) -> None:
    proto = _mean_graph(shape, axes, keepdims)
    assert global_pools(proto) == 0
    assert [node.op_type for node in proto.graph.node] == ["ReduceMean"] and len(proto.graph.initializer) == 1


def _normalize_then_quantize(mean: list[float], std: list[float], scale: float, zero: int) -> onnx.ModelProto:
    """pixels -> (x - mean) / std -> QuantizeLinear(scale, zero) -> DequantizeLinear -> y: the start of
    every static int8 graph the compress stage writes (the first conv reads the dequantized values)."""
    channels = len(mean)
    shape = (1, channels, 1, 1)
    nodes = [
        helper.make_node("Sub", [INPUT, "mean"], ["sub"]),
        helper.make_node("Div", ["sub", "std"], ["div"]),
        helper.make_node("QuantizeLinear", ["div", "scale", "zero"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["y"]),
    ]
    constants = [
        numpy_helper.from_array(np.array(mean, np.float32).reshape(shape), "mean"),
        numpy_helper.from_array(np.array(std, np.float32).reshape(shape), "std"),
        numpy_helper.from_array(np.array(scale, np.float32), "scale"),
        numpy_helper.from_array(np.array(zero, np.uint8), "zero"),
    ]
    graph = helper.make_graph(
        nodes,
        "front",
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, ["n", channels, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", channels, 4, 4])],
        constants,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


def _every_pixel(channels: int) -> np.ndarray:
    """All 256 pixel values in every channel, as tasks/ship/onnx_model.py's as_pixels gives them."""
    values = as_pixels(np.arange(256, dtype=np.uint8).reshape(16, 1, 4, 4))
    return np.repeat(values, channels, axis=1)


def _front(proto: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {INPUT: x})[0]


@pytest.mark.parametrize(
    ("mean", "std", "scale", "zero"),
    [
        # digits' statistics and the scale min-max calibration gives them: (1 - 0) / std over 255 steps
        ([0.30479485], [0.375202], float(np.float32(1.0 / (255 * 0.375202))), 78),
        # three channels whose pixel steps are one and two quantization steps: a scale per channel,
        # values past 255 saturating alike both ways
        ([0.3047, 0.41, 0.52], [0.25, 0.125, 0.25], 1.0 / (255 * 0.25), 210),
    ],
)
def test_pixels_are_quantized_in_one_node_with_the_same_values(
    mean: list[float], std: list[float], scale: float, zero: int
) -> None:
    proto = _normalize_then_quantize(mean, std, scale, zero)
    pixels = _every_pixel(len(mean))
    before = _front(proto, pixels)
    assert quantized_pixels(proto)
    assert [node.op_type for node in proto.graph.node] == ["QuantizeLinear", "DequantizeLinear"]
    axis = [a.i for a in proto.graph.node[0].attribute if a.name == "axis"]
    assert axis == ([] if len(mean) == 1 else [1])
    assert {init.name for init in proto.graph.initializer} == {"scale", "zero", f"{INPUT}_scale", f"{INPUT}_zero_point"}
    onnx.checker.check_model(proto)
    np.testing.assert_array_equal(_front(proto, pixels), before)  # every pixel value, bit for bit


@pytest.mark.parametrize(
    ("mean", "std", "scale"),
    [
        # RGB under one scale: the channels' steps are not whole pixel values
        ([0.787, 0.735, 0.691], [0.300, 0.289, 0.329], 0.01396736),
        # one channel whose shift is half a step: a tie the kernels may round either way
        ([0.5 / 255 * 77.5 * 2], [1.0], 1.0 / 255),
        # a scale calibrated on images without white pixels: pixel steps are not whole quantization steps
        ([0.30479485], [0.375202], 0.9 / (255 * 0.375202)),
    ],
)
def test_pixels_that_would_quantize_differently_keep_the_three_nodes(
    mean: list[float], std: list[float], scale: float
) -> None:
    proto = _normalize_then_quantize(mean, std, scale, zero=round(mean[0] / std[0] / scale))
    before = proto.SerializeToString()
    assert not quantized_pixels(proto)
    assert proto.SerializeToString() == before


def test_a_normalized_input_read_elsewhere_too_is_left_alone() -> None:
    mean, std = 0.30479485, 0.375202
    scale = float(np.float32(1.0 / (255 * std)))
    proto = _normalize_then_quantize([mean], [std], scale, zero=round(mean / std / scale))
    proto.graph.node.append(helper.make_node("Relu", ["div"], ["also"]))
    proto.graph.output.append(helper.make_tensor_value_info("also", TensorProto.FLOAT, ["n", 1, 4, 4]))
    assert not quantized_pixels(proto)
    assert [node.op_type for node in proto.graph.node] == ["Sub", "Div", "QuantizeLinear", "DequantizeLinear", "Relu"]
