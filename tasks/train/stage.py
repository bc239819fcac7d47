"""Stage 4 — train: fit the model `train.model` names on the preprocessed training split.

Outputs (`artifacts/train/`): `best.safetensors` (the weights kept: the best validation score, or the
last epoch's with `train.keep: last`) and `last.safetensors` (final epoch) — weights only, loadable
without unpickling code, with the resolved config and epoch in the safetensors metadata
(tasks/train/checkpoints.py) — `history.json` (per-epoch loss, accuracy and learning rate, also a DVC
plot) and `train.json` (the result).

One code path for one process and for DDP: under torchrun (RANK/WORLD_SIZE set) `train` joins the
process group (tasks/train/devices.py), shards batches with the same seeded DistributedSampler,
reduces validation metrics across ranks, and lets rank 0 alone make files (the first rank of each other
node writes a copy of the outputs: nodes share no disk). `train.batch_size` is
the global batch; each of N processes takes batch_size / N. The loop itself is tasks/train/loop.py;
resuming an interrupted run bit for bit is tasks/train/resume.py; pretrained weights (`train.pretrained_*`),
verified and fitted to the model before the first epoch, are tasks/train/pretrained.py.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from tasks.core import layout
from tasks.core.atomic import atomic_files
from tasks.core.config.train import TrainConfig
from tasks.data.preprocess import Preprocessed, load_split
from tasks.train import auto, resume
from tasks.train.checkpoints import checkpoint_bytes, checkpoint_metadata, cpu_state
from tasks.train.devices import join_process_group
from tasks.train.loop import Training, build_training
from tasks.train.pretrained import Pretrained, load_pretrained

OUTPUTS = ("best.safetensors", "last.safetensors", "history.json", "train.json")
OnEpoch = Callable[[dict[str, float]], None]  # called with each epoch's history row, in order
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    best_epoch: int
    best_val_accuracy: float
    final: dict[str, float]  # last epoch's train/val loss and accuracy
    device: str
    world_size: int
    backend: str
    amp: str
    resumed_from_epoch: int | None
    pretrained: dict[str, str] | None = None  # the weights fine-tuned from: sha256, source, re-initialised tensors
    # what `auto` chose from the data (tasks/train/auto.py): {key: {"value": ..., "reason": ...}}
    recipe: dict[str, dict[str, Any]] = field(default_factory=dict)
    random_shift_px: int = 0  # train.random_shift in pixels (auto: from the image size)
    stopped_early_at: int | None = None  # the last epoch trained, when early stopping ended the run


def train(
    cfg: TrainConfig,
    seed: int,
    pre_dir: Path,
    out_dir: Path,
    resume_dir: Path | None = None,
    on_epoch: OnEpoch | None = None,
    weights_cache: Path | None = None,
) -> TrainResult:
    """Train on `pre_dir`'s train split, select on val, write checkpoints to `out_dir`.

    Alone or as one rank of a torchrun job. With `resume_dir`, continue from the checkpoint there
    when it belongs to this config, seed and data (a resumed run's earlier rows reach `on_epoch`
    too, so the new run carries the whole curve). Assumes `tasks.determinism.pinning.pin_everything` was
    called (the stage runner and tasks/train/launcher.py do it). Pretrained weights from a URL are cached in
    `weights_cache` (default: the download cache, tasks/core/layout.py).
    """
    on_epoch = on_epoch or (lambda row: None)
    ranks, device = join_process_group(cfg.device)
    train_split, val_split = load_split(pre_dir, "train", stream=True), load_split(pre_dir, "val", stream=True)
    # what an image folder's recipe leaves to its data (every rank reads the same split: the same choices)
    cfg, choices = auto.resolve(cfg, auto.profile(train_split, val_split))
    if ranks.rank == 0:
        for key, choice in choices.items():
            log.info("train.%s: auto is %s (%s)", key, choice.value, choice.reason)
    training = build_training(cfg, seed, train_split, device, ranks)
    # After the model drew its init from the seeded RNG (what the pretrained file lacks stays as a
    # from-scratch run would have it), before a resume overwrites the weights with later ones.
    pretrained = load_pretrained(cfg, training.model, weights_cache or layout.download_cache())
    signature = resume.signature(cfg, seed, pre_dir)
    resume_path = Path(resume_dir) / resume.RESUME_FILE if resume_dir is not None else None
    resumed = resume.restore(resume_path, training, signature) if resume_path else False
    progress = training.progress
    resumed_from = progress.epoch if resumed else None
    for row in progress.history:
        on_epoch(row)
    training.distribute()

    out_dir.mkdir(parents=True, exist_ok=True)
    _train_epochs(training, val_split, on_epoch, resume_path, signature)

    # keep: last, or validation never scored (an empty split): the last weights are the ones known
    if cfg.keep == "last" or progress.best_state is None:
        progress.keep_last(training.evaluated)
    result = _result(training, resumed_from, pretrained, choices)
    contents = None
    if ranks.rank == 0:
        metadata = checkpoint_metadata(cfg, seed, train_split, ranks.world_size, pretrained)
        contents = _outputs(training, result, metadata)
    if not ranks.one_node:
        # Nodes share no disk, and c10d's rendezvous, not the launching node, decides where rank 0
        # runs: every node gets rank 0's outputs, so the node that ran the stage has them.
        contents = {name: ranks.broadcast_bytes(contents[name] if contents else None, 0) for name in OUTPUTS}
    if ranks.node_leader:
        _write_outputs(out_dir, contents)
        if resume_path is not None:
            resume_path.unlink(missing_ok=True)  # finished: a later run starts fresh (on every node)
    ranks.barrier()  # no rank leaves (and no launcher reports success) before the files exist
    return result


def _train_epochs(
    training: Training, val: Preprocessed, on_epoch: OnEpoch, resume_path: Path | None, signature: str
) -> None:
    """The epochs left to train, up to `train.epochs` or an early stop, with a resume checkpoint every
    `checkpoint_every` epochs and at the last one."""
    cfg, rank = training.cfg, training.ranks.rank
    # resumed from the checkpoint of the epoch that stopped the run: nothing is left to train
    epochs = range(training.progress.epoch + 1, cfg.epochs + 1) if not training.should_stop() else range(0)
    with _batch_bar(training, len(epochs)) as bar:
        for epoch in epochs:
            started = time.monotonic()
            row = training.epoch(epoch, val)  # recorded in training.progress
            on_epoch(row)
            bar.set_postfix(epoch=f"{epoch}/{cfg.epochs}", val_acc=f"{row['val_accuracy']:.4f}")
            if rank == 0:
                _log_epoch(row, cfg.epochs, time.monotonic() - started)
            stopping = training.should_stop()
            if stopping and rank == 0:
                log.info("early stop after epoch %d: %s has not improved for %d epochs", epoch, cfg.monitor,
                         cfg.early_stop_patience)  # fmt: skip
            if resume_path is not None and (epoch % cfg.checkpoint_every == 0 or epoch == cfg.epochs or stopping):
                resume.save(resume_path, training, signature)
            if stopping:
                return


def _batch_bar(training: Training, epochs: int) -> tqdm:
    """A bar over every training step left, with its rate and time to go, on rank 0's terminal (tqdm
    stays quiet when stderr is not one: a log file gets the epoch lines instead)."""
    per_epoch = len(training.loader)
    if training.cfg.max_batches is not None:
        per_epoch = min(per_epoch, training.cfg.max_batches)
    quiet = None if training.ranks.rank == 0 else True
    bar = tqdm(total=epochs * per_epoch, desc="train", unit="batch", dynamic_ncols=True, disable=quiet)
    training.on_batch = bar.update
    return bar


def _log_epoch(row: dict[str, float], epochs: int, seconds: float) -> None:
    """One line per epoch through logging: what a Prefect flow run's page shows as training goes."""
    log.info(
        "epoch %d/%d: train_loss %.4f, train_accuracy %.4f, val_loss %.4f, val_accuracy %.4f, lr %.4g, %.1f s",
        row["epoch"], epochs, row["train_loss"], row["train_accuracy"], row["val_loss"], row["val_accuracy"],
        row["lr"], seconds,
    )  # fmt: skip


