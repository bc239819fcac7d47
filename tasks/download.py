"""Stage 1 — download: ingest a data source into `data/` (format in tasks/data_format.py).

The default source, scikit-learn's digits, ships inside the scikit-learn package, so this works
offline. Sources with real downloads (MNIST, CIFAR, ImageFolder archives) plug in as further
entries of `SOURCES`, each returning a `RawDataset`; nothing downstream changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.config import DataConfig
from tasks.data_format import RawDataset, read_raw, write_raw


def _digits() -> RawDataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    # Pixel values are counts 0..16 of a 4x4 block; rescale exactly onto the common 0..255 range.
    images = np.rint(bunch.images * (255.0 / 16.0)).astype(np.uint8)[..., np.newaxis]
    return RawDataset(
        images=images,
        labels=bunch.target.astype(np.int64),
        classes=[str(name) for name in bunch.target_names],
        source="digits",
    )


SOURCES: dict[str, Callable[[], RawDataset]] = {"digits": _digits}


@dataclass(frozen=True)
class DownloadResult:
    source: str
    num_images: int
    num_classes: int
    image_shape: tuple[int, ...]


def download(cfg: DataConfig, out_dir: Path) -> DownloadResult:
    """Ingest `cfg.source` into `out_dir`, replacing any previous snapshot atomically."""
    dataset = SOURCES[cfg.source]()
    write_raw(dataset, out_dir)
    written = read_raw(out_dir)  # read back: what later stages will see
    return DownloadResult(
        source=written.source,
        num_images=len(written.labels),
        num_classes=len(written.classes),
        image_shape=tuple(written.images.shape[1:]),
    )
