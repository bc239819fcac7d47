"""The training recipe around each optimiser step: learning-rate warm-up, gradient clipping, the weight
EMA, and when to stop early. Each is a function of the step or of the history, or state a resume
checkpoint carries (the EMA), so a killed run resumed gives the bytes of an unbroken one.

How each interacts with determinism (the docs' training-recipe page says the same for users):
- Warm-up, accumulation, early stopping, the EMA: arithmetic on values that are already fixed; the EMA's
  update is element-wise (ATen's pinned kernels in portable mode).
- Clipping is torch's `clip_grad_norm_`. Its global norm is a reduction over millions of numbers; ATen's
  `sum` cuts such a reduction into one piece per thread (its last bits follow the thread count), but
  its norm kernel does not, and tests/train/test_recipe.py holds that on every thread count, as
  portable mode promises.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tasks.core.config.train import TrainConfig


def warmup_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """Optimiser steps of linear warm-up: `warmup_steps`, or `warmup_epochs` epochs of steps."""
    return cfg.warmup_steps or cfg.warmup_epochs * steps_per_epoch


def warmup_factor(step: int, warmup: int) -> float:
    """The learning rate's multiplier at optimiser step `step` (1-based, counted over the whole run):
    step/warmup during the warm-up, rising to 1 at its last step; 1 after it."""
    return 1.0 if step >= warmup else step / warmup


def weight_average(cfg: TrainConfig, model: nn.Module) -> AveragedModel | None:
    """The EMA of `model`'s weights and BatchNorm statistics (`train.ema_decay`), or None when off."""
    if cfg.ema_decay is None:
        return None
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(cfg.ema_decay), use_buffers=True)


def better(value: float, best: float | None, monitor: str, min_delta: float = 0.0) -> bool:
    """Whether `value` of `monitor` improves on `best` by more than `min_delta` (NaN never does)."""
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value > best + min_delta if monitor == "val_accuracy" else value < best - min_delta


def epochs_without_improvement(history: Sequence[dict[str, float]], cfg: TrainConfig) -> int:
    """Epochs since `monitor` last improved by more than `early_stop_min_delta`, from the history alone
    (a resumed run decides as the unbroken one did)."""
    best, improved_at = None, 0
    for row in history:
        if better(row[cfg.monitor], best, cfg.monitor, cfg.early_stop_min_delta):
            best, improved_at = row[cfg.monitor], int(row["epoch"])
    return int(history[-1]["epoch"]) - improved_at if history else 0


def should_stop(history: Sequence[dict[str, float]], cfg: TrainConfig) -> bool:
    """Early stopping: `early_stop_patience` epochs without improvement."""
    patience = cfg.early_stop_patience
    return patience is not None and epochs_without_improvement(history, cfg) >= patience
