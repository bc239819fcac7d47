"""Stage 2 — stats: exact per-channel mean and std of the training split.

One streamed pass over the training images in chunks, accumulating Σx and Σx² per channel as exact
integers. Never the mean of per-image or per-batch stds (that is a different, wrong number), and
never a per-image Python loop. Memory stays at one chunk whatever the dataset size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.core.config.data import SplitConfig
from tasks.data.formats import open_raw
from tasks.data.splits import split_indices


@dataclass(frozen=True)
class ChannelStats:
    mean: list[float]  # per channel, pixel values scaled to [0, 1]
    std: list[float]  # population std (ddof=0), same scale
    num_images: int
    num_values_per_channel: int


def channel_stats(blocks: Iterable[np.ndarray]) -> ChannelStats:
    """Mean/std per channel over all images in `blocks` (each (n, H, W, C) uint8), one block at a time.

    Sums are kept as exact integers: Σx in uint64 and Σx² via uint16 squares (255² fits), so no
    float64 copy of a block is ever made (memory stays at ~3 bytes per pixel of one block) and the
    variance is computed exactly before the one final rounding to float.
    """
    total: list[int] = []
    total_sq: list[int] = []
    count = num_images = 0
    squares = np.empty(0, dtype=np.uint16)  # reused across blocks (see NpyRows.chunks for why)
    for block in blocks:
        values = block.reshape(-1, block.shape[-1])
        if not total:
            total, total_sq = [0] * values.shape[1], [0] * values.shape[1]
        if squares.size < values.size:
            squares = np.empty(values.size, dtype=np.uint16)
        squared = np.square(values, dtype=np.uint16, out=squares[: values.size].reshape(values.shape))
        sums = values.sum(axis=0, dtype=np.uint64)
        sq_sums = squared.sum(axis=0, dtype=np.uint64)
        total = [t + int(v) for t, v in zip(total, sums, strict=True)]
        total_sq = [t + int(v) for t, v in zip(total_sq, sq_sums, strict=True)]
        count += values.shape[0]
        num_images += len(block)
    if count == 0:
        raise ValueError("the training split is empty: cannot compute mean/std")
    # n²·var = n·Σx² − (Σx)², exact in Python integers; never the mean of per-batch stds.
    mean = [t / count / 255.0 for t in total]
    std = [math.sqrt((count * sq - t * t) / count**2) / 255.0 for t, sq in zip(total, total_sq, strict=True)]
    return ChannelStats(mean=mean, std=std, num_images=num_images, num_values_per_channel=count)


def compute_stats(data_dir: Path, split: SplitConfig, seed: int, chunk_size: int) -> ChannelStats:
    """Stats of the training split of the raw snapshot in `data_dir` (the split `preprocess` writes)."""
    raw = open_raw(data_dir)
    train_idx = split_indices(raw, split, seed, chunk_size=chunk_size)["train"]
    return channel_stats(raw.rows.chunks(train_idx, chunk_size))
