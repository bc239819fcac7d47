"""Stage 2 — stats: exact per-channel mean and std of the training split.

One streamed pass over the training images in chunks, accumulating Σx and Σx² per channel in
float64. Never the mean of per-image or per-batch stds (that is a different, wrong number), and
never a per-image Python loop. Memory stays at one chunk whatever the dataset size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.config import SplitConfig
from tasks.data_format import read_raw, split_indices


@dataclass(frozen=True)
class ChannelStats:
    mean: list[float]  # per channel, pixel values scaled to [0, 1]
    std: list[float]  # population std (ddof=0), same scale
    num_images: int
    num_values_per_channel: int


def channel_stats(images: np.ndarray, indices: np.ndarray, chunk_size: int) -> ChannelStats:
    """Mean/std per channel of `images[indices]` ((N, H, W, C) uint8), read `chunk_size` at a time."""
    channels = images.shape[-1]
    total = np.zeros(channels, dtype=np.float64)
    total_sq = np.zeros(channels, dtype=np.float64)
    count = 0
    for start in range(0, len(indices), chunk_size):
        chunk = np.asarray(images[indices[start : start + chunk_size]], dtype=np.float64)
        values = chunk.reshape(-1, channels)
        total += values.sum(axis=0)
        total_sq += np.einsum("ij,ij->j", values, values)
        count += values.shape[0]
    if count == 0:
        raise ValueError("the training split is empty: cannot compute mean/std")
    # Pixel values are integers <= 255, so both sums are exact in float64 up to ~2**53 / 65025
    # values per channel; the variance formula therefore loses nothing to cancellation here.
    mean = total / count
    var = np.maximum(total_sq / count - mean * mean, 0.0)
    return ChannelStats(
        mean=(mean / 255.0).tolist(),
        std=(np.sqrt(var) / 255.0).tolist(),
        num_images=len(indices),
        num_values_per_channel=count,
    )


def compute_stats(data_dir: Path, split: SplitConfig, seed: int, chunk_size: int) -> ChannelStats:
    """Stats of the training split of the raw snapshot in `data_dir`."""
    raw = read_raw(data_dir)
    train_idx = split_indices(raw.labels, split, seed)["train"]
    return channel_stats(raw.images, train_idx, chunk_size)
