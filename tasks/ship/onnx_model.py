"""ONNX files and ONNX Runtime sessions, shared by the compress and export stages.

Every model lockstep ships as ONNX takes float32 pixels in [0, 1] named `pixels`, shape (N, C, H, W)
with N free, and returns `logits`; normalisation is inside (the Classifier carries mean/std), and
its class names are in the file's metadata (`CLASSES_KEY`): the file alone is enough to predict
with. torch is imported only to export: predicting (tasks/tools/predict.py, the served model) needs ONNX
Runtime and numpy alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import onnx
import onnxruntime as ort

from tasks.core.atomic import atomic_file

if TYPE_CHECKING:
    import torch
    from torch import nn

INPUT, OUTPUT = "pixels", "logits"
CLASSES_KEY = "lockstep.classes"  # metadata: the class names, JSON, in the order of the logits


def export_onnx(model: nn.Module, example: torch.Tensor, path: Path) -> None:
    """`model` as one self-contained ONNX file: dynamic batch axis, weights inside.

    torch's exporter (dynamo) folds BatchNorm into the preceding conv when it optimises the graph.
    Node metadata (Python stack traces with this checkout's paths) is dropped: it made files 4-30%
    larger and their bytes depend on where the repository was cloned.
    """
    # heavy: torch (~4 s); the served model and ONNX scoring run without it
    import torch

    program = torch.onnx.export(
        model,
        (example,),
        dynamo=True,
        external_data=False,
        verbose=False,
        input_names=[INPUT],
        output_names=[OUTPUT],
        dynamic_shapes=({0: torch.export.Dim("batch")},),
    )
    save_onnx(program.model_proto, path)


def label(path: Path, classes: list[str]) -> None:
    """Record the class names in the model file's metadata, in the order of its logits."""
    proto = onnx.load(str(path))
    kept = [(p.key, p.value) for p in proto.metadata_props if p.key != CLASSES_KEY]
    del proto.metadata_props[:]
    for key, value in [*kept, (CLASSES_KEY, json.dumps(list(classes)))]:
        proto.metadata_props.add(key=key, value=value)
    save_onnx(proto, path)


@dataclass(frozen=True)
class ModelInput:
    """What a model file takes and names: decode images to this before `predict`."""

    channels: int
    size: tuple[int, int]  # (height, width)
    classes: list[str]


def model_input(sess: ort.InferenceSession) -> ModelInput:
    """Channels, size and class names of the model behind `sess`, or ValueError naming what is missing."""
    shape = sess.get_inputs()[0].shape  # [batch, C, H, W], the batch symbolic
    if len(shape) != 4 or not all(isinstance(n, int) and n > 0 for n in shape[1:]):
        raise ValueError(f"input {sess.get_inputs()[0].name!r} has shape {shape}, not (N, C, H, W) images")
    found = sess.get_modelmeta().custom_metadata_map.get(CLASSES_KEY)
    classes = json.loads(found) if found else None
    outputs = sess.get_outputs()[0].shape[-1]
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes) or len(classes) != outputs:
        raise ValueError(f"no list of {outputs} class names in its metadata ({CLASSES_KEY}): not a lockstep model")
    return ModelInput(int(shape[1]), (int(shape[2]), int(shape[3])), classes)


