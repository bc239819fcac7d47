"""Stage 3 — preprocess: split the raw snapshot and store it ready for fast training.

Output (`artifacts/preprocessed/`), format `lockstep-preprocessed/2`:

    {split}_images.npy   uint8, (N, C, H, W): channels-first, as torch wants them
    {split}_labels.npy   int64, (N,)
    meta.json            classes, image shape, split sizes, which splits are the source's published
                         ones, how the others were cut (`split_assign`: hash or random), the
                         normalisation (mean, std), and the sha256 of every array file, checked by
                         `load_split` before any use

Images stay uint8 (4x smaller than float32, no per-sample decoding): training normalises whole
batches on the device with the mean/std recorded here, which come from the stats stage.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tasks.core.atomic import atomic_dir
from tasks.core.config.data import SplitConfig
from tasks.core.errors import ExpectedFailure
from tasks.core.hashing import file_digest
from tasks.data.formats import SPLITS, NpyRows, NpyWriter, PublishedSplits, open_raw, read_meta
from tasks.data.splits import split_indices
from tasks.data.stats import ChannelStats

FORMAT = "lockstep-preprocessed/2"
CHUNK = 4096  # images copied per step, so peak memory stays at one chunk plus the output


@dataclass(frozen=True)
class PreprocessResult:
    split_sizes: dict[str, int]
    num_classes: int
    image_shape: tuple[int, int, int]  # (C, H, W)
    mean: list[float]
    std: list[float]
    # the splits that are the source's own (["test"]: its published test set), [] when all are seeded
    # cuts: which test set a test accuracy is measured on
    published: list[str]
    # how the splits that are not published were cut (`split.assign`): by content hash, which keeps
    # them stable as the data grows, or by a seeded stratified shuffle
    split_assign: str


def preprocess(data_dir: Path, stats: ChannelStats, split: SplitConfig, seed: int, out_dir: Path) -> PreprocessResult:
    """Write the splits of `data_dir` (see `split_indices`) to `out_dir` (atomically)."""
    raw = open_raw(data_dir)
    _, height, width, channels = raw.rows.shape
    if len(stats.mean) != channels:
        raise ValueError(f"stats have {len(stats.mean)} channels, images have {channels}")
    published = raw.published_splits if split.published else None
    indices = split_indices(raw, split, seed, chunk_size=CHUNK)
    result = PreprocessResult(
        split_sizes={name: len(idx) for name, idx in indices.items()},
        num_classes=len(raw.classes),
        image_shape=(channels, height, width),
        mean=stats.mean,
        std=stats.std,
        published=_as_published(published),
        split_assign=split.assign,
    )
    with atomic_dir(out_dir) as staging:
        for name in SPLITS:
            idx = indices[name]
            _write_channels_first(raw.rows, idx, staging / f"{name}_images.npy")
            np.save(staging / f"{name}_labels.npy", raw.labels[idx], allow_pickle=False)
        digests = {path.name: file_digest(path) for path in sorted(staging.glob("*.npy"))}
        meta = {"format": FORMAT, "classes": raw.classes, **asdict(result), "sha256": digests}
        (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return result


def _as_published(published: PublishedSplits | None) -> list[str]:
    """The splits that are exactly the source's own: train is only once val is its own too."""
    if published is None:
        return []
    return list(published) if "val" in published else ["test"]


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

    images: np.ndarray | NpyRows  # (N, C, H, W) uint8; NpyRows: read from the file as they are needed
    labels: np.ndarray  # (N,) int64
    classes: list[str]
    mean: list[float]
    std: list[float]


def load_split(pre_dir: Path, name: str, stream: bool = False) -> Preprocessed:
    """Read one split written by `preprocess`; errors name the file that is missing or wrong.

    `stream`: the images stay in their file and are read as batches need them (`NpyRows`), so a split
    larger than memory trains, and this process's memory does not grow with the data (the kernel's
    page cache keeps what it can). Otherwise they are loaded whole.
    """
    pre_dir = Path(pre_dir)
    meta = read_meta(pre_dir, FORMAT, "the preprocess stage")
    images = _load_verified(pre_dir / f"{name}_images.npy", meta, stream)
    labels = _load_verified(pre_dir / f"{name}_labels.npy", meta)
    expected = (meta["split_sizes"][name], *meta["image_shape"])
    if images.shape != expected or labels.shape != expected[:1]:
        raise ExpectedFailure(
            f"{pre_dir / f'{name}_images.npy'}: shape {images.shape}, expected {expected} (meta.json)"
        )
    return Preprocessed(images, labels, list(meta["classes"]), list(meta["mean"]), list(meta["std"]))


def take_rows(images: np.ndarray | NpyRows, indices: np.ndarray | list[int]) -> np.ndarray:
    """`images[indices]`, in the order given (repeats too), from memory or from the file."""
    if not isinstance(images, NpyRows):
        return images[np.asarray(indices)]
    order = np.argsort(indices, kind="stable")  # the file is read in ascending order, a run at a time
    rows = images.read(np.asarray(indices)[order])
    taken = np.empty_like(rows)
    taken[order] = rows
    return taken


def read_rows(images: np.ndarray | NpyRows, indices: np.ndarray, block: int) -> Iterator[np.ndarray]:
    """`images[indices]` (ascending) in blocks of `block` rows, from memory or from the file; a block
    read from the file is overwritten by the next, so use it before asking for the next one."""
    if isinstance(images, NpyRows):
        yield from images.chunks(indices, block)
        return
    for start in range(0, len(indices), block):
        yield images[indices[start : start + block]]


def in_batches(images: np.ndarray | NpyRows, size: int) -> Iterator[np.ndarray]:
    """All of `images`, in order, `size` rows at a time: slices of an array in memory, or batches read
    from the file (`NpyRows.batches`: use each before asking for the next)."""
    if isinstance(images, NpyRows):
        yield from images.batches(size)
        return
    for start in range(0, len(images), size):
        yield images[start : start + size]


def _load_verified(path: Path, meta: dict, stream: bool = False) -> np.ndarray | NpyRows:
    """An array file of the preprocessed set, refused unless its bytes are the ones preprocess wrote.

    Shape checks catch a truncated file; only the digest catches a changed byte (a disk error, a
    copy cut short, a hand edit), which would otherwise train a model on silently different data.
    """
    expected = meta.get("sha256", {}).get(path.name)
    if not path.exists():
        raise ExpectedFailure(f"{path}: missing; run the preprocess stage again")
    if expected is None or file_digest(path) != expected:
        raise ExpectedFailure(
            f"{path}: its sha256 does not match meta.json (corrupt or changed since preprocess wrote "
            "it); run the preprocess stage again (`dvc repro` does so by itself)"
        )
    try:
        return NpyRows(path) if stream else np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise ExpectedFailure(f"{path}: not a readable array: {exc}") from None
