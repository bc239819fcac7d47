"""The on-disk format every data source is ingested into, and the split every stage agrees on.

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

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np

from tasks.core.atomic import atomic_dir
from tasks.core.config.data import SplitConfig
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


def content_digests(rows: NpyRows, chunk_size: int = 4096) -> np.ndarray:
    """(N, 16) uint8: a BLAKE2b-128 digest of each image's bytes (shape and pixels; not its label).

    What "the same image" means wherever the pipeline asks: which split an image belongs to
    (`split.assign: hash`) and which images are copies of each other (tasks/data/checks.py).
    """
    digests = np.empty((rows.shape[0], 16), dtype=np.uint8)
    for start, block in zip(
        range(0, rows.shape[0], chunk_size), rows.chunks(np.arange(rows.shape[0]), chunk_size), strict=True
    ):
        digests[start : start + len(block)] = _block_digests(block)
    return digests


def _block_digests(block: np.ndarray) -> np.ndarray:
    """`content_digests` of a block of rows. Copying one primed hasher, over memoryview slices of the
    block, rather than a new hasher over each row's `tobytes()`: the per-image Python overhead dominates
    for small images (3-5x faster on 8x8 digits; the same digests)."""
    shape = repr(tuple(block.shape[1:])).encode()  # a 28x28 image and a 14x56 one with the same bytes differ
    size = int(np.prod(block.shape[1:], dtype=np.int64))
    empty = hashlib.blake2b(digest_size=16, person=b"lockstep-image")
    pixels, out = memoryview(np.ascontiguousarray(block).reshape(-1)), []
    for row in range(len(block)):
        digest = empty.copy()
        digest.update(pixels[row * size : (row + 1) * size])
        digest.update(shape)
        out.append(digest.digest())
    return np.frombuffer(b"".join(out), dtype=np.uint8).reshape(-1, 16)


def content_positions(rows: NpyRows, indices: np.ndarray, seed: int, chunk_size: int = 4096) -> np.ndarray:
    """`hash_positions` of rows `indices` (ascending), a block at a time: no digest outlives its block."""
    positions = np.empty(len(indices), dtype=np.float64)
    for start, block in zip(range(0, len(indices), chunk_size), rows.chunks(indices, chunk_size), strict=True):
        positions[start : start + len(block)] = hash_positions(_block_digests(block), seed)
    return positions


def split_indices(
    snapshot: RawSnapshot,
    split: SplitConfig,
    seed: int,
    digests: np.ndarray | None = None,
    chunk_size: int = 4096,
) -> dict[str, np.ndarray]:
    """Train/val/test indices of `snapshot` (each sorted, so chunked reads stay sequential).

    With the snapshot's own published splits and `split.published`, test is exactly the published
    test set, as papers report, and so is val when one is published; otherwise val is cut from the
    published train set (a val/(train + val) share). Without them, all three are cut from all images.
    A cut is `split.assign`: `hash` sends each image where a seeded hash of its content says
    (`hash_positions`), so images added later never move an existing one and copies of an image
    share a split; `random` is a seeded, stratified shuffle (exact class fractions).

    `digests` (`content_digests` of the snapshot) saves the streamed digest pass when the caller has
    them already. Both the stats stage (train split only) and the preprocess stage call this, so they
    agree on which images are training images without passing index files between them.
    """
    labels = snapshot.labels
    published = snapshot.published_splits if split.published else None
    if published is not None and "val" in published:  # nothing to cut: every split is the source's own
        return {name: np.arange(*published[name]) for name in SPLITS}
    if published is None:
        candidates, fractions = np.arange(len(labels)), (split.test, split.val)
    else:
        candidates, fractions = np.arange(*published["train"]), (split.val / (split.train + split.val),)
    if split.assign == "random":
        # the generator is made here, as before `assign` existed, so the same seed gives the same indices
        cuts = _stratified(candidates, labels, fractions, np.random.default_rng(seed))
    else:
        if digests is None:  # memory: 8 bytes an image, not the digests' 16 and their copies
            positions = content_positions(snapshot.rows, candidates, seed, chunk_size)
        else:
            positions = hash_positions(digests if published is None else digests[candidates], seed)
        cuts = _by_position(candidates, positions, fractions)
    if published is None:
        test, val, train = cuts
    else:
        (val, train), test = cuts, np.arange(*published["test"])
    return {"train": train, "val": val, "test": test}


def hash_positions(digests: np.ndarray, seed: int) -> np.ndarray:
    """(N,) float64 in [0, 1): where each image (by its `content_digests` row) falls, for `seed`.

    BLAKE2b keyed with the seed: a function of the image's content and the seed alone, so an image
    keeps its position whatever else is in the snapshot, and another seed gives independent positions.
    The top 53 bits of the first 8 bytes make an exact float64 (the same on every machine).
    """
    keyed = hashlib.blake2b(digest_size=8, key=seed.to_bytes(8, "little"), person=b"lockstep-split")
    positions, width = np.empty(len(digests), dtype=np.float64), digests.shape[1]
    for first in range(0, len(digests), 65536):  # a block at a time: a bytes object per image is ~50 bytes
        data, words = memoryview(np.ascontiguousarray(digests[first : first + 65536]).reshape(-1)), []
        for start in range(0, len(data), width):
            position = keyed.copy()  # a copy of the keyed hasher: cheaper than keying a new one per image
            position.update(data[start : start + width])
            words.append(position.digest())
        as_integers = np.frombuffer(b"".join(words), dtype="<u8")
        positions[first : first + len(words)] = (as_integers >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return positions


def _by_position(indices: np.ndarray, positions: np.ndarray, fractions: tuple[float, ...]) -> list[np.ndarray]:
    """`indices` cut by their `positions`: [0, f1) first, [f1, f1 + f2) next, ..., the rest last."""
    which = np.searchsorted(np.cumsum(fractions), positions, side="right")
    return [indices[which == cut] for cut in range(len(fractions) + 1)]


def _stratified(
    indices: np.ndarray, labels: np.ndarray, fractions: tuple[float, ...], rng: np.random.Generator
) -> list[np.ndarray]:
    """`indices` cut per class: a seeded shuffle, then `fractions` of each class in turn, the rest last.

    Written with numpy rather than sklearn's `train_test_split`: importing sklearn costs ~3 s in
    every stage process, and the algorithm is a per-class shuffle and cut.
    """
    cuts: list[list[np.ndarray]] = [[] for _ in range(len(fractions) + 1)]
    own = labels[indices]
    for cls in np.unique(own):
        members = rng.permutation(indices[own == cls])
        start = 0
        for cut, fraction in zip(cuts, fractions, strict=False):
            size = int(round(len(members) * fraction))
            cut.append(members[start : start + size])
            start += size
        cuts[-1].append(members[start:])
    return [np.sort(np.concatenate(cut)) if cut else np.empty(0, np.int64) for cut in cuts]
