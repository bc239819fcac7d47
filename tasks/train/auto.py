"""What `auto` becomes where the data decides: an image folder's epochs, learning rate, early stopping,
class balance, label smoothing and kept epoch, chosen in the train stage from the splits it reads, each with its reason.

A published source (digits, mnist, cifar10, ...) is known before it is downloaded, and its recipe
(tasks/core/config/data.py `SOURCES`) is a measured one: Params resolves it when params.yaml loads. An
image folder is the user's own, of any size and balance; its recipe marks what depends on the data
(`FROM_DATA`), Params leaves those keys `auto`, and `resolve` here fills them from a `DataProfile` of
the training and validation splits. The rules are arithmetic on counts: the same split gives the same choices, so the
same bytes, on every rank of a DDP job and in every process that asks again.

Why these rules (docs/training.md, "Real image sets", has the measurements):
- epochs: what limits a small folder is optimiser steps, not epochs. 15 epochs of 173 images is 45
  steps of 64 images, and the model ends far from fitting its own training set. Every folder gets at
  least `STEP_BUDGET` steps, at least `MIN_EPOCHS` epochs (what a large folder gets, as before), and at
  most `MAX_EPOCHS`. The budget was 600 steps (the 8x8 digits' recipe: 30 epochs of 20); on 5,000 real
  handwritten digits (3,486 training images, 55 steps an epoch) it left 15 epochs, 98.3-98.9% test
  accuracy over three seeds; 1,600 steps (30 epochs) gave 98.8-99.1% (2026-12-04).
- learning rate: `BASE_LR` (every published source's) for images up to `BASE_SIDE` px, and in inverse
  proportion to the image's area above it, to a quarter of it at twice the side (the least: larger
  images were not measured). The two real 64 px sets trained better at a quarter (0.0125) under every
  seed measured: the emoji by 4.8 and 3.2 points (seeds 42, 1; the best epoch, which their 280
  validation images keep), the sprites by 9.1 points over five seeds by the last epoch (the one their
  39 keep), and both sweeps' winners took 0.0056-0.012; at it the defaults reach those winners
  (benchmarks/results/lr-by-image-size.json). On the 28-32 px sets the winners took 0.03, near the
  0.05 that gives 99.2% on real digits (2026-12-04 to 12-07, docs/training.md).
- kept epoch: under `SMALL_VALIDATION` validation images the last epoch's weights are kept, not the
  best-scoring epoch's. On 39 validation images one image is 2.6 points, many epochs tie at the best
  score (a tie keeps the first), and the one kept was often mid-run (epochs 75-170 of 175-200). Over 24
  trainings of the real sprites (resnet9: the defaults and the sweep's winner under several seeds, the
  sweep's trials, variants; benchmarks/results/sprites-variants.json), the last epoch scored 4.4 points
  higher on the test split than the kept one (SE 1.7; higher in 15, lower in 5), 2026-12-06. From 100
  images (one image a point; the real icons have 168, the emoji 280) the best epoch, as before: the last
  was not measured against it on splits that size.
- early stopping guards the longer budget: a run whose validation score has not improved for half its
  epochs (at least `MIN_PATIENCE`) ends there; best.safetensors is still the best epoch's. Not sooner: a
  small folder's validation split is a few dozen images, and in the first epochs, at the peak learning
  rate, answering the largest class can score best for a while (on 726 icons, a patience of 10 stopped a
  50-epoch run at epoch 12, at 18% training accuracy). None where the last epoch is kept: the schedule
  runs to its end (a stop would keep a mid-schedule epoch).
- class balance: past `IMBALANCE` (largest class over smallest) each epoch draws every class equally
  often (`sampler`), so a small class is not given up for the large one's accuracy. On 726 icons whose
  largest class has 15x the smallest's images, 50 epochs: macro recall 0.50 unbalanced, 0.63 sampled,
  at 0.7 points of accuracy (docs/training.md). Inverse-frequency loss weights (`loss`) had not begun
  to learn by epoch 12 in the one run they were tried (cut short by a patience of 10): unmeasured beyond.
- label smoothing: `SMOOTHING` (every published source's recipe) below `IMBALANCE`, none from it. On the
  imbalanced real sets at 1,600 steps, hard targets scored 0.767 against 0.699 on the icons (18x, 146 test
  images), 0.671 against 0.667 on the emoji (4.5x) and one of 33 sprites fewer (5.3x: 0.758, 0.788); on
  balanced product photos smoothing kept 1.2 points (0.865 against 0.853), 2026-12-04.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.core.config.train import TrainConfig
from tasks.data.preprocess import Preprocessed, load_split

STEP_BUDGET = 1600  # optimiser steps a folder trains for at least
MIN_EPOCHS = 15  # ... and epochs (a folder large enough has STEP_BUDGET steps in fewer)
MAX_EPOCHS = 200  # a folder of a few dozen images: more epochs only memorise them
MIN_PATIENCE = 10  # epochs without a better validation score before a longer run stops
IMBALANCE = 3.0  # largest class / smallest class from which classes are drawn equally often
SMOOTHING = 0.1  # label smoothing below IMBALANCE (0 from it), as every source's recipe has
BASE_LR = 0.05  # per batch_size images: the published sources' rate (tasks/core/config/data.py SourceRecipe)
BASE_SIDE = 32  # px: images up to this side train at BASE_LR
SMALL_VALIDATION = 100  # validation images under which the last epoch is kept, not the best-scoring one
# what `resolve` may choose (keep before early_stop_patience: keeping the last epoch turns stopping off)
AUTO_KEYS = ("epochs", "lr", "keep", "early_stop_patience", "class_balance", "label_smoothing")


@dataclass(frozen=True)
class DataProfile:
    """What the rules read of the splits: the training split's size, its classes' sizes and its images'
    shape, and the validation split's size."""

    class_counts: tuple[int, ...]  # training images per class, in the split's class order
    image_shape: tuple[int, int, int]  # (C, H, W)
    val_images: int

    @property
    def images(self) -> int:
        return sum(self.class_counts)

    @property
    def imbalance(self) -> float:
        """The largest class's count over the smallest present one's (1.0: balanced)."""
        present = [count for count in self.class_counts if count]
        return max(present) / min(present) if present else 1.0


