"""Checkpoints: weights as safetensors with their provenance, and the one safe way to read them.

The train stage writes `best.safetensors` and `last.safetensors`; evaluate, compress and export load
them with `load_checkpoint`. Only safetensors is ever read (never a pickle), and a checkpoint of
another model or other data is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from safetensors.torch import save as serialize
from torch import nn

from tasks.core.config.train import RECIPE_KEYS, TrainConfig, recipe_changes
from tasks.core.errors import ExpectedFailure
from tasks.data.preprocess import Preprocessed
from tasks.train.models import Classifier, build_model

if TYPE_CHECKING:
    from tasks.train.pretrained import Pretrained

# How a job is launched, not what it computes: two nodes x 1 process give the weights of one node x 2,
# and neither checkpoint cadence, restarts nor loader workers change a bit. Left out of the
# checkpoints' recorded config (and of the resume signature), so equal results are equal files.
LAUNCH_KEYS = frozenset(
    {"strategy", "nproc_per_node", "nnodes", "rdzv_endpoint", "max_restarts", "checkpoint_every", "num_workers"}
)
# Which published weights a run starts from and the mirror they came through: the file itself is
# recorded by its digest (the metadata's `pretrained`), so a run given the same file by path writes
# the same checkpoint, as does a run from before these keys existed.
SOURCE_KEYS = frozenset({"pretrained", "pretrained_mirror"})


class CheckpointError(ExpectedFailure):
    """A checkpoint that cannot be used: not safetensors, truncated, or from another model or run."""


def result_config(cfg: TrainConfig) -> dict[str, Any]:
    """The train config that shapes the weights (everything but LAUNCH_KEYS and SOURCE_KEYS, and the recipe
    options a run leaves at their defaults: RECIPE_KEYS). Its `seed` is left out too: the checkpoints
    record the seed actually used (train.seed or the top-level one) beside it."""
    unchanged = set(RECIPE_KEYS) - set(recipe_changes(cfg))
    return cfg.model_dump(exclude={*LAUNCH_KEYS, *SOURCE_KEYS, *unchanged, "seed"})


def checkpoint_metadata(
    cfg: TrainConfig, seed: int, split: Preprocessed, world_size: int, pretrained: Pretrained | None = None
) -> dict[str, Any]:
    """What every checkpoint records (the epoch and its val accuracy are added per file): enough to
    rebuild the model and to know what it was trained on. The one builder: the train stage's and the
    GPU check's checkpoints carry the same keys."""
    return {
        "model": cfg.model,
        "image_size": list(split.images.shape[2:]),  # decides a torchvision model's stem (tasks/train/models.py)
        "pretrained": pretrained.lineage() if pretrained else None,
        "num_classes": len(split.classes),
        "classes": split.classes,
        "mean": split.mean,
        "std": split.std,
        "config": result_config(cfg),
        "seed": seed,
        "world_size": world_size,
    }


def cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of `module`'s state dict on the CPU, contiguous (what safetensors stores)."""
    return {k: v.detach().cpu().clone().contiguous() for k, v in module.state_dict().items()}


def checkpoint_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> bytes:
    """Tensors (CPU) as safetensors (no pickle), `metadata` as JSON in its header."""
    # One metadata key holding sorted JSON: safetensors stores the metadata map in hash order,
    # so several keys would make the file bytes (and their sha256) differ from run to run.
    # Serialised in memory and written by Python (not `save_file`, which writes from Rust): a full
    # disk then raises an OSError with its errno, which tasks.core.atomic reports naming the file.
    return serialize(tensors, metadata={"lockstep": json.dumps(metadata, sort_keys=True)})


def read_safetensors(path: Path, tensors: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The lockstep metadata and (if `tensors`) the tensors of a safetensors file written here.

    Only safetensors is ever read: a pickle (`torch.save`, with or without a payload) renamed to
    .safetensors is refused by its header, before a byte of it is interpreted as Python objects.
    A truncated file is refused too (the header names more bytes than there are).
    """
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata() or {}
        loaded = load_file(str(path)) if tensors else {}
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: not a readable safetensors file (truncated, corrupt, or another format such "
            f"as a pickle, which is never loaded): {exc}"
        ) from None
    try:
        return json.loads(header["lockstep"]), loaded
    except (KeyError, ValueError):
        raise CheckpointError(f"{path}: not a lockstep checkpoint (no valid 'lockstep' metadata)") from None


def load_checkpoint(path: Path, data: Preprocessed | None = None) -> tuple[Classifier, dict[str, Any]]:
    """Rebuild a `Classifier` from a checkpoint the train stage wrote.

    With `data`, the checkpoint must have been trained on data like it (same classes, same
    normalisation): a model from another dataset is refused by name rather than scored on this one.
    """
    metadata, state = read_safetensors(path)
    if data is not None:
        for key, here in (("classes", data.classes), ("mean", data.mean), ("std", data.std)):
            if metadata.get(key) != here:
                raise CheckpointError(
                    f"{path}: trained on other data ({key} {metadata.get(key)!r}, the preprocessed "
                    f"data has {here!r}); run the train stage again"
                )
    try:
        # image_size decides a torchvision model's stem; absent (older checkpoints): the small-input stem
        size = metadata.get("image_size")
        model = build_model(metadata["model"], metadata["num_classes"], metadata["mean"], metadata["std"], size)
        model.load_state_dict(state)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"{path}: weights do not fit model {metadata.get('model')!r}: {str(exc).splitlines()[0]}"
        ) from None
    return model, metadata
