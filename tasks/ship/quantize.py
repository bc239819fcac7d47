"""int8 quantization for the compress stage, with maintained tools only.

- post-training (dynamic and static): ONNX Runtime's quantizer, applied to the fp32 ONNX file. Its
  QDQ graphs are the ones ORT's int8 kernels are written for, and ORT is what runs them here.
- quantization-aware training: torchao's pt2e flow (`prepare_qat_pt2e` / `convert_pt2e`, the
  successor of the deprecated `torch.ao.quantization` eager API), exported to the same QDQ ONNX.

Conv-BN-ReLU fusion: BatchNorm is folded into the conv by torch's ONNX exporter (post-training) or
before QAT starts (qat); the quantizers absorb ReLU into the conv's output quantization range.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from tasks.core.atomic import atomic_file
from tasks.ship.onnx_model import INPUT, as_pixels, export_onnx, save_onnx

if TYPE_CHECKING:
    import onnx


def _preprocessed(fp32: Path, workdir: Path) -> Path:
    # ORT's recommended first step: shape inference + graph optimisation (fusions) before quantizing.
    # heavy: onnx and onnxruntime.quantization (~1 s), only for the ONNX int8 variants
    import onnx
    from onnxruntime.quantization.shape_inference import quant_pre_process

    out = workdir / "preprocessed.onnx"
    quant_pre_process(str(fp32), str(out), skip_symbolic_shape=False)
    proto = onnx.load(str(out))
    if global_pools(proto):
        onnx.save_model(proto, str(out))
    return out


def global_pools(proto: onnx.ModelProto) -> int:
    """Rewrite each mean over the last two axes of a 4-D tensor, kept as (N, C, 1, 1), into the
    GlobalAveragePool it is; returns how many.

    torch's exporter writes global pooling as ReduceMean. ORT's quantizer has an int8 kernel for
    GlobalAveragePool (QLinearGlobalAveragePool) and none for ReduceMean, so the int8 graph left int8
    for that one node (DequantizeLinear, a float ReduceMean, QuantizeLinear) and ran two more nodes.
    Measured on the 2-core Intel Xeon with VNNI (small_cnn, digits): static int8 at batch 64 went from
    1.54x to 1.86x fp32's speed on 2 threads, at batch 1 from 1.24-1.35x to 1.41-1.53x on one
    (2026-12-04, benchmarks/results/int8-vnni.json).
    The fp32 file keeps its ReduceMean: its bytes and its results do not change.
    """
    # heavy: onnx (~0.7 s), only for the ONNX int8 variants
    import onnx
    from onnx import numpy_helper

    constants = {init.name: numpy_helper.to_array(init) for init in proto.graph.initializer}
    ranks = {
        info.name: len(info.type.tensor_type.shape.dim)
        for info in [*proto.graph.value_info, *proto.graph.input, *proto.graph.output]
        if info.type.tensor_type.HasField("shape")
    }
    rewritten: list[str] = []  # their axes' names
    for node in proto.graph.node:
        if node.op_type != "ReduceMean" or len(node.input) != 2 or node.input[1] not in constants:
            continue
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        axes = {int(axis) % 4 for axis in constants[node.input[1]].reshape(-1)}
        if ranks.get(node.input[0]) == 4 and axes == {2, 3} and attributes.get("keepdims", 1) == 1:
            rewritten.append(node.input[1])
            node.op_type = "GlobalAveragePool"
            del node.input[1:]
            del node.attribute[:]
    # the axes go with their ReduceMean, unless another node reads them
    used = {name for node in proto.graph.node for name in node.input}
    for init in [init for init in proto.graph.initializer if init.name in rewritten and init.name not in used]:
        proto.graph.initializer.remove(init)
    return len(rewritten)


def dynamic_int8(fp32: Path, out: Path) -> None:
    """int8 weights, activations quantized on the fly (ORT `quantize_dynamic`, ConvInteger kernels).

    Measured ~10x slower than fp32 on CNNs (ORT's ConvInteger path): it is built for the table,
    not recommended for shipping convnets.
    """
    # heavy: onnxruntime.quantization (~0.5 s+), only for the dynamic int8 variant
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(dir=out.parent) as workdir, atomic_file(out) as tmp:
        quantize_dynamic(_preprocessed(fp32, Path(workdir)), tmp, weight_type=QuantType.QInt8)
    _strip(out)


class _Calibration:
    """ORT's CalibrationDataReader protocol over fixed batches of uint8 images."""

    def __init__(self, images: np.ndarray, batch_size: int) -> None:
        self._batches: Iterator[dict[str, np.ndarray]] = iter(
            {INPUT: as_pixels(images[i : i + batch_size])} for i in range(0, len(images), batch_size)
        )

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._batches, None)


