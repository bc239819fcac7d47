"""Checks 1 and 2: every model x optimiser steps in strict mode, and the same training twice gives the
same weight bytes, per precision, and with the training recipe's options on."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tasks.core.config.train import TrainConfig
from tasks.data.preprocess import Preprocessed
from tasks.tools.gpu_check.report import FAIL, NA, PASS, Check, describe
from tasks.tools.gpu_check.workload import (
    COMPRESS_MODEL,
    MODELS,
    CheckOptions,
    choices,
    digest,
    synthetic_split,
    train_config,
    trained,
)
from tasks.train.checkpoints import cpu_state

# --- 1. strict mode: every model x optimiser -----------------------------------------------------


def strict_checks(options: CheckOptions) -> Iterator[Check]:
    sizes = options.sizes
    split = synthetic_split(sizes.batch_size, options.seed)
    for model in options.models or MODELS:
        for optimizer in choices("optimizer"):
            cfg = train_config(options, model=model, optimizer=optimizer, batch_size=sizes.batch_size, max_batches=1)
            numbers = {"model": model, "optimizer": optimizer, "batch_size": sizes.batch_size, "steps": 1}
            try:
                trained(options, cfg, split)
            except Exception as exc:  # reported as a row: the other models and optimisers still run
                yield Check("strict", f"{model}/{optimizer}", FAIL, describe(exc), numbers)
                continue
            detail = f"1 step, batch {sizes.batch_size}, use_deterministic_algorithms(True): no op refused"
            yield Check("strict", f"{model}/{optimizer}", PASS, detail, numbers)


# --- 2. determinism: same weights twice, per precision -------------------------------------------

PRECISIONS = {"fp32": "none", "bf16": "bf16", "fp16": "fp16"}  # row label -> train.amp
# Every recipe option that draws or keeps state (tasks/train/recipe.py, augment.py, batches.py): on the
# GPU mixup/cutmix, clipping and the EMA run on the device, where strict mode must find deterministic kernels.
RECIPE = {
    "accumulate_steps": 2,
    "grad_clip_norm": 1.0,
    "warmup_steps": 4,
    "ema_decay": 0.9,
    "class_balance": "sampler",
    "augment": "trivialaugment",
    "mixup_alpha": 0.2,
    "cutmix_alpha": 1.0,
    "hflip": True,
}


def determinism_checks(options: CheckOptions) -> Iterator[Check]:
    sizes = options.sizes
    on_cuda = torch.device(options.device).type == "cuda"
    models = options.models or (MODELS if on_cuda else (COMPRESS_MODEL,))
    split = synthetic_split(sizes.batch_size * sizes.steps, options.seed)
    for model in models:
        for label, amp in PRECISIONS.items():
            name = f"{model} {label}"
            if amp == "fp16" and not on_cuda:
                yield Check("determinism", name, NA, "n/a on cpu: fp16 with a GradScaler needs CUDA")
                continue
            cfg = train_config(options, model=model, amp=amp, batch_size=sizes.batch_size, max_batches=sizes.steps)
            yield _twice(options, cfg, split, name)
    for label in ("fp32", "bf16"):  # the recipe, on the default model
        cfg = train_config(
            options, model=COMPRESS_MODEL, amp=PRECISIONS[label], batch_size=sizes.batch_size, max_batches=sizes.steps
        )
        yield _twice(options, cfg.model_copy(update=RECIPE), split, f"{COMPRESS_MODEL} {label} recipe")


def _twice(options: CheckOptions, cfg: TrainConfig, split: Preprocessed, name: str) -> Check:
    numbers: dict[str, Any] = {
        "model": cfg.model,
        "amp": cfg.amp,
        "batch_size": cfg.batch_size,
        "steps": cfg.max_batches,
    }
    try:
        first, initial = trained(options, cfg, split)
        first_sha = digest(cpu_state(first.evaluated))  # the EMA's when the recipe keeps one
        changed = digest(dict(first.model.named_parameters())) != initial
        scale = first.scaler.get_scale() if first.scaler.is_enabled() else None
        del first
        second, _ = trained(options, cfg, split)
        second_sha = digest(cpu_state(second.evaluated))
    except Exception as exc:
        return Check("determinism", name, FAIL, describe(exc), numbers)
    numbers.update(sha256=[first_sha, second_sha], equal=first_sha == second_sha, weights_changed=changed)
    if scale is not None:
        numbers["grad_scale"] = scale
    runs = f"2 runs x {cfg.max_batches} steps, batch {cfg.batch_size}"
    if not changed:  # equal hashes of untouched weights would prove nothing (a GradScaler skipping every step)
        return Check("determinism", name, FAIL, f"no step changed the weights ({runs}): nothing compared", numbers)
    if first_sha != second_sha:
        return Check(
            "determinism", name, FAIL, f"weights differ: {first_sha[:12]} vs {second_sha[:12]} ({runs})", numbers
        )
    return Check("determinism", name, PASS, f"equal weights sha256 {first_sha[:12]} ({runs})", numbers)
