"""Pruning for the compress stage.

Unstructured (`global_l1`) uses torch's own `torch.nn.utils.prune`: a mask beside each weight
(`weight = weight_orig * weight_mask`) keeps the pruned weights at exactly zero while fine-tuning;
`make_permanent` then bakes the zeros into the plain weights and drops the masks.

Structured (`conv_channels_ln`) removes whole conv output channels, so the model really gets
smaller and faster (zeroed channels would still be computed by every runtime). Removing a channel
means cutting the BatchNorm after it and the input of every layer that reads it, across residual
additions too; torch-pruning's dependency graph does exactly that, for any torchvision-style model.
"""

from __future__ import annotations

import torch
import torch_pruning as tp
from torch import nn
from torch.nn.utils import prune


def _weighted(model: nn.Module, types: tuple[type[nn.Module], ...] = (nn.Conv2d, nn.Linear)) -> list[nn.Module]:
    return [module for module in model.modules() if isinstance(module, types)]


def global_l1(model: nn.Module, amount: float) -> None:
    """Zero the `amount` fraction of all conv and linear weights with the smallest |w|, ranked
    across layers (global), so layers that matter less give up more."""
    prune.global_unstructured(
        [(m, "weight") for m in _weighted(model)], pruning_method=prune.L1Unstructured, amount=amount
    )


def conv_channels_ln(model: nn.Module, amount: float, norm: int, example: torch.Tensor) -> None:
    """Remove the `amount` fraction of each conv's output channels with the smallest L-`norm`
    (of the conv's own filter), with everything that depends on them.

    The classifier's output rows are classes, so linear layers keep their outputs.
    """
    importance = tp.importance.GroupMagnitudeImportance(p=norm, group_reduction="first")
    pruner = tp.pruner.MetaPruner(
        model, example, importance=importance, pruning_ratio=amount, ignored_layers=_weighted(model, (nn.Linear,))
    )
    pruner.step()


def make_permanent(model: nn.Module) -> None:
    """Replace every mask-and-original pair by the masked weight itself."""
    for module in _weighted(model):
        if prune.is_pruned(module) and hasattr(module, "weight_orig"):
            prune.remove(module, "weight")


def sparsity(model: nn.Module) -> float:
    """Fraction of exact zeros over all conv and linear weights."""
    weights = [module.weight for module in _weighted(model)]
    total = sum(w.numel() for w in weights)
    return sum(int((w == 0).sum()) for w in weights) / total if total else 0.0