# How `static_int8` quantizes (onnxruntime.quantization.quantize_static's keywords, enums by name);
# benchmarks/compression.py times the alternatives against these.
STATIC_INT8: Mapping[str, object] = MappingProxyType(
    {
        "quant_format": "QDQ",
        "per_channel": True,
        "activation_type": "QUInt8",
        "weight_type": "QInt8",
        "reduce_range": True,
        # A Gemm's output left in float: the logits, which quantized were rounded to 256 levels for a
        # DequantizeLinear to undo, one node more on each request (ORT's QGemm writes float itself).
        # A node after a Gemm that ORT would quantize (VGG's ReLU) then runs in float; our two models,
        # ResNets and MobileNets end in a single Gemm.
        "extra_options": MappingProxyType({"OpTypesToExcludeOutputQuantization": ("Gemm",)}),
    }
)


def static_int8(
    fp32: Path, out: Path, calibration: np.ndarray, batch_size: int = 64, options: Mapping[str, object] | None = None
) -> None:
    """int8 weights (per output channel) and activations (ranges calibrated on `calibration`), QDQ format;
    `options` replace any of `STATIC_INT8` (min-max calibration always).

    Weights use 7 bits (`reduce_range`): on x86 CPUs without VNNI, ORT's u8 x s8 kernels add pairs of
    products in int16 (vpmaddubsw), which saturates with full-range weights, so the same int8 file
    computed other logits there than on a VNNI CPU. Seen on resnet9 on 32-px RGB shapes on an AMD
    EPYC without VNNI: top-1 agreement with fp32 0.973 (accuracy 0.860 vs 0.877); with 7-bit weights
    1.000 (0.876), and the first conv's wide-ranged inputs were the ones saturating.
    """
    # heavy: onnxruntime.quantization (~0.5 s+), only for the static int8 variant
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    chosen = {**STATIC_INT8, **(options or {})}
    enums = {"quant_format": QuantFormat, "activation_type": QuantType, "weight_type": QuantType}
    keywords = {key: enums[key][value] if key in enums else value for key, value in chosen.items()}
    keywords["extra_options"] = dict(keywords.get("extra_options", {}))  # ORT's own copy, not the constant
    with tempfile.TemporaryDirectory(dir=out.parent) as workdir, atomic_file(out) as tmp:
        quantize_static(
            _preprocessed(fp32, Path(workdir)),
            tmp,
            _Calibration(calibration, batch_size),
            calibrate_method=CalibrationMethod.MinMax,
            **keywords,
        )
    _strip(out, fold_input=True)


def _strip(path: Path, fold_input: bool = False) -> None:
    # heavy: onnx (~0.7 s), only for the ONNX int8 variants
    import onnx

    proto = onnx.load(str(path))
    if fold_input:
        quantized_pixels(proto)
    save_onnx(proto, path)


# How far from a rounding tie (in quantization steps) every pixel value must quantize, in the graph
# and in its rewrite, for `quantized_pixels` to call them the same: float32 kernels that divide or
# multiply by a reciprocal, in any order, differ by ~1e-5 steps here, far less than this margin.
_TIE_MARGIN = 0.01


def quantized_pixels(proto: onnx.ModelProto) -> bool:
    """Quantize the pixels in one node where the int8 graph normalizes them first, when every pixel
    value quantizes the same; returns whether it rewrote the graph.

    Every exported model starts with (pixels - mean) / std, and the static int8 graph quantizes that
    for its first conv: Sub, Div and QuantizeLinear(scale s, zero point z) on each request. Pixels are
    u / 255 for u in 0..255, so per channel c the quantized value is round(u / (255 std_c s) - k_c) + z
    with k_c = mean_c / (std_c s); min-max calibration on images with black and white pixels makes
    255 std_c s = 1 on one-channel inputs, and then round(u - k_c) = u - round(k_c): the same integers
    as QuantizeLinear(pixels, std_c s, z - round(k_c)), one node. This is checked, not assumed: the
    rewrite is made only when all 256 values of every channel quantize to the same integers, each
    clear of a rounding tie in both forms. The first conv still reads them with s and z, so the
    graph computes the same logits. With float logits (STATIC_INT8) it took 7-9% off a batch-1 request
    of small_cnn on digits on the 2-core AMD EPYC, Zen 3 (2026-12-07, benchmarks/results/int8-amd-zen3.json).
    Several channels quantized with one scale (RGB) rarely pass the check and keep their three nodes.
    """
    # heavy: onnx (~0.7 s), only for the ONNX int8 variants
    from onnx import helper, numpy_helper

    graph = proto.graph
    front = _normalizing_front(graph)
    if front is None:
        return False
    sub, div, quant = front
    constants = {init.name: init for init in graph.initializer}
    names = (sub.input[1], div.input[1], *quant.input[1:])
    mean, std, scale, zero = (numpy_helper.to_array(constants[name]) for name in names)
    found = _pixel_quantization(mean, std, scale, zero)
    if found is None:
        return False
    new_scale = found[0]
    pixel_names = (f"{INPUT}_scale", f"{INPUT}_zero_point")
    graph.initializer.extend(numpy_helper.from_array(v, name) for v, name in zip(found, pixel_names, strict=True))
    quant.input[:] = [INPUT, *pixel_names]
    if new_scale.ndim:  # one scale and zero point per channel
        quant.attribute.append(helper.make_attribute("axis", 1))
    graph.node.remove(sub)
    graph.node.remove(div)
    used = {name for node in graph.node for name in node.input}
    for name in (sub.input[1], div.input[1]):
        if name not in used and constants[name] in graph.initializer:
            graph.initializer.remove(constants[name])
    return True


