"""Resumable training state: everything a restarted train stage needs to continue bit for bit.

Every `train.checkpoint_every` epochs the train stage writes `resume_dir/resume.safetensors`: the
model, the optimiser (tensors as tensors, the rest as JSON), scheduler and GradScaler state, the weight
EMA, the best model so far, the history, and the RNG states of every rank. A restarted stage (or a torchrun
restart) that finds it continues, and its final weights equal an uninterrupted run's.

Rank 0 alone writes the file, on its own node's disk. Nodes share no disk, and after a restart rank 0
may even run on another node: on resume, the ranks of a multi-node job agree on the newest checkpoint
of this run that any of them holds, and it is sent to every node that lacks it (`_share_newest`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from tasks.core.atomic import write_bytes
from tasks.core.config.train import TrainConfig
from tasks.determinism.pinning import rng_state, set_rng_state
from tasks.train.checkpoints import CheckpointError, checkpoint_bytes, cpu_state, read_safetensors, result_config
from tasks.train.devices import Distributed
from tasks.train.loop import Progress, Training

log = logging.getLogger(__name__)
RESUME_FILE = "resume.safetensors"


def signature(cfg: TrainConfig, seed: int, pre_dir: Path) -> str:
    """What a resume checkpoint must match: the config that shapes the result, the seed, the data."""
    # Not the world size: a checkpoint from another world size is refused by name, not ignored.
    # The data by its meta.json, which holds the sha256 of every array file (checked when a split is
    # loaded): reading the arrays again here would hash the whole dataset a second time.
    digest = hashlib.sha256(json.dumps({"config": result_config(cfg), "seed": seed}, sort_keys=True).encode())
    digest.update((Path(pre_dir) / "meta.json").read_bytes())
    return digest.hexdigest()


def save(path: Path, training: Training, run_signature: str) -> None:
    """Every rank contributes its RNG state; rank 0 writes the file atomically."""
    rng_states = training.ranks.gather(rng_state())
    if training.ranks.rank != 0:
        return
    progress = training.progress
    tensors = {f"model.{k}": v for k, v in cpu_state(training.model).items()}
    tensors.update({f"best.{k}": v for k, v in (progress.best_state or {}).items()})
    if training.ema is not None:
        tensors.update({f"ema.{k}": v for k, v in cpu_state(training.ema).items()})
    optim = training.optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for index, values in optim["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    meta = {
        "signature": run_signature,
        "epoch": progress.epoch,
        "history": progress.history,
        # the header's JSON has sorted keys; a resumed run's history.json must keep the rows' own order
        "history_keys": list(progress.history[-1]) if progress.history else [],
        "best_acc": progress.best_acc,
        "best_epoch": progress.best_epoch,
        "world_size": training.ranks.world_size,
        "rng": rng_states,
        "scheduler": training.scheduler.state_dict(),
        "scaler": training.scaler.state_dict(),
        "optim_groups": optim["param_groups"],
        "optim_scalars": scalars,
    }
    write_bytes(path, checkpoint_bytes(tensors, meta))


def restore(path: Path, training: Training, run_signature: str) -> bool:
    """Load the checkpoint at `path` into `training` (its progress too) if it belongs to this run;
    whether it did.

    A checkpoint of another config, seed or data is ignored (with a warning); one written by another
    world size is refused, since continuing it would not reproduce the run.
    """
    if not training.ranks.one_node:
        _share_newest(path, training.ranks, run_signature)
    if not path.exists():
        return False
    # A corrupt or foreign file is an error, not a reason to start over silently: it may be the
    # only copy of a night's training (a disk error, a copy cut short) and deserves a look.
    meta, _ = read_safetensors(path, tensors=False)
    if meta.get("signature") != run_signature:
        log.warning("%s: from another config, seed or data; starting from scratch", path)
        return False
    if meta["world_size"] != training.ranks.world_size:
        raise CheckpointError(
            f"{path}: written by {meta['world_size']} process(es), this run has {training.ranks.world_size}; "
            "a different world size would not reproduce the run. Delete the file to start over, or "
            "resume with the same train.nproc_per_node x train.nnodes"
        )
    tensors = read_safetensors(path)[1]
    training.model.load_state_dict(_prefixed(tensors, "model."))
    if training.ema is not None:
        training.ema.load_state_dict(_prefixed(tensors, "ema."))
    _restore_optimizer(training.optimizer, meta, tensors)
    training.scheduler.load_state_dict(meta["scheduler"])
    training.scaler.load_state_dict(meta["scaler"])
    set_rng_state(meta["rng"][training.ranks.rank])
    log.info("resuming from %s after epoch %d", path, meta["epoch"])
    best = _prefixed(tensors, "best.") or None
    order = meta.get("history_keys") or []  # absent from older checkpoints: their rows as they are
    history = [{**{k: row[k] for k in order if k in row}, **row} for row in meta["history"]]
    training.progress = Progress(history, meta["best_acc"], meta["best_epoch"], best)
    return True


def _share_newest(path: Path, ranks: Distributed, run_signature: str) -> None:
    """Every node's `path` made the newest checkpoint of this run that any rank holds (none: unchanged).

    Every rank says which epoch it holds; the lowest rank holding the newest sends the file's bytes,
    each node that holds another (or none) writes them, and only then do the ranks read it.
    """
    held = ranks.gather(_held_epoch(path, run_signature))
    errors = [h for h in held if isinstance(h, str)]
    if errors:  # raised by every rank: one rank alone stopping would leave the others waiting
        raise CheckpointError(errors[0])
    newest = max(held)
    if newest < 0:
        return
    source = held.index(newest)
    data = ranks.broadcast_bytes(path.read_bytes() if ranks.rank == source else None, source)
    if ranks.node_leader and held[ranks.rank] != newest:
        write_bytes(path, data)
        log.info("%s: the checkpoint of epoch %d, received from rank %d", path, newest, source)
    ranks.barrier()  # written before any rank of this node reads it


def _held_epoch(path: Path, run_signature: str) -> int | str:
    """The epoch of this run's checkpoint at `path`; -1 when there is none (or another run's);
    the error when it cannot be read."""
    if not path.exists():
        return -1
    try:
        meta, _ = read_safetensors(path, tensors=False)
    except CheckpointError as exc:
        return str(exc)
    return int(meta["epoch"]) if meta.get("signature") == run_signature else -1


def _prefixed(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def _restore_optimizer(
    optimizer: torch.optim.Optimizer, meta: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, value in _prefixed(tensors, "optim.").items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    for index, values in meta["optim_scalars"].items():
        state.setdefault(int(index), {}).update(values)
    optimizer.load_state_dict({"state": state, "param_groups": meta["optim_groups"]})
