"""Stage 7 — export: the files that ship, after they pass their gates.

Outputs (`artifacts/export/`):

- `model_fp32.onnx`, and `model.onnx`: the first of `export.candidates` that passes its gates (a
  copy of the fp32 file when that is fp32); dynamic batch axis, weights inside, the very files the
  compression table measured;
- `torch/`: the fp32 model in the other `export.formats`: `model.pt2` (`torch.export`, the current
  PyTorch format) and, only when asked, `model.torchscript.pt` (TorchScript is deprecated in torch;
  kept for consumers that still load it). The formats are the registry tasks/core/config/ship.py
  `EXPORT_FORMATS` (each one's file and gate label); each registers how it is written and read back
  in tasks/ship/formats.py;
- `gates.json` (for `dvc metrics show`; its flat `shipped` section: the shipped model's accuracy, and
  its size and latency as compress measured them) and `model_card.md`.

Gates, all computed before anything is written:

- fp32 parity: on the first `parity_batch` test images, the logits of the fp32 ONNX model and of
  each torch format are within `max_abs_diff` of the eager model's. A failure here is a bug in the
  export path, never a property of the data, or a diverged model whose logits are so large that
  rounding alone exceeds the bound (the message says which): the stage fails.
- each candidate, over the test split, against fp32: top-1 agreement on the images fp32 is
  confident about (top softmax probability >= `confidence`) >= `min_top1_agreement`, and fp32
  accuracy minus its accuracy <= `max_accuracy_drop`. fp32 itself has no such gates.

The candidates are tried in order and the first that passes ships: a weak int8 copy does not take
the whole run down, and the reason it was passed over stays in `gates.json`, the card and the run.
When no candidate passes, or a parity gate fails, `GateError` names each measured and allowed
value and `out_dir` is left as it was. Registering the model (MLflow) is the stage wrapper's next
step, so nothing failing is registered.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.core.atomic import atomic_dir
from tasks.core.config.ship import EXPORT_FORMATS, FP32, SHIPPED, ExportConfig
from tasks.core.config.train import RECIPE_KEYS, TrainConfig
from tasks.core.errors import Refused
from tasks.core.hashing import file_digest
from tasks.core.redact import redact, redact_tree
from tasks.data.preprocess import Preprocessed, load_split, take_rows
from tasks.ship.formats import WRITERS
from tasks.ship.onnx_model import as_pixels, predict, session
from tasks.train.checkpoints import load_checkpoint

TORCH_DIR = "torch"  # the fp32 model in the torch formats of export.formats
CARD, GATES = "model_card.md", "gates.json"


class GateError(Refused):
    """A shipped model failed a gate: it does not ship (one line, exit code 3)."""


@dataclass(frozen=True)
class Gate:
    name: str
    measured: float
    allowed: float
    at_most: bool  # True: measured <= allowed passes; False: measured >= allowed passes
    candidate: str = ""  # the candidate this gate judges ("": an fp32 parity gate)

    @property
    def passed(self) -> bool:
        return self.measured <= self.allowed if self.at_most else self.measured >= self.allowed

    def describe(self) -> str:
        relation = ("<=" if self.passed else ">") if self.at_most else (">=" if self.passed else "<")
        return f"{self.name} {self.measured:.6g} {relation} allowed {self.allowed:.6g}"


@dataclass(frozen=True)
class CardContext:
    """What the model card records beyond the stage's own results."""

    data_md5: str
    params: dict[str, Any]
    lineage: dict[str, str] = field(default_factory=dict)
    machine: dict[str, str] = field(default_factory=dict)  # the exporting machine's hardware fingerprint
    # what `auto` chose from the data, and why (train.json's "recipe": {key: {"value", "reason"}})
    auto: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class ExportResult:
    variant: str  # what ships as model.onnx: the first of export.candidates that passed
    fp32_accuracy: float  # test split, fp32 ONNX in ONNX Runtime
    accuracy: float  # test split, the shipped model.onnx in ONNX Runtime
    gates: list[Gate]  # parity gates, then each tried candidate's own
    sha256: dict[str, str]  # exported file (relative to out_dir) -> digest
    input_shape: tuple[int, int, int]  # (C, H, W) of one image; the batch axis is dynamic
    num_classes: int
    fallback_reason: str = ""  # why the first candidate did not ship ("" when it did)


@dataclass(frozen=True)
class _Judged:
    """One candidate measured against fp32 on the test split."""

    variant: str
    accuracy: float
    gates: list[Gate]

    @property
    def passed(self) -> bool:
        return all(gate.passed for gate in self.gates)