@dataclass(frozen=True)
class Choice:
    """One key `auto` resolved: its value and why (train.json, the MLflow run, the model card)."""

    value: Any
    reason: str


def profile(train: Preprocessed, val: Preprocessed) -> DataProfile:
    """The profile of a training and a validation split (their labels are in memory; no image is read)."""
    counts = np.bincount(train.labels, minlength=len(train.classes))
    c, h, w = train.images.shape[1:]
    return DataProfile(tuple(int(n) for n in counts), (int(c), int(h), int(w)), len(val.labels))


def resolve(cfg: TrainConfig, data: DataProfile) -> tuple[TrainConfig, dict[str, Choice]]:
    """`cfg` with every key still `auto` chosen from `data`, and the choices made (empty: none was auto)."""
    choices: dict[str, Choice] = {}
    if cfg.epochs == "auto":
        choices["epochs"] = _epochs(cfg, data)
    if cfg.lr == "auto":
        choices["lr"] = _lr(data)
    if cfg.keep == "auto":
        choices["keep"] = _keep(cfg, data)
    if cfg.early_stop_patience == "auto":
        epochs = choices["epochs"].value if "epochs" in choices else cfg.epochs
        keep = choices["keep"].value if "keep" in choices else cfg.keep
        choices["early_stop_patience"] = _patience(epochs, keep)
    if cfg.class_balance == "auto":
        choices["class_balance"] = _class_balance(data)
    if cfg.label_smoothing == "auto":
        choices["label_smoothing"] = _label_smoothing(data)
    if not choices:
        return cfg, choices
    return cfg.model_copy(update={key: choice.value for key, choice in choices.items()}), choices


def epochs_on(cfg: TrainConfig, pre_dir: Path) -> int:
    """The epochs the train stage will run with `cfg` on `pre_dir`'s training split (`auto` chosen as it
    chooses): what a sweep's pruner needs before the trial trains."""
    splits = (load_split(pre_dir, name, stream=True) for name in ("train", "val"))
    return resolve(cfg, profile(*splits))[0].epochs


