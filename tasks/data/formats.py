"""The on-disk format every data source is ingested into (the split every stage agrees on: tasks/data/splits.py).

Raw snapshot (`data/`, tracked by DVC through data.dvc), format `lockstep-raw/1`:

    data/images.npy   uint8, shape (N, H, W, C), C = 1 (greyscale) or 3 (RGB), pixel values 0..255
    data/labels.npy   int64, shape (N,), values 0..num_classes-1
    data/meta.json    {"format", "source", "classes": [names...], "num_images", "image_shape": [H, W, C]},
                      plus "published_splits": {"train": [start, stop], ["val": ...,] "test": [...]} when
                      the source publishes its splits (MNIST, CIFAR, train/ val/ test/ folders): contiguous
                      row ranges in that order, covering every row once. Absent otherwise, so snapshots of
                      sources without them keep the bytes (and data.dvc) they always had.

Plain .npy so that later stages can read arbitrarily large sources in chunks (`NpyRows`) and
write them in chunks (`NpyWriter`), with no pickle involved. Files are written deterministically
(no timestamps), so ingesting the same source twice gives the same bytes and the same data.dvc.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np

from tasks.core.atomic import atomic_dir
from tasks.core.errors import ExpectedFailure

FORMAT = "lockstep-raw/1"
SPLITS = ("train", "val", "test")

# A source's own split: split name -> (start, stop) rows of the snapshot, in SPLITS order.
PublishedSplits = dict[str, tuple[int, int]]


class NpyWriter:
    """Write a uint8 .npy of known shape row-block by row-block, with plain file writes.

    Not `np.lib.format.open_memmap`: pages written through a shared mapping stay resident and are
    counted in the writer's RSS, so peak memory would grow with the dataset. Sequential writes
    keep it at one block.
    """

    def __init__(self, path: Path, shape: tuple[int, ...]) -> None:
        self.path, self.shape = Path(path), tuple(shape)
        self._row_bytes = int(np.prod(shape[1:], dtype=np.int64))
        self._rows = 0
        self._file: BinaryIO = open(self.path, "wb")  # noqa: SIM115 — closed in close()
        header = {
            "descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)),
            "fortran_order": False,
            "shape": self.shape,
        }
        np.lib.format.write_array_header_1_0(self._file, header)

    def write(self, block: np.ndarray) -> None:
        if block.dtype != np.uint8 or block.shape[1:] != self.shape[1:]:
            raise ValueError(f"{self.path}: block {block.dtype} {block.shape}, expected uint8 rows of {self.shape[1:]}")
        if self._rows + len(block) > self.shape[0]:
            raise ValueError(f"{self.path}: more than the {self.shape[0]} rows declared")
        self._file.write(np.ascontiguousarray(block).data)
        self._rows += len(block)

    def close(self) -> None:
        self._file.close()
        if self._rows != self.shape[0]:
            raise ValueError(f"{self.path}: {self._rows} rows written, {self.shape[0]} declared")

    def __enter__(self) -> NpyWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()  # the caller's staging directory is discarded anyway


class NpyRows:
    """Random access to the rows of a uint8 .npy through file reads, one block at a time.

    Not `np.load(mmap_mode="r")`: every page a process touches through a mapping stays in its RSS
    until the kernel needs it back, so a pass over a large file would look like (and, under a
    memory limit, be charged as) the whole file in memory. Reads land in a buffer of one block.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            version = np.lib.format.read_magic(handle)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in read_header:
                raise ExpectedFailure(f"{self.path}: .npy format version {version} is not supported")
            shape, fortran, dtype = read_header[version](handle)
            self._offset = handle.tell()
        if dtype != np.uint8 or fortran:
            raise ExpectedFailure(
                f"{self.path}: expected a C-ordered uint8 array, got {dtype} (fortran_order={fortran})"
            )
        self.shape: tuple[int, ...] = tuple(shape)
        self._row_bytes = int(np.prod(self.shape[1:], dtype=np.int64))
        expected = self._offset + self.shape[0] * self._row_bytes
        if self.path.stat().st_size != expected:
            raise ExpectedFailure(
                f"{self.path}: {self.path.stat().st_size} bytes, expected {expected}: truncated or corrupt"
            )

    def read(self, indices: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows `indices` (sorted ascending), into `out` if given; each run of consecutive rows is one read."""
        if out is None:
            out = np.empty((len(indices), *self.shape[1:]), dtype=np.uint8)
        flat, size = memoryview(out.reshape(-1)), self._row_bytes
        cuts = np.flatnonzero(np.diff(indices) != 1) + 1
        with open(self.path, "rb", buffering=0) as handle:
            for start, end in zip(np.r_[0, cuts], np.r_[cuts, len(indices)], strict=True):
                if start == end:
                    continue
                handle.seek(self._offset + int(indices[start]) * size)
                got = handle.readinto(flat[start * size : end * size])
                if got != (end - start) * size:
                    raise ExpectedFailure(
                        f"{self.path}: short read at row {indices[start]}: file changed while reading"
                    )
        return out

    def chunks(self, indices: np.ndarray, chunk_size: int) -> Iterator[np.ndarray]:
        """`read` over `indices` in blocks of `chunk_size` rows, all into one reused buffer.

        Each block is overwritten by the next: use it before asking for the next one. (Reusing
        one buffer, rather than allocating a block per step, also keeps the C allocator from
        holding on to freed blocks, which would show as RSS creeping up with the dataset size.)
        """
        buffer = np.empty((min(chunk_size, len(indices)), *self.shape[1:]), dtype=np.uint8)
        for start in range(0, len(indices), chunk_size):
            part = indices[start : start + chunk_size]
            yield self.read(part, buffer[: len(part)])

    def batches(self, size: int, per_read: int = 8) -> Iterator[np.ndarray]:
        """Every row, in order, `size` at a time, read `per_read` batches at once (a few reads of some
        MiB, not one per small batch). A batch is overwritten by a later read: use it first."""
        for block in self.chunks(np.arange(self.shape[0]), size * per_read):
            for start in range(0, len(block), size):
                yield block[start : start + size]


@dataclass(frozen=True)
class RawDataset:
    images: np.ndarray  # (N, H, W, C) uint8, memory-mapped when read from disk
    labels: np.ndarray  # (N,) int64
    classes: list[str]
    source: str
    published_splits: PublishedSplits | None = None  # the source's own train/[val/]test rows, if it has them


def write_raw(dataset: RawDataset, out_dir: Path) -> None:
    """Write an in-memory `dataset` to `out_dir` atomically (see `write_raw_blocks`)."""
    images, labels = dataset.images, dataset.labels
    write_raw_blocks(out_dir, [images], images.shape, labels, dataset.classes, dataset.source, dataset.published_splits)


def write_raw_blocks(
    out_dir: Path,
    blocks: Iterable[np.ndarray],
    shape: tuple[int, ...],
    labels: np.ndarray,
    classes: list[str],
    source: str,
    published_splits: PublishedSplits | None = None,
) -> None:
    """Write a snapshot whose images arrive as blocks of rows (streamed sources stay out of memory).

    Atomic: readers see the old snapshot or the complete new one; a failure (or a bad block)
    part-way leaves `out_dir` as it was.
    """
    if len(shape) != 4 or shape[-1] not in (1, 3):
        raise ValueError(f"images must be uint8 (N, H, W, C) with C in (1, 3), got shape {tuple(shape)}")
    if labels.shape != (shape[0],):
        raise ValueError(f"labels must have shape ({shape[0]},), got {labels.shape}")
    if len(labels) and not 0 <= labels.min() <= labels.max() < len(classes):
        raise ValueError(f"labels must lie in 0..{len(classes) - 1}")
    meta = {
        "format": FORMAT,
        "source": source,
        "classes": list(classes),
        "num_images": int(shape[0]),
        "image_shape": [int(n) for n in shape[1:]],
    }
    if published_splits is not None:
        problem = _published_problem(published_splits, int(shape[0]))
        if problem:
            raise ValueError(f"published_splits {published_splits!r}: {problem}")
        meta["published_splits"] = {
            name: [int(n) for n in published_splits[name]] for name in _in_order(published_splits)
        }
    with atomic_dir(Path(out_dir)) as staging:
        with NpyWriter(staging / "images.npy", tuple(shape)) as writer:
            for block in blocks:
                writer.write(block)
        np.save(staging / "labels.npy", labels.astype(np.int64), allow_pickle=False)
        (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def read_meta(folder: Path, expected_format: str, producer: str) -> dict[str, Any]:
    """`folder/meta.json`, checked to be of `expected_format`; errors say which stage makes it."""
    meta_path = Path(folder) / "meta.json"
    if not meta_path.exists():
        raise ExpectedFailure(f"{meta_path}: missing; run {producer} first")
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, OSError) as exc:
        raise ExpectedFailure(f"{meta_path}: unreadable ({exc}); run {producer} again") from None
    if not isinstance(meta, dict) or meta.get("format") != expected_format:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ExpectedFailure(f"{meta_path}: format is {found!r}, expected {expected_format!r}; run {producer} again")
    return meta


@dataclass(frozen=True)
class RawSnapshot:
    """A raw snapshot opened for streaming: images are read block by block through `rows`."""

    rows: NpyRows  # (N, H, W, C) uint8
    labels: np.ndarray  # (N,) int64
    classes: list[str]
    source: str
    published_splits: PublishedSplits | None = None


def _in_order(ranges: dict[str, Any]) -> list[str]:
    return [name for name in SPLITS if name in ranges]


def _published_problem(ranges: object, num_rows: int) -> str | None:
    """What is wrong with published split `ranges` for `num_rows` rows, or None when they are usable.

    A test set that overlapped the training set, or left rows out, would report an accuracy that
    means nothing; so the ranges must tile the rows exactly, train first, test last.
    """
    if not isinstance(ranges, dict) or not {"train", "test"} <= ranges.keys() <= set(SPLITS):
        return "must map train, test and optionally val to [start, stop] row ranges"
    stop = 0
    for name in _in_order(ranges):
        bounds = ranges[name]
        if not isinstance(bounds, list | tuple) or len(bounds) != 2 or not all(type(n) is int for n in bounds):
            return f"{name}: {bounds!r} is not a [start, stop] pair of integers"
        if bounds[0] != stop or not bounds[0] < bounds[1] <= num_rows:
            return f"{name}: {list(bounds)} must start at row {stop} and end after it, within the {num_rows} rows"
        stop = bounds[1]
    if stop != num_rows:
        return f"test ends at row {stop}, but the snapshot has {num_rows} rows (every row in exactly one split)"
    return None


def _read_published(meta: dict[str, Any], meta_path: Path, num_rows: int) -> PublishedSplits | None:
    if "published_splits" not in meta:
        return None
    ranges = meta["published_splits"]
    problem = _published_problem(ranges, num_rows)
    if problem:
        raise ExpectedFailure(f"{meta_path}: published_splits {ranges!r}: {problem}; run the download stage again")
    return {name: (ranges[name][0], ranges[name][1]) for name in _in_order(ranges)}


def open_raw(data_dir: Path) -> RawSnapshot:
    """Open a raw snapshot for streaming; errors name the file that is missing or wrong."""
    data_dir = Path(data_dir)
    meta = read_meta(data_dir, FORMAT, "the download stage (or `dvc pull`)")
    rows = NpyRows(data_dir / "images.npy")
    try:  # never unpickled: an object array (a pickle in disguise) is refused here
        labels = np.load(data_dir / "labels.npy", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise ExpectedFailure(f"{data_dir / 'labels.npy'}: not a readable label array: {exc}") from None
    if rows.shape[0] != labels.shape[0] or list(rows.shape[1:]) != meta["image_shape"]:
        raise ExpectedFailure(f"{data_dir}: images {rows.shape} and labels {labels.shape} disagree with meta.json")
    published = _read_published(meta, data_dir / "meta.json", int(labels.shape[0]))
    return RawSnapshot(rows, labels, list(meta["classes"]), meta["source"], published)


def read_raw(data_dir: Path) -> RawDataset:
    """A raw snapshot as arrays (images memory-mapped): for inspection and small sources."""
    snapshot = open_raw(data_dir)
    images = np.load(Path(data_dir) / "images.npy", mmap_mode="r", allow_pickle=False)
    return RawDataset(images, snapshot.labels, snapshot.classes, snapshot.source, snapshot.published_splits)
