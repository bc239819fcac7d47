"""Stage 6 — compress: smaller models from the best checkpoint, each one measured the same way.

Variants (`compress.variants`: by default only those `export.candidates` may ship; `all` for the
full table), all written as ONNX to `artifacts/compress/models/<name>.onnx`
beside the fp32 reference `fp32.onnx`. They are the registry tasks/core/config/ship.py
`COMPRESSION_VARIANTS` (what each is: the docs render its table); each registers its builder here,
`@BUILDERS.register(name)`, on the mechanisms of tasks/ship/quantize.py and tasks/ship/prune.py.

Every model is measured in ONNX Runtime on this machine with the run's fixed thread count: test
accuracy, top-1 agreement with fp32, file size, weight sparsity, and latency at batch 1 and 64
(median of `latency_runs` after `latency_warmup`, variants taking turns). The table goes to
`compression.csv`, `compression.md` and `metrics.json` (for `dvc metrics show`).
"""

from __future__ import annotations

import copy
import csv
import io
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tasks.core.atomic import atomic_dir
from tasks.core.config.ship import COMPRESSION_VARIANTS, CompressConfig
from tasks.core.config.train import TrainConfig
from tasks.core.registry import Implementations
from tasks.data.formats import NpyRows
from tasks.data.preprocess import load_split, take_rows
from tasks.ship import prune, quantize
from tasks.ship.onnx_model import as_pixels, export_onnx, label, median_latency_ms, predict, session, weight_counts
from tasks.train.auto import as_trained
from tasks.train.checkpoints import load_checkpoint
from tasks.train.loop import fine_tune

log = logging.getLogger(__name__)
LATENCY_BATCHES = (1, 64)


@dataclass(frozen=True)
class VariantReport:
    variant: str
    accuracy: float  # test split, in ONNX Runtime
    top1_agreement: float  # with the fp32 model's predictions, test split
    size_bytes: int
    size_ratio: float  # to fp32
    sparsity: float  # fraction of fp32's conv/linear weights that are zero or removed here
    latency_b1_ms: float
    latency_b64_ms: float
    speedup_b1: float  # fp32 latency / this latency
    speedup_b64: float


@dataclass(frozen=True)
class Build:
    """What a variant's builder gets: it writes `out` (ONNX) from `fp32` (the reference's file) or `model`
    (the best checkpoint's fp32 model, eval mode: deep-copy it before changing it)."""

    cfg: CompressConfig
    model: nn.Module
    example: torch.Tensor  # a batch of training images as model input (tracing, export)
    fp32: Path
    out: Path
    calibration: Callable[[], np.ndarray]  # a seeded subset of the training images (uint8), read when called
    tune: Callable[[int, float], Callable[[nn.Module], object]] = field(repr=False)  # (epochs, lr) -> fine-tune


# How each variant of COMPRESSION_VARIANTS is built, by name.
BUILDERS: Implementations[Callable[[Build], None]] = Implementations(COMPRESSION_VARIANTS)


@BUILDERS.register("dynamic_int8")
def _dynamic_int8(job: Build) -> None:
    quantize.dynamic_int8(job.fp32, job.out)


@BUILDERS.register("static_int8")
def _static_int8(job: Build) -> None:
    quantize.static_int8(job.fp32, job.out, job.calibration())


@BUILDERS.register("qat_int8")
def _qat_int8(job: Build) -> None:
    quantize.qat_int8(copy.deepcopy(job.model), job.example, job.tune(job.cfg.qat_epochs, job.cfg.qat_lr), job.out)


@BUILDERS.register("pruned_l1")
def _pruned_l1(job: Build) -> None:
    _pruned(job, lambda model: prune.global_l1(model, job.cfg.prune_amount))


@BUILDERS.register("pruned_ln")
def _pruned_ln(job: Build) -> None:
    _pruned(job, lambda model: prune.conv_channels_ln(model, job.cfg.prune_channels, job.cfg.prune_norm, job.example))


def _pruned(job: Build, prune_it: Callable[[nn.Module], None]) -> None:
    """A pruned copy of the model, fine-tuned (`finetune_epochs`), made permanent, exported."""
    pruned = copy.deepcopy(job.model)
    prune_it(pruned)
    if job.cfg.finetune_epochs:
        job.tune(job.cfg.finetune_epochs, job.cfg.finetune_lr)(pruned)
    prune.make_permanent(pruned)
    export_onnx(pruned.eval(), job.example, job.out)


@dataclass(frozen=True)
class CompressResult:
    rows: list[VariantReport]  # fp32 first, then compress.variants in order
    threads: int
    history: dict[str, list[dict]]  # fine-tuning curves of the variants that fine-tune