def as_trained(cfg: TrainConfig, trained: dict[str, Any]) -> TrainConfig:
    """`cfg` with the keys it leaves `auto` as the train stage chose them: `trained` is a checkpoint's
    "config" (tasks/train/checkpoints.py `result_config`, which leaves out recipe keys at their defaults).
    Fine-tuning (compress) continues the training the checkpoint had, not a new choice."""
    left = [key for key in AUTO_KEYS if getattr(cfg, key) == "auto"]
    return cfg.model_copy(update={key: trained.get(key, TrainConfig.model_fields[key].default) for key in left})


def _epochs(cfg: TrainConfig, data: DataProfile) -> Choice:
    per_epoch = max(1, math.ceil(data.images / (cfg.batch_size * cfg.accumulate_steps)))
    wanted = math.ceil(STEP_BUDGET / per_epoch)
    epochs = min(MAX_EPOCHS, max(MIN_EPOCHS, wanted))
    why = f"{data.images} training images make {per_epoch} optimiser steps an epoch"
    if epochs == MIN_EPOCHS:
        return Choice(epochs, f"{why}: {MIN_EPOCHS} epochs, the least ({per_epoch * epochs} steps)")
    if epochs == MAX_EPOCHS:
        return Choice(epochs, f"{why}: {MAX_EPOCHS} epochs, the most ({per_epoch * epochs} steps)")
    return Choice(epochs, f"{why}: {epochs} epochs reach the budget of {STEP_BUDGET} steps")


def _lr(data: DataProfile) -> Choice:
    side = min(data.image_shape[1:])
    if side <= BASE_SIDE:
        return Choice(BASE_LR, f"{side} px images (up to {BASE_SIDE}): {BASE_LR:g}, the published sources' rate")
    scale = max(0.25, (BASE_SIDE / side) ** 2)
    return Choice(
        round(BASE_LR * scale, 6),
        f"{side} px images: {BASE_LR:g} x {scale:.3g} (the area of {BASE_SIDE} px over theirs, at least a quarter): "
        "the real 64 px sets trained better at a quarter",
    )


def _keep(cfg: TrainConfig, data: DataProfile) -> Choice:
    if isinstance(cfg.early_stop_patience, int):  # given: TrainConfig refuses it beside keep: last
        return Choice("best", f"early stopping is on (early_stop_patience {cfg.early_stop_patience}): the best epoch")
    n = data.val_images
    if n == 0:
        return Choice("last", "no validation images: the last epoch")
    if n < SMALL_VALIDATION:
        return Choice(
            "last",
            f"{n} validation images (under {SMALL_VALIDATION}): one image is {100 / n:.1f} points, and the best "
            "epoch among many is picked by luck: the last epoch, at the end of the schedule",
        )
    return Choice("best", f"{n} validation images: the best epoch by {cfg.monitor}")


def _patience(epochs: int, keep: str) -> Choice:
    if keep == "last":
        return Choice(None, "the last epoch is kept (keep): the schedule runs to its end")
    patience = max(MIN_PATIENCE, epochs // 2)
    if patience >= epochs:
        return Choice(None, f"{epochs} epochs leave no room to stop early")
    return Choice(patience, f"half of {epochs} epochs (at least {MIN_PATIENCE}) without a better validation score")


def _class_balance(data: DataProfile) -> Choice:
    ratio = data.imbalance
    if ratio >= IMBALANCE:
        return Choice("sampler", f"the largest class is {ratio:.1f}x the smallest: classes drawn equally often")
    return Choice("none", f"the largest class is {ratio:.1f}x the smallest (under {IMBALANCE:g}x): unweighted")


def _label_smoothing(data: DataProfile) -> Choice:
    ratio = data.imbalance
    if ratio >= IMBALANCE:
        return Choice(0.0, f"the largest class is {ratio:.1f}x the smallest: hard targets")
    return Choice(SMOOTHING, f"the largest class is {ratio:.1f}x the smallest (under {IMBALANCE:g}x): {SMOOTHING:g}")
