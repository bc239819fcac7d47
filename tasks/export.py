"""Stage 7 — export: the files that ship, after they pass their gates.

Outputs (`artifacts/export/`):

- `model_fp32.onnx` and `model.onnx` (the `export.variant` chosen from the compress stage; a copy of
  the fp32 file when the variant is `fp32`): dynamic batch axis, weights inside, the very files the
  compression table measured;
- `model.pt2` (`torch.export`, the current PyTorch format) and `model.torchscript.pt` (for legacy
  consumers), both fp32;
- `gates.json` (for `dvc metrics show`) and `model_card.md`.

Gates, all computed before anything is written:

- fp32 parity: on the first `parity_batch` test images, the logits of the fp32 ONNX, .pt2 and
  TorchScript models are within `max_abs_diff` of the eager model's;
- the shipped variant, over the test split: top-1 agreement with fp32 >= `min_top1_agreement`, and
  fp32 accuracy minus its accuracy <= `max_accuracy_drop`.

When the variant fails its own gates and `fallback` is `fp32`, the fp32 model ships as `model.onnx`
instead (the variant's failed gates and the reason stay in `gates.json`, the card and the run): a
weak int8 copy does not take the whole run down. A failed parity gate, or a failed variant with
`fallback: none`, raises `GateError` with each measured and allowed value, and `out_dir` is left as
it was. Registering the model (MLflow) is the stage wrapper's next step, so nothing failing is
registered.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.atomic import atomic_dir
from tasks.checkpoints import load_checkpoint
from tasks.config import ExportConfig
from tasks.errors import ExpectedFailure
from tasks.hashing import file_digest
from tasks.onnx_model import as_pixels, predict, session
from tasks.preprocess import Preprocessed, load_split
from tasks.redact import redact, redact_tree

SHIPPED, FP32 = "model.onnx", "model_fp32.onnx"
PT2, TORCHSCRIPT = "model.pt2", "model.torchscript.pt"
CARD, GATES = "model_card.md", "gates.json"


class GateError(ExpectedFailure):
    """A shipped model failed a gate (an expected failure: one line, exit code 1)."""


@dataclass(frozen=True)
class Gate:
    name: str
    measured: float
    allowed: float
    at_most: bool  # True: measured <= allowed passes; False: measured >= allowed passes

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


@dataclass(frozen=True)
class ExportResult:
    variant: str  # what ships as model.onnx: export.variant, or fp32 after a fallback
    fp32_accuracy: float  # test split, fp32 ONNX in ONNX Runtime
    accuracy: float  # test split, the shipped model.onnx in ONNX Runtime
    gates: list[Gate]
    sha256: dict[str, str]  # exported file name -> digest
    input_shape: tuple[int, int, int]  # (C, H, W) of one image; the batch axis is dynamic
    num_classes: int
    fallback_reason: str = ""  # why export.variant did not ship ("" when it did)


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
    """Write the shipped files to `out_dir` if every gate passes; raise GateError otherwise."""
    test = load_split(pre_dir, "test")
    model, meta = load_checkpoint(checkpoint, test)
    model.eval()
    parity = torch.from_numpy(as_pixels(test.images[: cfg.parity_batch]))
    with torch.no_grad():
        eager = model(parity).numpy()

    with atomic_dir(out_dir) as staging:
        shutil.copyfile(compress_dir / "models" / "fp32.onnx", staging / FP32)
        shutil.copyfile(compress_dir / "models" / f"{cfg.variant}.onnx", staging / SHIPPED)
        _save_torch_programs(model, parity, staging)
        gates, fp32_acc, acc = _gates(cfg, threads, staging, test, parity, eager)
        variant, reason = _fall_back(cfg, gates, staging)
        failed = [gate for gate in gates if not gate.passed]
        if failed and not reason:
            raise GateError(f"{len(failed)} export gate(s) failed: " + "; ".join(g.describe() for g in failed))
        acc = fp32_acc if reason else acc

        digests = {name: file_digest(staging / name) for name in (SHIPPED, FP32, PT2, TORCHSCRIPT)}
        result = ExportResult(
            variant=variant,
            fallback_reason=reason,
            fp32_accuracy=fp32_acc,
            accuracy=acc,
            gates=gates,
            sha256=digests,
            input_shape=tuple(test.images.shape[1:]),
            num_classes=len(test.classes),
        )
        gate_report = {
            "variant": variant,
            "requested_variant": cfg.variant,
            "fallback_reason": reason,
            "fp32_accuracy": fp32_acc,
            "accuracy": acc,
            "gates": [{**asdict(g), "passed": g.passed} for g in gates],
        }
        (staging / GATES).write_text(json.dumps(gate_report, indent=2) + "\n")
        evaluated = json.loads(evaluate_metrics.read_text())
        table = (compress_dir / "compression.md").read_text()
        # the card ships with the model (and to DVC remotes): every secret masked
        (staging / CARD).write_text(redact(_model_card(result, meta, evaluated, table, card)))
    return result


def _bytes_note(mode: str) -> str:
    where = "the same on any x86-64 CPU with AVX2" if mode == "portable" else "other bytes on another CPU"
    return (
        f"The machine this pipeline run exported on (the train run's own is on its MLflow run, hw.* tags). "
        f"Weight bytes depend on these (determinism.cpu: {mode}, {where})."
    )


def _fall_back(cfg: ExportConfig, gates: list[Gate], staging: Path) -> tuple[str, str]:
    """(what ships, why not export.variant): fp32 in place of a variant that failed only its own gates."""
    failed = [gate for gate in gates if not gate.passed]
    own = [gate for gate in failed if gate.name.startswith(f"{cfg.variant} ")]
    if not failed or cfg.fallback == "none" or cfg.variant == "fp32" or len(own) != len(failed):
        return cfg.variant, ""
    shutil.copyfile(staging / FP32, staging / SHIPPED)
    return "fp32", f"{cfg.variant} failed its gates ({'; '.join(g.describe() for g in own)}): fp32 shipped instead"


def _save_torch_programs(model: torch.nn.Module, parity: torch.Tensor, staging: Path) -> None:
    """The fp32 model as a torch.export program (.pt2) and as TorchScript."""
    program = torch.export.export(model, (parity,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    for node in program.graph.nodes:  # stack traces name this checkout's paths: bytes would depend on it
        node.meta.pop("stack_trace", None)
    torch.export.save(program, staging / PT2)
    with torch.no_grad():
        # Not byte-reproducible: TorchScript archives carry a random serialization id and pickled
        # debug info. It is for legacy consumers; the ONNX and .pt2 files are reproducible.
        torch.jit.save(torch.jit.trace(model, parity), staging / TORCHSCRIPT)


def _gates(
    cfg: ExportConfig, threads: int, staging: Path, test: Preprocessed, parity: torch.Tensor, eager: np.ndarray
) -> tuple[list[Gate], float, float]:
    """Every gate, measured on the files as written; with the fp32 and shipped test accuracies."""
    fp32_sess, shipped_sess = session(staging / FP32, threads), session(staging / SHIPPED, threads)
    reloaded = {
        "fp32 ONNX": predict(fp32_sess, test.images[: cfg.parity_batch]),
        ".pt2": _run_torch(torch.export.load(staging / PT2).module(), parity),
        "TorchScript": _run_torch(torch.jit.load(staging / TORCHSCRIPT), parity),
    }
    gates = [
        Gate(f"{name} vs eager max |logit diff|", float(np.abs(out - eager).max()), cfg.max_abs_diff, True)
        for name, out in reloaded.items()
    ]
    fp32_pred = predict(fp32_sess, test.images).argmax(1)
    shipped_pred = predict(shipped_sess, test.images).argmax(1)
    fp32_acc, acc = float((fp32_pred == test.labels).mean()), float((shipped_pred == test.labels).mean())
    if cfg.variant != "fp32":
        agreement = float((shipped_pred == fp32_pred).mean())
        gates += [
            Gate(f"{cfg.variant} top-1 agreement with fp32", agreement, cfg.min_top1_agreement, False),
            Gate(f"{cfg.variant} accuracy drop from fp32", fp32_acc - acc, cfg.max_accuracy_drop, True),
        ]
    return gates, fp32_acc, acc


@torch.no_grad()
def _run_torch(module: torch.nn.Module, pixels: torch.Tensor) -> np.ndarray:
    return module(pixels).numpy()


def _model_card(
    result: ExportResult, meta: dict[str, Any], evaluated: dict[str, float], table: str, card: CardContext
) -> str:
    params = json.dumps(redact_tree(card.params), indent=2, sort_keys=True)
    lines = [
        f"# Model card: {meta['model']} on {len(meta['classes'])} classes",
        "",
        f"Shipped: `{SHIPPED}` ({result.variant}), beside `{FP32}`, `{PT2}` and `{TORCHSCRIPT}` (fp32).",
        *([f"**Fallback:** {result.fallback_reason}."] if result.fallback_reason else []),
        "Input: float32 pixels in [0, 1], shape (N, C, H, W), named `pixels`; output: `logits`. "
        "Normalisation is inside the model.",
        "",
        "## Provenance",
        "",
        f"- data (DVC md5 of `data/`): `{card.data_md5}`",
        f"- seed: {meta['seed']} (training), {card.params.get('seed')} (pipeline)",
        f"- best epoch: {meta['epoch']}, validation accuracy {meta['val_accuracy']:.4f}",
        f"- classes: {', '.join(map(str, meta['classes']))}",
        *(f"- {key}: `{value}`" for key, value in sorted(card.lineage.items())),
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
        *(f"| evaluate {k} | {v:.4f} |" for k, v in evaluated.items()),
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
