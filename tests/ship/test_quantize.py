"""tasks/ship/quantize.py's graph rewrite before ORT's quantizer, on hand-made graphs (no training)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tasks.ship.quantize import global_pools


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
