"""Pruning for the compress stage, with torch's own `torch.nn.utils.prune`.

Pruning installs a mask beside each weight (`weight = weight_orig * weight_mask`), so fine-tuning
keeps the pruned weights at exactly zero; `make_permanent` then bakes the zeros into the plain
weights and drops the masks, leaving an ordinary module that exports like any other.
"""

from __future__ import annotations

from torch import nn
from torch.nn.utils import prune


def _weighted(model: nn.Module, types: tuple[type[nn.Module], ...] = (nn.Conv2d, nn.Linear)) -> list[nn.Module]:
    return [module for module in model.modules() if isinstance(module, types)]


def global_l1(model: nn.Module, amount: float) -> None:
    """Zero the `amount` fraction of all conv and linear weights with the smallest |w|, ranked
    across layers (global), so layers that matter less give up more."""
    prune.global_unstructured([(m, "weight") for m in _weighted(model)], pruning_method=prune.L1Unstructured,
                              amount=amount)  # fmt: skip


def conv_channels_ln(model: nn.Module, amount: float, norm: int) -> None:
    """Zero the `amount` fraction of each conv's output channels with the smallest L-`norm`.

    The classifier's output rows are classes, so linear layers are left whole.
    """
    for conv in _weighted(model, (nn.Conv2d,)):
        prune.ln_structured(conv, "weight", amount=amount, n=norm, dim=0)


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
