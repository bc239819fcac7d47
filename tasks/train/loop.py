"""The training loop, built once: what the train stage, fine-tuning (compress) and the benchmarks step.

`build_training` puts together the model, optimiser, scheduler, GradScaler, loss and the seeded data
loader for one process (a lone one, or one rank of a torchrun job); `Training.epoch` runs one epoch
of it and returns that epoch's row of the history. Nothing here writes files or logs to MLflow.

Batches come from tasks/train/batches.py, augmented by tasks/train/augment.py; what happens around
each optimiser step (warm-up, clipping, the weight EMA, early stopping) is tasks/train/recipe.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from tasks.core.config.train import SOURCE_AUTO_KEYS, TrainConfig
from tasks.core.errors import ExpectedFailure
from tasks.data.preprocess import Preprocessed, load_split, read_rows
from tasks.determinism.dispatch import installed as portable_installed
from tasks.determinism.pinning import follow_load
from tasks.train.augment import BatchMixing
from tasks.train.batches import BalancedSampler, build_loader, class_weights
from tasks.train.checkpoints import cpu_state
from tasks.train.devices import Distributed, resolve_device
from tasks.train.models import build_model, gather, head_name, predict, refuse_unportable, to_float
from tasks.train.recipe import better, should_stop, warmup_factor, warmup_steps, weight_average

# How often a GPU run reads back whether a loss was non-finite: each read makes the host wait for the
# queued kernels, so it is amortised over steps (a diverged run wastes at most this many). On the CPU
# there is nothing to wait for: every step is checked, before its update.
FINITE_CHECK_EVERY_CUDA = 50
ALONE = Distributed()  # a lone process: rank 0 of 1
VALIDATION_BLOCK = 8 * 1024  # images read at once to validate: a multiple of predict's batch of 1024


class TrainingDiverged(ExpectedFailure):
    """The loss became NaN or infinite; nothing of the failing epoch was written."""


def head_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the classifier head (tasks.train.models.head_name) of a `Classifier`."""
    return list(model.get_submodule(f"net.{head_name(model.net)}").parameters())


def _optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    params: Iterable = model.parameters()
    if cfg.head_lr is not None:  # a new head learns faster than the pretrained weights under it may move
        head = {id(p) for p in head_parameters(model)}
        backbone = [p for p in model.parameters() if id(p) not in head]
        params = [{"params": backbone}, {"params": head_parameters(model), "lr": cfg.head_lr}]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    # Stepped once per epoch, after the optimiser steps of that epoch.
    if cfg.scheduler == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs)
    if cfg.scheduler == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg.step_size, gamma=cfg.gamma)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0)


def _autocast(amp: str, device: torch.device) -> AbstractContextManager:
    if amp == "none":
        return nullcontext()
    if amp == "fp16" and device.type != "cuda":
        raise ValueError("train.amp: fp16 needs a CUDA device (use bf16 on CPU)")
    return torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


@dataclass
class Progress:
    """Where a training run stands after its last epoch: the history so far, and the weights kept (the
    best on validation by `train.monitor`, or the last: `train.keep`). What a resume checkpoint carries
    besides the model and optimiser (tasks/train/resume.py)."""

    history: list[dict[str, float]] = field(default_factory=list)
    best_acc: float = -1.0  # the validation accuracy of the kept epoch
    best_epoch: int = 0  # the kept epoch (the best, or with keep: last the last, once the run ends)
    best_state: dict[str, torch.Tensor] | None = None

    @property
    def epoch(self) -> int:
        return int(self.history[-1]["epoch"]) if self.history else 0

    def record(
        self, row: dict[str, float], model: nn.Module, monitor: str = "val_accuracy", keep: str = "best"
    ) -> None:
        """Add an epoch's row; keep a copy of `model`'s weights if it is the best so far on validation
        (with keep: last, none: `keep_last` takes the weights when the run ends)."""
        best = next((r[monitor] for r in self.history if r["epoch"] == self.best_epoch), None)
        self.history.append(row)
        if keep != "last" and better(row[monitor], best, monitor):
            self.best_acc, self.best_epoch = row["val_accuracy"], int(row["epoch"])
            self.best_state = cpu_state(model)

    def keep_last(self, model: nn.Module) -> None:
        """Keep `model`'s weights as the last epoch's."""
        self.best_state, self.best_epoch = cpu_state(model), self.epoch
        scored = self.history[-1]["val_accuracy"] if self.history else math.nan
        if math.isfinite(scored):  # an empty validation split scores NaN: best_acc stays -1.0, never scored
            self.best_acc = scored