def top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The `k` likeliest classes of each row, best first, and their softmax probabilities."""
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities = shifted / shifted.sum(axis=1, keepdims=True)
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]  # ties: the lower class index first
    return order, np.take_along_axis(probabilities, order, axis=1)


def top_k_text(classes: list[str], order: np.ndarray, probabilities: np.ndarray) -> str:
    """One image's likeliest classes as text, e.g. "7:0.9912 1:0.0051 9:0.0013" (predict's CSV, the server)."""
    return " ".join(f"{classes[i]}:{p:.4f}" for i, p in zip(order.tolist(), probabilities.tolist(), strict=True))


def save_onnx(proto: onnx.ModelProto, path: Path) -> None:
    """Write `proto` atomically, without per-node metadata (see `export_onnx`)."""
    for node in proto.graph.node:
        del node.metadata_props[:]
    with atomic_file(path) as tmp:
        onnx.save_model(proto, str(tmp), save_as_external_data=False)


def session(path: Path, threads: int) -> ort.InferenceSession:
    """A CPU session with a fixed thread count (latency and results depend on it)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3  # errors only: ORT warns about every unused initializer
    # ORT's idle worker threads spin for a while after each run. On a 2-core machine they steal the
    # cores from whatever runs next (another session being timed): measured fp32 at batch 64 took
    # 1.1-1.8 ms with spinning depending on its neighbour, a steady 1.1 ms without.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def as_pixels(images: np.ndarray) -> np.ndarray:
    """uint8 (N, C, H, W) images -> the float32 [0, 1] input every exported model takes."""
    return images.astype(np.float32) / np.float32(255.0)


class Rows(Protocol):
    """Images read from their file as they are needed: tasks/data/formats.py's NpyRows (not imported:
    the served model ships this module without the data package)."""

    shape: tuple[int, ...]

    def batches(self, size: int) -> Iterator[np.ndarray]: ...


def predict(sess: ort.InferenceSession, images: np.ndarray | Rows, batch_size: int = 256) -> np.ndarray:
    """Logits for uint8 (N, C, H, W) `images` (in memory, or streamed from their file), in order."""
    if isinstance(images, np.ndarray):
        batches: Iterable[np.ndarray] = (images[i : i + batch_size] for i in range(0, len(images), batch_size))
    else:
        batches = images.batches(batch_size)
    # one array filled batch by batch, not a list joined at the end (tasks/train/models.py's gather says why)
    logits, done = np.empty((0, 0), np.float32), 0
    for batch in batches:
        out = sess.run([OUTPUT], {INPUT: as_pixels(batch)})[0]
        if done == 0:
            logits = np.empty((images.shape[0], *out.shape[1:]), dtype=out.dtype)
        logits[done : done + len(out)] = out
        done += len(out)
    if done != images.shape[0]:  # never hand back rows that were not filled
        raise ValueError(f"expected {images.shape[0]} rows, got {done}")
    return logits


def median_latency_ms(
    sessions: dict[str, ort.InferenceSession], batch: np.ndarray, runs: int, warmup: int
) -> dict[str, float]:
    """Median wall time of one `run` per session on `batch` (float32 pixels).

    The sessions take turns, run by run, so a slow patch of the machine (another process, frequency
    scaling) lands on all of them alike and their ratios stay fair.
    """
    feed = {INPUT: batch}
    for sess in sessions.values():
        for _ in range(warmup):
            sess.run([OUTPUT], feed)
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(runs):
        for name, sess in sessions.items():
            start = time.perf_counter()
            sess.run([OUTPUT], feed)
            times[name].append(time.perf_counter() - start)
    return {name: 1000.0 * float(np.median(values)) for name, values in times.items()}


# Operators whose second input is a weight tensor (float, or int8 behind a DequantizeLinear).
_WEIGHTED_OPS = {"Conv", "ConvInteger", "Gemm", "MatMul", "MatMulInteger"}


def weight_counts(path: Path) -> tuple[int, int]:
    """(non-zero, total) conv / linear weights stored in the file.

    Read from the file itself, so float and int8 models are counted alike (int8 weights are
    symmetric: a stored 0 is a zero weight). Biases, scales and the normalisation constants are
    not weights and are not counted.
    """
    graph = onnx.load(str(path)).graph
    initializers = {init.name: init for init in graph.initializer}
    dequantized_from = {node.output[0]: node.input[0] for node in graph.node if node.op_type == "DequantizeLinear"}
    nonzero = total = 0
    for name in {node.input[1] for node in graph.node if node.op_type in _WEIGHTED_OPS}:
        init = initializers.get(dequantized_from.get(name, name))
        if init is not None:
            values = onnx.numpy_helper.to_array(init)
            nonzero += int(np.count_nonzero(values))
            total += values.size
    return nonzero, total