def _result(
    training: Training, resumed_from: int | None, pretrained: Pretrained | None, choices: dict[str, auto.Choice]
) -> TrainResult:
    progress = training.progress
    return TrainResult(
        best_epoch=progress.best_epoch,
        best_val_accuracy=progress.best_acc,
        final={k: v for k, v in progress.history[-1].items() if k != "epoch"},
        device=str(training.device),
        world_size=training.ranks.world_size,
        backend=training.ranks.backend,
        amp=training.cfg.amp,
        resumed_from_epoch=resumed_from,
        pretrained=pretrained.lineage() if pretrained else None,
        random_shift_px=training.loader.dataset.max_shift,
        stopped_early_at=progress.epoch if progress.epoch < training.cfg.epochs else None,
        recipe={key: asdict(choice) for key, choice in choices.items()},
    )


def _outputs(training: Training, result: TrainResult, metadata: dict[str, Any]) -> dict[str, bytes]:
    """The four outputs' bytes, by file name (OUTPUTS)."""
    progress = training.progress
    best = {**metadata, "epoch": progress.best_epoch, "val_accuracy": progress.best_acc}
    last = {**metadata, "epoch": progress.epoch, "val_accuracy": progress.history[-1]["val_accuracy"]}
    return {
        "best.safetensors": checkpoint_bytes(progress.best_state, best),
        "last.safetensors": checkpoint_bytes(cpu_state(training.evaluated), last),
        "history.json": (json.dumps(progress.history, indent=2) + "\n").encode(),
        "train.json": (json.dumps(asdict(result), indent=2) + "\n").encode(),
    }


def _write_outputs(out_dir: Path, contents: dict[str, bytes]) -> None:
    """All four outputs replaced together: a kill or a full disk leaves the previous four."""
    with atomic_files([out_dir / name for name in OUTPUTS]) as temporaries:
        for tmp, name in zip(temporaries, OUTPUTS, strict=True):
            tmp.write_bytes(contents[name])
