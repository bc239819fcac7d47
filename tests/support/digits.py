"""sklearn's digits as the files users bring: an image folder, as the image-folder source reads it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
from PIL import Image


def write_digits(folder: Path, indices: Iterable[int]) -> None:
    """sklearn's digits as an image folder: <folder>/<label>/<index>.png, 8x8 greyscale."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i in indices:
        path = folder / str(digits.target[i]) / f"{i:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray((digits.images[i] * 255 / 16).round().astype(np.uint8), mode="L").save(path)