def export(
    cfg: ExportConfig,
    threads: int,
    checkpoint: Path,
    pre_dir: Path,
    compress_dir: Path,
    evaluate_metrics: Path,
    out_dir: Path,
    card: CardContext,
) -> ExportResult:
    """Write the shipped files to `out_dir` if fp32 parity holds and a candidate passes; raise GateError otherwise."""
    test = load_split(pre_dir, "test", stream=True)  # read a block at a time: the split may outgrow memory
    model, meta = load_checkpoint(checkpoint, test)
    model.eval()
    parity_images = take_rows(test.images, np.arange(min(cfg.parity_batch, len(test.labels))))
    parity = torch.from_numpy(as_pixels(parity_images))
    with torch.no_grad():
        eager = model(parity).numpy()

    with atomic_dir(out_dir) as staging:
        shutil.copyfile(compress_dir / "models" / "fp32.onnx", staging / FP32)
        _save_torch_programs(model, parity, staging, cfg.formats)
        gates = _parity_gates(cfg, threads, staging, parity_images, parity, eager)
        if failed := [gate for gate in gates if not gate.passed]:
            raise GateError(_parity_failure(failed, eager))
        fp32_logits = predict(session(staging / FP32, threads), test.images)
        tried = _try_candidates(cfg, threads, compress_dir, test, fp32_logits)
        shipped = tried[-1]
        gates += [gate for judged in tried for gate in judged.gates]
        if not shipped.passed:
            raise GateError("no export candidate passed its gates: " + "; ".join(_failures(tried)))
        shutil.copyfile(_candidate_file(compress_dir, staging, shipped.variant), staging / SHIPPED)
        reason = f"{'; '.join(_failures(tried[:-1]))}: {shipped.variant} shipped instead" if len(tried) > 1 else ""

        files = [SHIPPED, FP32, *(EXPORT_FORMATS[name].file for name in cfg.formats if name in WRITERS)]
        result = ExportResult(
            variant=shipped.variant,
            fallback_reason=reason,
            fp32_accuracy=_accuracy(fp32_logits, test.labels),
            accuracy=shipped.accuracy,
            gates=gates,
            sha256={name: file_digest(staging / name) for name in files},
            input_shape=tuple(test.images.shape[1:]),
            num_classes=len(test.classes),
        )
        _write_reports(result, cfg, meta, evaluate_metrics, compress_dir, staging, card)
    return result


def _write_reports(
    result: ExportResult,
    cfg: ExportConfig,
    meta: dict[str, Any],
    evaluate_metrics: Path,
    compress_dir: Path,
    staging: Path,
    card: CardContext,
) -> None:
    gate_report = {
        "variant": result.variant,
        "requested_variant": cfg.candidates[0],
        "candidates": list(cfg.candidates),
        "fallback_reason": result.fallback_reason,
        "fp32_accuracy": result.fp32_accuracy,
        "accuracy": result.accuracy,
        "gates": [{**asdict(g), "passed": g.passed} for g in result.gates],
        "shipped": _shipped(result, compress_dir),
    }
    (staging / GATES).write_text(json.dumps(gate_report, indent=2) + "\n")
    evaluated = json.loads(evaluate_metrics.read_text())
    table = (compress_dir / "compression.md").read_text()
    # the card ships with the model (and to DVC remotes): every secret masked
    (staging / CARD).write_text(redact(_model_card(result, meta, evaluated, table, card)))


def _shipped(result: ExportResult, compress_dir: Path) -> dict[str, float]:
    """The headline numbers of what ships, flat: `dvc exp show` gives each experiment one column per
    number, whichever variant shipped (compress's metrics.json has a column per variant instead)."""
    measured = json.loads((compress_dir / "metrics.json").read_text())[result.variant]
    keys = ("size_bytes", "latency_b1_ms", "latency_b64_ms")
    return {"accuracy": result.accuracy, **{key: measured[key] for key in keys}}


def _failures(tried: list[_Judged]) -> list[str]:
    return [
        f"{judged.variant} failed its gates ({'; '.join(g.describe() for g in judged.gates if not g.passed)})"
        for judged in tried
        if not judged.passed
    ]


def _accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float((logits.argmax(1) == labels).mean())


def _candidate_file(compress_dir: Path, staging: Path, variant: str) -> Path:
    return staging / FP32 if variant == "fp32" else compress_dir / "models" / f"{variant}.onnx"