@dataclass
class Training:
    """One training run's state, in one place: its moving parts as `build_training` puts them together,
    and its progress. The train stage steps it, tasks/train/resume.py saves and restores all of it, and
    the checkpoints are written from it."""

    cfg: TrainConfig
    model: nn.Module  # what steps and is saved for a resume
    net: nn.Module  # what steps: `model`, or `model` wrapped for DDP by `distribute`
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    criterion: nn.Module
    autocast: AbstractContextManager
    sampler: DistributedSampler | BalancedSampler
    loader: DataLoader
    device: torch.device
    ranks: Distributed
    mixing: BatchMixing  # mixup / cutmix on the device
    ema: AveragedModel | None = None  # train.ema_decay: the average is what is validated and shipped
    frozen: bool = False  # the backbone is held this epoch (train.freeze_backbone_epochs)
    progress: Progress = field(default_factory=Progress)
    on_batch: Callable[[], None] | None = None  # after each training step (a progress bar)

    @property
    def evaluated(self) -> nn.Module:
        """The weights validated, kept as the best and written as the result: the EMA's when it is on."""
        return self.ema.module if self.ema is not None else self.model

    @property
    def batches_per_epoch(self) -> int:
        return len(self.loader) if self.cfg.max_batches is None else min(len(self.loader), self.cfg.max_batches)

    @property
    def steps_per_epoch(self) -> int:
        """Optimiser steps per epoch: a step per `accumulate_steps` batches, and one for the rest."""
        return math.ceil(self.batches_per_epoch / self.cfg.accumulate_steps)

    def distribute(self) -> None:
        """Wrap the model for DDP when there are several ranks (after a resume has restored it)."""
        if self.ranks.world_size > 1:
            net = nn.SyncBatchNorm.convert_sync_batchnorm(self.model) if self.cfg.sync_batchnorm else self.model
            self.net = DistributedDataParallel(
                net, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )

    def epoch(self, epoch: int, val: Preprocessed) -> dict[str, float]:
        """Train one epoch, step the schedule, validate, record it in `progress`: the epoch's row."""
        follow_load()  # portable mode: the cores other processes left since the last epoch
        train_loss, train_acc = self.train_epoch(epoch)
        self.scheduler.step()
        val_loss, val_acc = self.validate(val)
        row = {
            "epoch": epoch,
            "train_loss": train_loss,
            "train_accuracy": train_acc,
            "val_loss": val_loss,
            "val_accuracy": val_acc,
            "lr": self.scheduler.get_last_lr()[0],
        }
        self.progress.record(row, self.evaluated, self.cfg.monitor, self.cfg.keep)
        return row

    def should_stop(self) -> bool:
        """Early stopping (`train.early_stop_patience`), decided from the history alone."""
        return should_stop(self.progress.history, self.cfg)

    def train_epoch(self, epoch: int) -> tuple[float, float]:
        """One pass over the (sharded, shuffled, at most `max_batches`) training split: loss, accuracy."""
        self.sampler.set_epoch(epoch)
        self.hold_backbone(epoch <= self.cfg.freeze_backbone_epochs)
        return _run_epoch(self, _limited(self.loader, self.cfg.max_batches), epoch)

    def hold_backbone(self, frozen: bool) -> None:
        """Freeze (or release) every parameter but the head's.

        Set from the epoch number alone, so a resumed run holds exactly the epochs an uninterrupted one
        does. Frozen parameters get no gradient, so the optimiser leaves them (and their momentum and
        weight decay) alone; their BatchNorm statistics are held too (`_run_epoch`), so the features the
        head learns on stay the same function throughout the frozen epochs.
        """
        if frozen == self.frozen:
            return
        head = {id(p) for p in head_parameters(self.model)}
        for parameter in self.model.parameters():
            if id(parameter) not in head:
                parameter.requires_grad_(not frozen)
        self.frozen = frozen
        self.distribute()  # DDP registers the parameters that need gradients when it wraps: wrap again

    @torch.no_grad()
    def validate(self, split: Preprocessed) -> tuple[float, float]:
        """Loss and accuracy over the whole split, each sample counted once: rank r takes r::world."""
        if len(split.labels) == 0:
            return float("nan"), float("nan")
        ranks, model = self.ranks, self.evaluated
        ranks.share_buffers(model)
        mine = np.arange(ranks.rank, len(split.labels), ranks.world_size)
        # a block at a time (a split may be larger than memory), in batches of 1024 as always
        blocks = read_rows(split.images, mine, VALIDATION_BLOCK)
        logits = gather((predict(model, block, self.device, batch_size=1024) for block in blocks), len(mine))
        labels = torch.from_numpy(split.labels[mine])
        loss = nn.functional.cross_entropy(
            logits, labels, label_smoothing=self.cfg.label_smoothing, reduction="sum"
        ).item()
        loss_sum, correct, seen = ranks.all_reduce([loss, (logits.argmax(1) == labels).sum().item(), len(labels)])
        return loss_sum / seen, correct / seen


