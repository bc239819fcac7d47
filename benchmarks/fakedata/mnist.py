"""MNIST's four gzipped IDX files, as torchvision downloads them: noise images (or given ones), cyclic labels."""

from __future__ import annotations

import gzip
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.fakedata.files import gzip_bytes, md5_bytes, sha256_bytes, write_file
from benchmarks.fakedata.labels import Given, cyclic_labels


@dataclass(frozen=True)
class MnistFiles:
    """What :func:`mnist_files` wrote. ``resources`` has the shape of ``torchvision.datasets.MNIST.resources``."""

    dest: Path
    resources: list[tuple[str, str]]  # (file name, md5 of the .gz file)
    train_images: np.ndarray  # (n_train, 28, 28) uint8
    train_labels: np.ndarray  # (n_train,) uint8
    test_images: np.ndarray  # (n_test, 28, 28) uint8
    test_labels: np.ndarray  # (n_test,) uint8
    sha256: dict[str, str] = field(default_factory=dict)  # file name -> sha256 of the .gz file

    @property
    def paths(self) -> list[Path]:
        """The four .gz files, in ``resources`` order."""
        return [self.dest / name for name, _ in self.resources]

    def extract_to(self, raw_dir: Path) -> list[Path]:
        """Gunzip the files into ``raw_dir`` under their names without ``.gz`` (what torchvision reads)."""
        raw_dir = Path(raw_dir)
        raw_dir.mkdir(parents=True, exist_ok=True)
        out = []
        for path in self.paths:
            out.append(write_file(raw_dir / path.name.removesuffix(".gz"), gzip.decompress(path.read_bytes())))
        return out


def idx_bytes(array: np.ndarray) -> bytes:
    """Encode a uint8 array in IDX format: magic ``0x0000 08 <ndim>`` then big-endian uint32 dims, then data."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    # 0x08 = unsigned byte; 2049 / 2051 are the magics for 1-d labels / 3-d images.
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes(order="C")


def mnist_files(
    dest: Path, n_train: int = 60, n_test: int = 20, seed: int = 0, num_classes: int = 10, given: Given | None = None
) -> MnistFiles:
    """Write the four gzipped IDX files of MNIST into ``dest``.

    Images are uniform noise; labels cycle ``0..num_classes-1`` so both parts contain every class whenever
    ``n >= num_classes`` (the defaults do). Raises ``ValueError`` if ``n_train < num_classes``. With
    ``given`` ((N, 28, 28) uint8 images and their labels), those are written instead (n_* ignored).
    """
    if not 1 <= num_classes <= 256:
        raise ValueError(f"num_classes must be in 1..256 (labels are uint8), got {num_classes}")
    if n_train < num_classes or n_test < 0:
        raise ValueError(f"need n_train >= num_classes ({num_classes}) and n_test >= 0")
    dest = Path(dest)
    rng = np.random.default_rng(seed)
    train_images = rng.integers(0, 256, size=(n_train, 28, 28), dtype=np.uint8)
    test_images = rng.integers(0, 256, size=(n_test, 28, 28), dtype=np.uint8)
    train_labels = cyclic_labels(n_train, num_classes).astype(np.uint8)
    test_labels = cyclic_labels(n_test, num_classes).astype(np.uint8)
    if given is not None:
        train_images, train_labels, test_images, test_labels = (a.astype(np.uint8) for a in given)

    contents = {
        "train-images-idx3-ubyte.gz": train_images,
        "train-labels-idx1-ubyte.gz": train_labels,
        "t10k-images-idx3-ubyte.gz": test_images,
        "t10k-labels-idx1-ubyte.gz": test_labels,
    }
    resources: list[tuple[str, str]] = []
    sha: dict[str, str] = {}
    for name, array in contents.items():
        data = gzip_bytes(idx_bytes(array))
        write_file(dest / name, data)
        resources.append((name, md5_bytes(data)))
        sha[name] = sha256_bytes(data)
    return MnistFiles(dest, resources, train_images, train_labels, test_images, test_labels, sha)
