"""The split every stage agrees on: which images are train, val and test, and what "the same image" is.

`split_indices` is called by the stats stage (train split only), the preprocess stage and the data
checks, so they agree on which images are training images without passing index files between them.
An image's identity is a digest of its content (`content_digests`): where it goes under
`split.assign: hash`, and which images are copies of each other.
"""

from __future__ import annotations

import hashlib

import numpy as np

from tasks.core.config.data import SplitConfig
from tasks.data.formats import SPLITS, NpyRows, RawSnapshot


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


def _content_cuts(
    rows: NpyRows, first: int, stop: int, seed: int, fractions: tuple[float, ...], chunk_size: int
) -> np.ndarray:
    """(stop - first,) uint8: which cut (`_cuts`) each of rows first..stop-1 falls in, by its content,
    a block at a time. Memory: one byte an image; no digest, position or index outlives its block (a
    float64 position and an int64 index an image were 16 of B7's 34 MiB over 920,000 images)."""
    which = np.empty(stop - first, dtype=np.uint8)
    buffer = np.empty((min(chunk_size, stop - first), *rows.shape[1:]), dtype=np.uint8)  # see NpyRows.chunks
    for start in range(first, stop, chunk_size):
        block = rows.read(np.arange(start, min(start + chunk_size, stop)), buffer[: min(chunk_size, stop - start)])
        which[start - first : start - first + len(block)] = _cuts(
            hash_positions(_block_digests(block), seed), fractions
        )
    return which


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
        (first, stop), fractions = (0, len(labels)), (split.test, split.val)
    else:
        (first, stop), fractions = published["train"], (split.val / (split.train + split.val),)
    if split.assign == "random":
        # the generator is made here, as before `assign` existed, so the same seed gives the same indices
        cuts = _stratified(np.arange(first, stop), labels, fractions, np.random.default_rng(seed))
    else:
        if digests is None:  # memory: a byte an image, not the digests' 16 and their copies
            which = _content_cuts(snapshot.rows, first, stop, seed, fractions, chunk_size)
        else:
            which = _cuts(hash_positions(digests[first:stop], seed), fractions)
        cuts = [np.flatnonzero(which == cut) + first for cut in range(len(fractions) + 1)]
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


def _cuts(positions: np.ndarray, fractions: tuple[float, ...]) -> np.ndarray:
    """uint8 per position: 0 for [0, f1), 1 for [f1, f1 + f2), ..., len(fractions) for the rest."""
    return np.searchsorted(np.cumsum(fractions), positions, side="right").astype(np.uint8)


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
