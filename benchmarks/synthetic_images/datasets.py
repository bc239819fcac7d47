"""The four check datasets by name, and `generate`: n images of every class, each a function of its number."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from benchmarks.synthetic_images.drawing import Rng
from benchmarks.synthetic_images.garments import GARMENTS, garment
from benchmarks.synthetic_images.glyphs import glyph
from benchmarks.synthetic_images.shapes import SHAPES, SIZE_RGB, shape, shape100


@dataclass(frozen=True)
class Dataset:
    """A generator: `draw(label, rng)` -> one uint8 image of `shape` (H, W, C); labels index `classes`."""

    classes: tuple[str, ...]
    shape: tuple[int, int, int]
    draw: Callable[[int, Rng], np.ndarray]


DATASETS = {
    "glyphs": Dataset(tuple(str(d) for d in range(10)), (28, 28, 1), glyph),
    "shapes": Dataset(tuple(SHAPES), (SIZE_RGB, SIZE_RGB, 3), shape),
    "shapes100": Dataset(tuple(f"{k}_hue{h}" for k in SHAPES for h in range(10)), (SIZE_RGB, SIZE_RGB, 3), shape100),
    "garments": Dataset(tuple(GARMENTS), (28, 28, 1), garment),
}


def dataset_named(name: str) -> Dataset:
    """The dataset `name`; a ValueError that lists the names for any other."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}: one of {', '.join(DATASETS)}")
    return DATASETS[name]


def generate(name: str, n_per_class: int, seed: int = 0, start: int = 0) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """`n_per_class` images of every class of dataset `name`: (images (N, H, W, C) uint8, labels int64, classes).

    Classes are interleaved (0, 1, ..., 9, 0, 1, ...), so any prefix is balanced. The images of class
    `c` are numbers start, start + 1, ... of that class, each drawn from an rng seeded with (seed, c,
    number): disjoint ranges of numbers are disjoint sets, and a number is the same image in any call.
    """
    dataset = dataset_named(name)
    if n_per_class < 0 or seed < 0 or start < 0:
        raise ValueError(f"n_per_class, seed and start must be >= 0, not {n_per_class}, {seed}, {start}")
    k = len(dataset.classes)
    labels = np.tile(np.arange(k, dtype=np.int64), n_per_class)
    images = np.empty((len(labels), *dataset.shape), np.uint8)
    for i, label in enumerate(labels.tolist()):
        images[i] = dataset.draw(label, np.random.default_rng([seed, label, start + i // k])).reshape(dataset.shape)
    return images, labels, list(dataset.classes)