def _try_candidates(
    cfg: ExportConfig, threads: int, compress_dir: Path, test: Preprocessed, fp32_logits: np.ndarray
) -> list[_Judged]:
    """The candidates in order, up to and including the first that passes (or all of them)."""
    fp32_pred = fp32_logits.argmax(1)
    shifted = fp32_logits - fp32_logits.max(1, keepdims=True)  # softmax without overflow
    confidence = np.exp(shifted).max(1) / np.exp(shifted).sum(1)
    confident = confidence >= cfg.confidence
    fp32_acc = _accuracy(fp32_logits, test.labels)
    tried: list[_Judged] = []
    for variant in cfg.candidates:
        if variant == "fp32":  # the reference: its parity gates already passed
            tried.append(_Judged(variant, fp32_acc, []))
            break
        pred = predict(session(compress_dir / "models" / f"{variant}.onnx", threads), test.images).argmax(1)
        # Where fp32 is unsure, a quantized copy flips predictions either way (the accuracy gate
        # bounds the net effect); where fp32 is confident, a flip is a defect of the copy.
        agreement = float((pred[confident] == fp32_pred[confident]).mean()) if confident.any() else 1.0
        acc = float((pred == test.labels).mean())
        where = f"on the {int(confident.sum())} test images fp32 gives p >= {cfg.confidence:g}"
        gates = [
            Gate(f"{variant} top-1 agreement with fp32 {where}", agreement, cfg.min_top1_agreement, False, variant),
            Gate(f"{variant} accuracy drop from fp32", fp32_acc - acc, cfg.max_accuracy_drop, True, variant),
        ]
        tried.append(_Judged(variant, acc, gates))
        if tried[-1].passed:
            break
    return tried


def _bytes_note(mode: str) -> str:
    where = "the same on any x86-64 CPU with AVX2" if mode == "portable" else "other bytes on another CPU"
    return (
        f"The machine this pipeline run exported on (the train run's own is on its MLflow run, hw.* tags). "
        f"Weight bytes depend on these (determinism.cpu: {mode}, {where})."
    )


def _save_torch_programs(model: torch.nn.Module, parity: torch.Tensor, staging: Path, formats: tuple[str, ...]) -> None:
    """The fp32 model in the formats asked for that have a writer (all but onnx), in registry order."""
    (staging / TORCH_DIR).mkdir()
    for name, writer in WRITERS.items():
        if name in formats:
            path = staging / EXPORT_FORMATS[name].file
            path.parent.mkdir(parents=True, exist_ok=True)
            writer.save(model, parity, path)


def _parity_gates(
    cfg: ExportConfig, threads: int, staging: Path, images: np.ndarray, parity: torch.Tensor, eager: np.ndarray
) -> list[Gate]:
    """fp32 ONNX and each torch format, reloaded from the files as written, against the eager model on
    the parity batch (`images`, uint8; `parity`, the same as model input)."""
    reloaded = {EXPORT_FORMATS["onnx"].label: predict(session(staging / FP32, threads), images)}
    for name, writer in WRITERS.items():
        if name in cfg.formats:
            reloaded[EXPORT_FORMATS[name].label] = _run_torch(writer.load(staging / EXPORT_FORMATS[name].file), parity)
    return [
        Gate(f"{name} vs eager max |logit diff|", float(np.abs(out - eager).max()), cfg.max_abs_diff, True)
        for name, out in reloaded.items()
    ]


# Where the files differ from the eager logits by at most this fraction of the largest logit, float32's
# rounding explains the difference (an export bug gives differences of the logits' own size) ...
_ROUNDING = 1e-3
# ... and logits this large are the model's fault: a trained classifier's stay within tens (its softmax is
# saturated long before), while float32's rounding alone exceeds the default bound from about a hundred
_HUGE_LOGIT = 1e3


def _parity_failure(failed: list[Gate], eager: np.ndarray) -> str:
    """GateError's message for failed parity gates. float32 rounds relative to a value's size, so where
    the trained model's logits are huge (a diverged or unstable model) the files differ from them by more
    than max_abs_diff through rounding alone: then the message says that the model, not the export, is
    what is wrong, rather than leave the export blamed."""
    message = f"{len(failed)} export parity gate(s) failed: " + "; ".join(g.describe() for g in failed)
    largest = float(np.abs(eager).max()) if eager.size else 0.0
    if not np.isfinite(largest):
        return message + "; the trained model's own logits are not finite (it diverged): lower train.lr"
    worst = max(gate.measured for gate in failed)
    if largest >= _HUGE_LOGIT and worst <= _ROUNDING * largest:
        return message + (
            f"; the trained model's own logits reach {largest:.3g}, and relative to them the files agree "
            f"(within {worst / largest:.2g}): float32 rounding at that size, not an export fault. Logits that "
            "large mean training diverged or is unstable: lower train.lr or add warm-up (train.warmup_epochs), "
            "and see the evaluate stage's loss"
        )
    return message


