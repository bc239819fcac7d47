"""Check 4: compress and export (tasks/ship/compress.py, tasks/ship/export.py) from a checkpoint trained
on the device, skipped with the wheel to carry where one of COMPRESS_NEEDS is missing."""

from __future__ import annotations

import importlib.util
import json
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch

from tasks.core.atomic import write_bytes, write_text
from tasks.core.config.data import SplitConfig
from tasks.core.config.ship import EXPORT_FORMATS, CompressConfig, ExportConfig
from tasks.core.config.train import TrainConfig
from tasks.data.formats import RawDataset, write_raw
from tasks.data.preprocess import load_split, preprocess
from tasks.data.stats import compute_stats
from tasks.tools.gpu_check.report import FAIL, PASS, SKIPPED, Check, describe
from tasks.tools.gpu_check.workload import (
    COMPRESS_MODEL,
    NUM_CLASSES,
    CheckOptions,
    pin,
    synthetic_images,
    train_config,
)
from tasks.train.checkpoints import checkpoint_bytes, checkpoint_metadata, cpu_state
from tasks.train.loop import build_training
from tasks.train.models import predict

# torch.onnx.export (dynamo) needs onnxscript; the compress stage needs ONNX Runtime and onnx, and
# torch-pruning for every variant (tasks/ship/prune.py imports it at its top). What compress and export
# import beyond the other checks must be named here (tests/tools/test_gpu_check.py keeps it so): a bare
# CUDA machine then gets a "carry its wheel" row, not a failed check.
COMPRESS_NEEDS = ("onnx", "onnxruntime", "onnxscript", "torch_pruning")
VARIANT_NEEDS = {"qat_int8": "torchao"}
FINE_TUNED = {"qat_int8", "pruned_l1", "pruned_ln"}  # variants that train on train.device (the GPU)


def _missing(modules: tuple[str, ...]) -> list[str]:
    return [name for name in modules if importlib.util.find_spec(name) is None]


def _skipped_because(missing: list[str]) -> str:
    names = ", ".join(missing)
    return f"skipped: {names} not installed (carry {'its wheel' if len(missing) == 1 else 'their wheels'})"


def _unavailable(variant: str) -> str | None:
    """The module `variant` needs beyond COMPRESS_NEEDS when it is not installed, else None."""
    needs = VARIANT_NEEDS.get(variant)
    return needs if needs and _missing((needs,)) else None


def compress_export_checks(options: CheckOptions) -> Iterator[Check]:
    variants = [variant for variant in options.variants if _unavailable(variant) is None]
    # what ships: static_int8 (the params.yaml default) when it is built, else the first variant, else fp32
    shipped = "static_int8" if "static_int8" in variants else (variants or ["fp32"])[0]
    missing = _missing(COMPRESS_NEEDS)
    if missing:
        why = _skipped_because(missing)
        yield from [Check("compress", COMPRESS_MODEL, SKIPPED, why), Check("export", shipped, SKIPPED, why)]
        return
    for variant in options.variants:
        needs = _unavailable(variant)
        if needs:
            yield Check("compress", variant, SKIPPED, _skipped_because([needs]))
    with tempfile.TemporaryDirectory(prefix="lockstep-gpu-check-") as tmp:
        work = Path(tmp)
        try:
            train_cfg = _checkpoint(options, work)
        except Exception as exc:
            yield Check("compress", COMPRESS_MODEL, FAIL, f"training the checkpoint: {describe(exc)}")
            yield Check("export", shipped, SKIPPED, "skipped: no checkpoint")
            return
        compressed = _compress(options, train_cfg, tuple(variants), work)
        yield compressed
        if compressed.status != PASS:
            yield Check("export", shipped, SKIPPED, "skipped: compress failed")
            return
        yield _export(options, shipped, work)