def build_training(
    cfg: TrainConfig,
    seed: int,
    split: Preprocessed,
    device: torch.device,
    ranks: Distributed = ALONE,
    model: nn.Module | None = None,
) -> Training:
    """The loop's parts for `split`: a new `cfg.model` (from torch's seeded RNG) unless `model` is given."""
    # (random_shift's and device's own `auto` are the loop's to resolve)
    unresolved = [key for key in SOURCE_AUTO_KEYS if getattr(cfg, key) == "auto"]
    if unresolved:
        raise ValueError(
            f"train.{', train.'.join(unresolved)}: 'auto' depends on the data: resolve with TrainConfig.for_source "
            "(data.source) and tasks.train.auto.resolve (the training and validation splits)"
        )
    if cfg.sync_batchnorm and device.type != "cuda":
        raise ValueError("train.sync_batchnorm: torch's SyncBatchNorm runs on CUDA devices only; set it false on CPU")
    if cfg.batch_size % ranks.world_size:
        raise ValueError(
            f"train.batch_size {cfg.batch_size} is global and must divide by the {ranks.world_size} processes"
        )
    num_classes, image_size = len(split.classes), tuple(split.images.shape[2:])
    if model is None:
        model = build_model(cfg.model, num_classes, split.mean, split.std, list(image_size))
    if device.type == "cpu" and portable_installed():
        refuse_unportable(model)  # before the first step, naming the op (attention, a matrix-vector product ...)
    model = model.to(device)
    optimizer = _optimizer(cfg, model)
    weights = class_weights(split.labels, num_classes).to(device) if cfg.class_balance == "loss" else None
    criterion = nn.CrossEntropyLoss(weight=weights, label_smoothing=cfg.label_smoothing)
    scheduler = _scheduler(cfg, optimizer)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16")
    autocast = _autocast(cfg.amp, device)
    sampler, loader = build_loader(split, cfg, seed, ranks, device)
    mixing = BatchMixing(cfg, num_classes, seed, ranks.rank)
    parts = (optimizer, scheduler, scaler, criterion, autocast, sampler, loader, device, ranks, mixing)
    return Training(cfg, model, model, *parts, ema=weight_average(cfg, model))


def _limited(loader: DataLoader, max_batches: int | None) -> Iterator:
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            return
        yield batch


def _run_epoch(t: Training, batches: Iterable, epoch: int) -> tuple[float, float]:
    t.net.train()
    if t.frozen:  # the backbone's BatchNorm layers keep their running statistics (the head has none)
        for module in t.model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()
    # Sums stay on the device and are read once per epoch: a per-step `.item()` would make the
    # host wait for every step's kernels on a GPU instead of queueing the next batch's.
    loss_sum = torch.zeros((), dtype=torch.float64, device=t.device)
    correct = torch.zeros((), dtype=torch.int64, device=t.device)
    # The first step whose loss was not finite, and that loss, recorded on the device (no sync).
    bad_step = torch.full((), -1, dtype=torch.int64, device=t.device)
    bad_loss = torch.zeros((), dtype=torch.float32, device=t.device)
    check_every = FINITE_CHECK_EVERY_CUDA if t.device.type == "cuda" else 1
    accumulate, last = t.cfg.accumulate_steps, t.batches_per_epoch
    seen, step = 0, 0
    for step, (images, labels) in enumerate(batches, start=1):
        x, y = to_float(images, t.device), labels.to(t.device)
        x, target = t.mixing(x, y, epoch, step)
        if (step - 1) % accumulate == 0:
            t.optimizer.zero_grad(set_to_none=True)
        stepping = step % accumulate == 0 or step == last
        # DDP all-reduces the gradients once per optimiser step, not once per accumulated batch
        with nullcontext() if stepping or t.net is t.model else t.net.no_sync():
            with t.autocast:
                logits = t.net(x)
                loss = t.criterion(logits, target)
            first = (bad_step < 0) & ~torch.isfinite(loss.detach())
            bad_step = torch.where(first, step, bad_step)
            bad_loss = torch.where(first, loss.detach().float(), bad_loss)
            if step % check_every == 0:
                _stop_if_diverged(bad_step, bad_loss, epoch, t.ranks)
            t.scaler.scale(loss / accumulate if accumulate > 1 else loss).backward()
        if stepping:
            _optimizer_step(t, (epoch - 1) * t.steps_per_epoch + math.ceil(step / accumulate))
        loss_sum += loss.detach().double() * len(y)
        correct += (logits.argmax(1) == y).sum()
        seen += len(y)
        if t.on_batch is not None:
            t.on_batch()
    if step % check_every:
        _stop_if_diverged(bad_step, bad_loss, epoch, t.ranks)
    total_loss, total_correct, seen = t.ranks.all_reduce([loss_sum.item(), float(correct.item()), seen])
    return total_loss / seen, total_correct / seen