@torch.no_grad()
def _run_torch(module: torch.nn.Module, pixels: torch.Tensor) -> np.ndarray:
    return module(pixels).numpy()


def _recipe_lines(config: dict[str, Any]) -> list[str]:
    """How the weights were trained, from the checkpoint's own config: the basics, and the recipe options
    the run set (a checkpoint records only those: tasks/train/checkpoints.py)."""
    basics = ("model", "epochs", "batch_size", "optimizer", "lr", "scheduler", "label_smoothing", "amp")
    lines = [f"- {key}: `{config[key]}`" for key in basics if key in config]
    changed = [key for key in RECIPE_KEYS if key in config]
    lines += [f"- {key}: `{config[key]}`" for key in changed]
    if len(changed) < len(RECIPE_KEYS):
        defaults = ", ".join(
            f"{key} `{TrainConfig.model_fields[key].default}`" for key in RECIPE_KEYS if key not in changed
        )
        lines.append(f"- at their defaults: {defaults}")
    return lines


def _kept_epoch_line(meta: dict[str, Any]) -> str:
    """Which epoch's weights these are: the best by validation, or the last (`train.keep`)."""
    scored = f"validation accuracy {meta['val_accuracy']:.4f}"
    if meta.get("config", {}).get("keep") == "last":
        return f"- kept epoch: {meta['epoch']}, the last (train.keep: last), {scored}"
    return f"- best epoch: {meta['epoch']}, {scored}"


def _model_card(
    result: ExportResult, meta: dict[str, Any], evaluated: dict[str, float | int], table: str, card: CardContext
) -> str:
    params = json.dumps(redact_tree(card.params), indent=2, sort_keys=True)
    beside = ", ".join(f"`{name}`" for name in result.sha256 if name != SHIPPED)
    lines = [
        f"# Model card: {meta['model']} on {len(meta['classes'])} classes",
        "",
        f"Shipped: `{SHIPPED}` ({result.variant}), beside {beside} (fp32).",
        *([f"**Fallback:** {result.fallback_reason}."] if result.fallback_reason else []),
        "Input: float32 pixels in [0, 1], shape (N, C, H, W), named `pixels`; output: `logits`. "
        "Normalisation is inside the model.",
        "",
        "## Provenance",
        "",
        f"- data (DVC md5 of `data/`): `{card.data_md5}`",
        f"- seed: {meta['seed']} (training), {card.params.get('seed')} (pipeline)",
        _kept_epoch_line(meta),
        f"- classes: {', '.join(map(str, meta['classes']))}",
        *(f"- {key}: `{value}`" for key, value in sorted(card.lineage.items())),
        "",
        "## Training recipe",
        "",
        *_recipe_lines(meta.get("config", {})),
        *(f"- {key} (auto, from the data): `{auto['value']}`: {auto['reason']}" for key, auto in card.auto.items()),
        "",
        "## Machine",
        "",
        _bytes_note(card.machine.get("hw.cpu.mode", "native")),
        "",
        *(f"- {key.removeprefix('hw.')}: `{value}`" for key, value in sorted(card.machine.items())),
        "",
        "## Metrics (test split)",
        "",
        "| metric | value |",
        "| --- | ---: |",
        *(f"| evaluate {k} | {v if isinstance(v, int) else f'{v:.4f}'} |" for k, v in evaluated.items()),
        f"| fp32 ONNX accuracy | {result.fp32_accuracy:.4f} |",
        f"| shipped ({result.variant}) ONNX accuracy | {result.accuracy:.4f} |",
        "",
        "## Gates",
        "",
        *(f"- {'pass' if g.passed else 'FAIL'}: {g.describe()}" for g in result.gates),
        "",
        "## Compression",
        "",
        table.strip(),
        "",
        "## Files (sha256)",
        "",
        *(f"- `{name}`: `{digest}`" for name, digest in result.sha256.items()),
        "",
        "## Parameters",
        "",
        "```json",
        params,
        "```",
        "",
    ]
    return "\n".join(lines)