def compress(
    cfg: CompressConfig, train_cfg: TrainConfig, seed: int, threads: int, checkpoint: Path, pre_dir: Path, out_dir: Path
) -> CompressResult:
    """Build `cfg.variants` from `checkpoint`, measure them with fp32, write everything to `out_dir`.

    `out_dir` is replaced in one step at the end: a failure leaves the previous one as it was.
    """
    if isinstance(cfg.variants, str):  # "auto" is resolved against export.candidates by Params
        raise ValueError("compress.variants: auto needs export.candidates: pass params.compress, or for_candidates()")
    train, test = load_split(pre_dir, "train", stream=True), load_split(pre_dir, "test", stream=True)
    model, metadata = load_checkpoint(checkpoint, test)
    model.eval()
    train_cfg = as_trained(train_cfg, metadata.get("config", {}))  # fine-tuning continues what train chose
    example = torch.from_numpy(as_pixels(take_rows(train.images, np.arange(min(64, len(train.labels))))))
    history: dict[str, list[dict]] = {}

    def tuner(name: str) -> Callable[[int, float], Callable[[nn.Module], object]]:
        def tune(epochs: int, lr: float) -> Callable[[nn.Module], object]:
            def run(module: nn.Module) -> None:
                history[name] = fine_tune(module, train_cfg, seed, pre_dir, epochs, lr)
                module.to("cpu").eval()  # fine-tuned on train.device; exported and measured for the CPU

            return run

        return tune

    def calibration() -> np.ndarray:
        return take_rows(train.images, calibration_indices(len(train.labels), cfg, seed))

    with atomic_dir(out_dir) as staging:
        models = staging / "models"
        models.mkdir()
        fp32 = models / "fp32.onnx"
        export_onnx(model, example, fp32)
        for name in cfg.variants:
            path, started = models / f"{name}.onnx", time.perf_counter()
            BUILDERS[name](Build(cfg, model, example, fp32, path, calibration, tuner(name)))
            log.info("%s: built in %.1f s", name, time.perf_counter() - started)
        names = ["fp32", *cfg.variants]
        for name in names:  # what a model file alone must say to predict with (tasks/tools/predict.py)
            label(models / f"{name}.onnx", test.classes)
        rows = _measure({name: models / f"{name}.onnx" for name in names}, test.images, test.labels, cfg, threads)
        result = CompressResult(rows=rows, threads=threads, history=history)
        _write_reports(result, staging)
    return result


def calibration_indices(n: int, cfg: CompressConfig, seed: int) -> np.ndarray:
    """A seeded, sorted subset of the training split (sorted: reads in file order)."""
    size = min(cfg.calibration_size, n)
    return np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False))


def latency_batch(images: np.ndarray | NpyRows, size: int) -> np.ndarray:
    """`size` test images as model input, repeating them when there are fewer (tiny test configs)."""
    first = take_rows(images, np.arange(min(size, images.shape[0])))
    return as_pixels(np.resize(first, (size, *images.shape[1:])))


def _measure(
    paths: dict[str, Path], images: np.ndarray | NpyRows, labels: np.ndarray, cfg: CompressConfig, threads: int
) -> list[VariantReport]:
    sessions = {name: session(path, threads) for name, path in paths.items()}
    predicted = {name: predict(sess, images).argmax(1) for name, sess in sessions.items()}
    latency = {
        size: median_latency_ms(sessions, latency_batch(images, size), cfg.latency_runs, cfg.latency_warmup)
        for size in LATENCY_BATCHES
    }
    base_size, base_weights = paths["fp32"].stat().st_size, weight_counts(paths["fp32"])[1]
    rows = []
    for name, path in paths.items():
        b1, b64 = latency[1][name], latency[64][name]
        rows.append(
            VariantReport(
                variant=name,
                accuracy=float((predicted[name] == labels).mean()) if len(labels) else float("nan"),
                top1_agreement=float((predicted[name] == predicted["fp32"]).mean()) if len(labels) else float("nan"),
                size_bytes=path.stat().st_size,
                size_ratio=path.stat().st_size / base_size,
                sparsity=1.0 - weight_counts(path)[0] / base_weights,
                latency_b1_ms=b1,
                latency_b64_ms=b64,
                speedup_b1=latency[1]["fp32"] / b1,
                speedup_b64=latency[64]["fp32"] / b64,
            )
        )
    return rows


def markdown_table(rows: list[VariantReport]) -> str:
    """The compression table as Markdown (the README, the model card and the MLflow run show it)."""
    lines = [
        "| variant | test accuracy | top-1 agreement | size KiB | size ratio | sparsity | latency b1 ms "
        "| latency b64 ms | speed-up b64 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.variant} | {r.accuracy:.4f} | {r.top1_agreement:.4f} | {r.size_bytes / 1024:.1f} "
            f"| {r.size_ratio:.3f} | {r.sparsity:.3f} | {r.latency_b1_ms:.3f} | {r.latency_b64_ms:.3f} "
            f"| {r.speedup_b64:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def _write_reports(result: CompressResult, out_dir: Path) -> None:
    rows = [asdict(r) for r in result.rows]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    (out_dir / "compression.csv").write_text(buffer.getvalue())
    header = f"Measured with ONNX Runtime on CPU, {result.threads} thread(s); latency: median per run.\n"
    left_out = [name for name in COMPRESSION_VARIANTS if name not in {r.variant for r in result.rows}]
    if left_out:  # the default builds only what may ship: say what one switch adds to this table
        header += f"Not built: {', '.join(left_out)} (`compress.variants: all` builds every variant).\n"
    header += "\n"
    (out_dir / "compression.md").write_text(header + markdown_table(result.rows))
    metrics = {r["variant"]: {k: v for k, v in r.items() if k != "variant"} for r in rows}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (out_dir / "finetune.json").write_text(json.dumps(result.history, indent=2) + "\n")