def _checkpoint(options: CheckOptions, work: Path) -> TrainConfig:
    """Synthetic raw data through the real stats and preprocess code, a checkpoint trained on the device
    as the train stage writes it, and the test accuracy the export's model card quotes.

    Layout under `work`: data/, preprocessed/, train/best.safetensors, evaluate/metrics.json.
    """
    sizes, split_cfg, device = options.sizes, SplitConfig(), torch.device(options.device)
    images, labels = synthetic_images(sizes.compress_images, options.seed)
    write_raw(RawDataset(images, labels, [str(i) for i in range(NUM_CLASSES)], "synthetic"), work / "data")
    stats = compute_stats(work / "data", split_cfg, options.seed, chunk_size=4096)
    preprocess(work / "data", stats, split_cfg, options.seed, work / "preprocessed")
    train, val, test = (load_split(work / "preprocessed", name) for name in ("train", "val", "test"))
    cfg = train_config(
        options, model=COMPRESS_MODEL, epochs=sizes.compress_epochs, batch_size=sizes.compress_batch, scheduler="cosine"
    )
    pin(options)
    training = build_training(cfg, options.seed, train, device)
    history = [training.epoch(epoch, val) for epoch in range(1, cfg.epochs + 1)]
    metadata = {
        **checkpoint_metadata(cfg, options.seed, train, world_size=1),
        "epoch": cfg.epochs,
        "val_accuracy": history[-1]["val_accuracy"],
    }
    write_bytes(work / "train" / "best.safetensors", checkpoint_bytes(cpu_state(training.model), metadata))
    predicted = predict(training.model, test.images, device, batch_size=256).argmax(1).numpy()
    metrics = {"accuracy": float((predicted == test.labels).mean()), "num_samples": len(test.labels)}
    write_text(work / "evaluate" / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    return cfg


def _compress(options: CheckOptions, train_cfg: TrainConfig, variants: tuple[str, ...], work: Path) -> Check:
    # heavy: tasks.ship.compress loads onnx and onnxruntime (~1 s), only when this check runs
    from tasks.ship.compress import compress

    cfg = CompressConfig(
        variants=variants,
        calibration_size=128,
        qat_epochs=1,
        finetune_epochs=1,
        latency_runs=20,
        latency_warmup=1,
    )
    pin(options)  # as the compress stage runs (tasks/runner.py)
    try:
        result = compress(
            cfg,
            train_cfg,
            options.seed,
            options.threads,
            work / "train" / "best.safetensors",
            work / "preprocessed",
            work / "compress",
        )
    except Exception as exc:
        return Check("compress", COMPRESS_MODEL, FAIL, describe(exc), {"variants": list(variants)})
    rows = {row.variant: asdict(row) for row in result.rows}
    shown = "; ".join(
        f"{r.variant} {r.size_ratio:.2f}x size, agreement {r.top1_agreement:.3f}" for r in result.rows[1:]
    )
    tuned = " and fine-tuned" if set(variants) & FINE_TUNED else ""
    detail = f"checkpoint trained{tuned} on {options.device}, measured in ONNX Runtime (CPU): {shown}"
    return Check("compress", COMPRESS_MODEL, PASS, detail, {"variants": rows})


def _export(options: CheckOptions, variant: str, work: Path) -> Check:
    # heavy: tasks.ship.export loads onnx and onnxruntime (~1 s), only when this check runs
    from tasks.ship.export import CardContext, export

    # The gates on a compressed model's quality are for real data; here they are opened, and the fp32
    # parity gates (every format of EXPORT_FORMATS vs eager) keep their defaults: those are about the code.
    cfg = ExportConfig(
        candidates=(variant,), formats=tuple(EXPORT_FORMATS), min_top1_agreement=0.0, max_accuracy_drop=1.0
    )
    pin(options)
    try:
        params = {"seed": options.seed, "export": cfg.model_dump()}
        card = CardContext(data_md5="synthetic (tasks/tools/gpu_check)", params=params)
        with warnings.catch_warnings():  # TorchScript is deprecated, and shipped on purpose (legacy consumers)
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.jit")
            result = export(
                cfg,
                options.threads,
                work / "train" / "best.safetensors",
                work / "preprocessed",
                work / "compress",
                work / "evaluate" / "metrics.json",
                work / "export",
                card,
            )
    except Exception as exc:
        return Check("export", variant, FAIL, describe(exc))
    numbers = {
        "fp32_accuracy": result.fp32_accuracy,
        "accuracy": result.accuracy,
        "gates": [{**asdict(gate), "passed": gate.passed} for gate in result.gates],
        "sha256": result.sha256,
    }
    detail = (
        f"{len(result.gates)} gates passed; {', '.join(result.sha256)} written; test accuracy fp32 "
        f"{result.fp32_accuracy:.3f}, {variant} {result.accuracy:.3f}"
    )
    return Check("export", variant, PASS, detail, numbers)