def _normalizing_front(graph: onnx.GraphProto) -> tuple[onnx.NodeProto, onnx.NodeProto, onnx.NodeProto] | None:
    """The graph input's Sub(mean) -> Div(std) -> QuantizeLinear(scale, zero point), constants all,
    each the only reader of what it reads and nothing a graph output; None where the graph differs."""
    constants = {init.name for init in graph.initializer}
    outputs = {out.name for out in graph.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)

    def only_reader(name: str, op_type: str) -> onnx.NodeProto | None:
        found = readers.get(name, [])
        ok = len(found) == 1 and found[0].op_type == op_type and name not in outputs
        return found[0] if ok and all(i in constants for i in found[0].input[1:]) else None

    sub = only_reader(INPUT, "Sub")
    div = sub and only_reader(sub.output[0], "Div")
    quant = div and only_reader(div.output[0], "QuantizeLinear")
    if sub is None or div is None or quant is None or len(quant.input) != 3 or quant.attribute:
        return None
    return sub, div, quant


def _pixel_quantization(
    mean: np.ndarray, std: np.ndarray, scale: np.ndarray, zero: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """The scale and zero point (one of each, or one per channel) with which QuantizeLinear of the
    pixels gives what QuantizeLinear(scale, zero) of (pixels - mean) / std gives, for all 256 pixel
    values, each clear of a rounding tie both ways; None where no such pair exists."""
    per_channel = mean.ndim == 4 and mean.shape[0] * mean.shape[2] * mean.shape[3] == 1  # (1, C, 1, 1)
    if scale.size != 1 or not per_channel or std.shape != mean.shape:
        return None
    info = np.iinfo(zero.dtype)
    step = float(scale)
    pixels = as_pixels(np.arange(256, dtype=np.uint8)).astype(np.float64)  # what every request feeds in
    means, stds = mean.reshape(-1).astype(np.float64), std.reshape(-1).astype(np.float64)
    new_scale = (stds * step).astype(np.float32)
    new_zero = int(zero) - np.rint(means / (stds * step)).astype(np.int64)

    def clear(values: np.ndarray) -> bool:
        return bool(np.all(np.abs(values - np.floor(values) - 0.5) >= _TIE_MARGIN))

    for m, s, pixel_scale, pixel_zero in zip(means, stds, new_scale, new_zero, strict=True):
        before, after = (pixels - m) / s / step, pixels / float(pixel_scale)
        same = np.array_equal(
            np.clip(np.rint(before) + int(zero), info.min, info.max),
            np.clip(np.rint(after) + pixel_zero, info.min, info.max),
        )
        if not (clear(before) and clear(after) and same and info.min <= pixel_zero <= info.max):
            return None
    if len(new_scale) == 1:  # per tensor, as the quantizer wrote it
        return new_scale.reshape(()), new_zero.astype(zero.dtype).reshape(())
    return new_scale, new_zero.astype(zero.dtype)


def qat_int8(model: nn.Module, example: torch.Tensor, fine_tune: Callable[[nn.Module], object], out: Path) -> None:
    """Quantization-aware training: fake-quantize `model` (pt2e, x86 int8 config), let `fine_tune`
    train it for a few epochs, convert to int8 and export as QDQ ONNX."""
    # heavy: torchao (~2 s beyond torch), only for the QAT variant
    from torch.fx.experimental.optimization import fuse
    from torchao.quantization.pt2e import allow_exported_model_train_eval, move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    # BatchNorm is folded into the convs once, up front, so QAT fine-tunes with frozen BN statistics
    # (usual for the last epochs of QAT). pt2e would otherwise simulate the folding in training and
    # undo it in convert_pt2e, which traces 96 pattern graphs: 12 s on 2 cores for any model.
    folded = fuse(model.eval())
    graph = torch.export.export(folded.train(), (example,), dynamic_shapes=({0: torch.export.Dim("batch")},)).module()
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config(is_qat=True))
    prepared = prepare_qat_pt2e(graph, quantizer)
    allow_exported_model_train_eval(prepared)  # so the shared training loop's .train()/.eval() work
    fine_tune(prepared)
    move_exported_model_to_eval(prepared)
    converted = convert_pt2e(prepared)
    for module in converted.modules():  # the graph is in eval form already; this is the flag the exporter checks
        module.training = False
    export_onnx(converted, example, out)
