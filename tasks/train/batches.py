"""The training batches: which samples each step sees, on every rank, and how classes are weighed
(`train.class_balance`).

The train stage reads the split's uint8 rows from their file as each batch needs them (a split larger
than memory trains; tasks/data/preprocess.py), others hold it in memory; the DataLoader fetches whole
batches (`__getitems__`, tasks/train/augment.py), and the model normalises on the device. No PIL.
The order is a function of (seed, epoch) alone, set through the sampler's `set_epoch`, and one
sampler shards it across DDP ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler

from tasks.core.config.train import TrainConfig
from tasks.data.preprocess import Preprocessed
from tasks.determinism.pinning import loader_kwargs
from tasks.train.augment import augmented_batches
from tasks.train.devices import Distributed


class BalancedSampler(Sampler[int]):
    """Each epoch, as many samples as the split has, drawn with replacement so that every class present
    is drawn equally often on average (`train.class_balance: sampler`), and sharded across ranks.

    numpy's generator, seeded by (seed, epoch): its draws are the same on every machine, and a resumed
    run draws the epoch it resumes at as the uninterrupted run did.
    """

    def __init__(self, labels: np.ndarray, num_replicas: int, rank: int, seed: int) -> None:
        counts = np.bincount(labels)
        self.weights = (1.0 / counts[labels]).astype(np.float64)
        self.weights /= self.weights.sum()
        self.per_rank = math.ceil(len(labels) / num_replicas)
        self.num_replicas, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.per_rank

    def __iter__(self) -> Iterator[int]:
        rng = np.random.default_rng([self.seed, self.epoch])
        drawn = rng.choice(len(self.weights), size=self.per_rank * self.num_replicas, replace=True, p=self.weights)
        return iter(drawn[self.rank :: self.num_replicas].tolist())


def class_weights(labels: np.ndarray, num_classes: int) -> torch.Tensor:
    """Inverse-frequency loss weights (`train.class_balance: loss`): n / (classes present x count), so a
    balanced split weighs every class 1; a class the split lacks weighs 0 (it never appears as a target)."""
    counts = np.bincount(labels, minlength=num_classes).astype(np.float64)
    present = counts > 0
    weights = np.zeros(num_classes)
    weights[present] = len(labels) / (present.sum() * counts[present])
    return torch.tensor(weights, dtype=torch.float32)


def build_loader(
    split: Preprocessed, cfg: TrainConfig, seed: int, ranks: Distributed, device: torch.device
) -> tuple[DistributedSampler | BalancedSampler, DataLoader]:
    """The sampler (to `set_epoch` before each epoch) and the loader of this rank's batches."""
    dataset = augmented_batches(split, cfg, seed)
    sampler: DistributedSampler | BalancedSampler
    if cfg.class_balance == "sampler":
        sampler = BalancedSampler(split.labels, ranks.world_size, ranks.rank, seed)
    else:
        # The shuffle order is a function of (seed, epoch) alone, not of how much the loader's
        # generator has been drawn from.
        sampler = DistributedSampler(dataset, num_replicas=ranks.world_size, rank=ranks.rank, shuffle=True, seed=seed)
    loader = DataLoader(
        dataset,
        batch_size=cfg.batch_size // ranks.world_size,
        sampler=sampler,
        num_workers=cfg.num_workers,
        persistent_workers=cfg.num_workers > 0,
        collate_fn=_whole_batches,
        pin_memory=device.type == "cuda",
        # forkserver, not fork: workers forked from an orchestrator's process (Prefect's threads and
        # handlers) died at shutdown; a forkserver child starts clean. Costs one import of torch.
        multiprocessing_context="forkserver" if cfg.num_workers > 0 else None,
        **loader_kwargs(seed),
    )
    return sampler, loader


def _whole_batches(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch  # __getitems__ already returns stacked tensors
