"""The on-disk format every data source is ingested into, and the split every stage agrees on.

Raw snapshot (`data/`, tracked by DVC through data.dvc), format `lockstep-raw/1`:

    data/images.npy   uint8, shape (N, H, W, C), C = 1 (greyscale) or 3 (RGB), pixel values 0..255
    data/labels.npy   int64, shape (N,), values 0..num_classes-1
    data/meta.json    {"format", "source", "classes": [names...], "num_images", "image_shape": [H, W, C]}

Plain .npy so that later stages can memory-map arbitrarily large sources and read them in chunks,
with no pickle involved (`allow_pickle=False`). Files are written deterministically (no
timestamps), so ingesting the same source twice gives the same bytes and the same data.dvc.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.atomic import atomic_dir
from tasks.config import SplitConfig

FORMAT = "lockstep-raw/1"
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class RawDataset:
    images: np.ndarray  # (N, H, W, C) uint8, memory-mapped when read from disk
    labels: np.ndarray  # (N,) int64
    classes: list[str]
    source: str


def write_raw(dataset: RawDataset, out_dir: Path) -> None:
    """Write `dataset` to `out_dir` atomically: readers see the old snapshot or the new one."""
    images, labels = dataset.images, dataset.labels
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ValueError(f"images must be uint8 (N, H, W, C) with C in (1, 3), got {images.dtype} {images.shape}")
    if labels.shape != (len(images),):
        raise ValueError(f"labels must have shape ({len(images)},), got {labels.shape}")
    if len(labels) and not 0 <= labels.min() <= labels.max() < len(dataset.classes):
        raise ValueError(f"labels must lie in 0..{len(dataset.classes) - 1}")
    meta = {
        "format": FORMAT,
        "source": dataset.source,
        "classes": dataset.classes,
        "num_images": len(images),
        "image_shape": list(images.shape[1:]),
    }
    with atomic_dir(Path(out_dir)) as staging:
        np.save(staging / "images.npy", np.ascontiguousarray(images), allow_pickle=False)
        np.save(staging / "labels.npy", labels.astype(np.int64), allow_pickle=False)
        (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def read_meta(folder: Path, expected_format: str, producer: str) -> dict[str, Any]:
    """`folder/meta.json`, checked to be of `expected_format`; errors say which stage makes it."""
    meta_path = Path(folder) / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{meta_path}: missing; run {producer} first")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != expected_format:
        raise ValueError(f"{meta_path}: format is {meta.get('format')!r}, expected {expected_format!r}")
    return meta


def read_raw(data_dir: Path) -> RawDataset:
    """Open a raw snapshot (images memory-mapped); errors name the file that is wrong."""
    data_dir = Path(data_dir)
    meta = read_meta(data_dir, FORMAT, "the download stage (or `dvc pull`)")
    images = np.load(data_dir / "images.npy", mmap_mode="r", allow_pickle=False)
    labels = np.load(data_dir / "labels.npy", allow_pickle=False)
    if images.shape[0] != labels.shape[0] or list(images.shape[1:]) != meta["image_shape"]:
        raise ValueError(f"{data_dir}: images {images.shape} and labels {labels.shape} disagree with meta.json")
    return RawDataset(images=images, labels=labels, classes=list(meta["classes"]), source=meta["source"])


def split_indices(labels: np.ndarray, split: SplitConfig, seed: int) -> dict[str, np.ndarray]:
    """Seeded, stratified train/val/test indices (each sorted, so chunked reads stay sequential).

    Both the stats stage (train split only) and the preprocess stage call this, so they agree on
    which images are training images without passing index files between them.

    Written with numpy rather than sklearn's `train_test_split`: importing sklearn costs ~3 s in
    every stage process, and the algorithm is a per-class shuffle and cut.
    """
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in SPLITS}
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        n_test = int(round(len(members) * split.test))
        n_val = int(round(len(members) * split.val))
        parts["test"].append(members[:n_test])
        parts["val"].append(members[n_test : n_test + n_val])
        parts["train"].append(members[n_test + n_val :])
    return {name: np.sort(np.concatenate(chunks)) if chunks else np.empty(0, np.int64)
            for name, chunks in parts.items()}  # fmt: skip
