"""Stage 3 — preprocess: split the raw snapshot and store it ready for fast training.

Output (`artifacts/preprocessed/`), format `lockstep-preprocessed/1`:

    {split}_images.npy   uint8, (N, C, H, W): channels-first, as torch wants them
    {split}_labels.npy   int64, (N,)
    meta.json            classes, image shape, split sizes, and the normalisation (mean, std)

Images stay uint8 (4x smaller than float32, no per-sample decoding): training normalises whole
batches on the device with the mean/std recorded here, which come from the stats stage.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tasks.atomic import atomic_dir
from tasks.config import SplitConfig
from tasks.data_format import SPLITS, NpyRows, NpyWriter, open_raw, read_meta, split_indices
from tasks.stats import ChannelStats

FORMAT = "lockstep-preprocessed/1"
CHUNK = 4096  # images copied per step, so peak memory stays at one chunk plus the output


@dataclass(frozen=True)
class PreprocessResult:
    split_sizes: dict[str, int]
    num_classes: int
    image_shape: tuple[int, int, int]  # (C, H, W)
    mean: list[float]
    std: list[float]


def preprocess(data_dir: Path, stats: ChannelStats, split: SplitConfig, seed: int, out_dir: Path) -> PreprocessResult:
    """Write the seeded, stratified splits of `data_dir` to `out_dir` (atomically)."""
    raw = open_raw(data_dir)
    _, height, width, channels = raw.rows.shape
    if len(stats.mean) != channels:
        raise ValueError(f"stats have {len(stats.mean)} channels, images have {channels}")
    indices = split_indices(raw.labels, split, seed)
    result = PreprocessResult(
        split_sizes={name: len(idx) for name, idx in indices.items()},
        num_classes=len(raw.classes),
        image_shape=(channels, height, width),
        mean=stats.mean,
        std=stats.std,
    )
    with atomic_dir(out_dir) as staging:
        for name in SPLITS:
            idx = indices[name]
            _write_channels_first(raw.rows, idx, staging / f"{name}_images.npy")
            np.save(staging / f"{name}_labels.npy", raw.labels[idx], allow_pickle=False)
        meta = {"format": FORMAT, "classes": raw.classes, **asdict(result)}
        (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return result


def _write_channels_first(rows: NpyRows, indices: np.ndarray, path: Path) -> None:
    """rows[indices] as (N, C, H, W), streamed in blocks through two reused buffers (freed on return)."""
    _, height, width, channels = rows.shape
    chw = np.empty((min(CHUNK, len(indices)), channels, height, width), dtype=np.uint8)
    with NpyWriter(path, (len(indices), channels, height, width)) as writer:
        for block in rows.chunks(indices, CHUNK):
            out = chw[: len(block)]
            np.copyto(out, block.transpose(0, 3, 1, 2))
            writer.write(out)


@dataclass(frozen=True)
class Preprocessed:
    """One split as loaded for training or evaluation."""

    images: np.ndarray  # (N, C, H, W) uint8
    labels: np.ndarray  # (N,) int64
    classes: list[str]
    mean: list[float]
    std: list[float]


def load_split(pre_dir: Path, name: str) -> Preprocessed:
    """Read one split written by `preprocess`; errors name the file that is missing or wrong."""
    pre_dir = Path(pre_dir)
    meta = read_meta(pre_dir, FORMAT, "the preprocess stage")
    images = np.load(pre_dir / f"{name}_images.npy", allow_pickle=False)
    labels = np.load(pre_dir / f"{name}_labels.npy", allow_pickle=False)
    expected = (meta["split_sizes"][name], *meta["image_shape"])
    if images.shape != expected or labels.shape != expected[:1]:
        raise ValueError(f"{pre_dir / f'{name}_images.npy'}: shape {images.shape}, expected {expected} (meta.json)")
    return Preprocessed(images, labels, list(meta["classes"]), list(meta["mean"]), list(meta["std"]))