def _optimizer_step(t: Training, step: int) -> None:
    """Optimiser step `step` of the run (1-based): clipped, at the warm-up's share of the scheduled
    learning rate, then folded into the EMA."""
    if t.cfg.grad_clip_norm is not None:
        t.scaler.unscale_(t.optimizer)  # clip the true gradients, not fp16's scaled ones
        parameters = [p for group in t.optimizer.param_groups for p in group["params"]]
        nn.utils.clip_grad_norm_(parameters, t.cfg.grad_clip_norm)
    factor = warmup_factor(step, warmup_steps(t.cfg, t.steps_per_epoch))
    scheduled = [group["lr"] for group in t.optimizer.param_groups]
    if factor != 1.0:
        for group in t.optimizer.param_groups:
            group["lr"] *= factor
    t.scaler.step(t.optimizer)
    t.scaler.update()
    if factor != 1.0:  # the epoch schedulers compute from the lr they set (cosine does so recursively)
        for group, lr in zip(t.optimizer.param_groups, scheduled, strict=True):
            group["lr"] = lr
    if t.ema is not None:
        t.ema.update_parameters(t.model)


def _stop_if_diverged(bad_step: torch.Tensor, bad_loss: torch.Tensor, epoch: int, ranks: Distributed) -> None:
    """Raise `TrainingDiverged` on every rank if any rank has seen a NaN/inf loss this epoch.

    A collective under DDP (all ranks check at the same steps), so the ranks stop together instead
    of the healthy ones waiting forever for a gradient all-reduce the failed one never joins.
    """
    never = float(2**62)
    step = int(bad_step.item())
    first = ranks.minimum(step if step >= 0 else never)
    if first == never:
        return
    shown = f" ({bad_loss.item()})" if step == first else ""  # the rank that saw it knows the value
    raise TrainingDiverged(
        f"training diverged: the loss is not finite{shown} at epoch {epoch}, step {int(first)}; "
        f"nothing of epoch {epoch} was written, earlier checkpoints are kept. Lower train.lr, "
        "or check the data and its mean/std"
    )


def fine_tune(model: nn.Module, cfg: TrainConfig, seed: int, pre_dir: Path, epochs: int, lr: float) -> list[dict]:
    """`epochs` more epochs of the training loop on an already trained `model`, in this process.

    Pruning and quantization-aware training recover accuracy with it. Optimiser, batch size,
    augmentation and label smoothing follow `cfg`; the learning rate starts at `lr` and decays on
    a cosine, in fp32. torch's RNG is re-seeded with `seed` first, so the result does not depend on
    what ran before in the process. Returns the per-epoch history (train and validation).
    """
    torch.manual_seed(seed)
    train_split, val_split = load_split(pre_dir, "train", stream=True), load_split(pre_dir, "val", stream=True)
    # no backbone held, one learning rate: fine-tuning a compressed model is not fine-tuning a pretrained one
    update = {"lr": lr, "epochs": epochs, "scheduler": "cosine", "amp": "none", "freeze_backbone_epochs": 0}
    # nor the run-long parts of the recipe: a warm-up, an average that would hold a few epochs' weights
    # near the uncompressed ones, or a stop before `epochs`
    run_long = {"warmup_epochs": 0, "warmup_steps": 0, "ema_decay": None, "early_stop_patience": None}
    tuning = cfg.model_copy(update={**update, **run_long, "head_lr": None})
    training = build_training(tuning, seed, train_split, resolve_device(cfg.device), model=model)
    return [training.epoch(epoch, val_split) for epoch in range(1, epochs + 1)]
