"""The CIFAR-10 and CIFAR-100 python archives, as torchvision downloads them: pickled batches in a tar.gz."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from benchmarks.fakedata.archives import dir_info, file_info, tar_gz
from benchmarks.fakedata.files import md5_bytes, sha256_bytes, write_file
from benchmarks.fakedata.labels import (
    CIFAR10_LABEL_NAMES,
    CIFAR100_COARSE_LABEL_NAMES,
    CIFAR100_FINE_LABEL_NAMES,
    CIFAR100_FINE_TO_COARSE,
    Given,
    cyclic_labels,
)


@dataclass(frozen=True)
class CifarArchive:
    """What :func:`cifar_archive` wrote; ``train_list``/``test_list``/``meta`` mirror torchvision's attributes."""

    path: Path
    tgz_md5: str
    sha256: str
    base_folder: str  # top-level directory inside the archive
    train_list: list[list[str]]  # [[member name, md5], ...]
    test_list: list[list[str]]
    meta: dict[str, str]  # {"filename", "key", "md5"}
    train_images: np.ndarray  # (N, 32, 32, 3) uint8, HWC
    train_labels: list[int]  # fine labels for cifar100
    test_images: np.ndarray
    test_labels: list[int]
    classes: list[str]
    train_coarse_labels: list[int] | None = None  # cifar100 only
    test_coarse_labels: list[int] | None = None


def _cifar_rows(images_hwc: np.ndarray) -> np.ndarray:
    # The pickles store each image as 3072 bytes: the full R plane, then G, then B (each 32x32 row-major).
    return np.ascontiguousarray(images_hwc.transpose(0, 3, 1, 2).reshape(len(images_hwc), 3072))


def _pickle(obj: object) -> bytes:
    # Protocol 2 is what the published (Python 2 era) files use, and it is deterministic for these objects.
    return pickle.dumps(obj, protocol=2)


def cifar_archive(
    dest_dir: Path,
    variant: Literal["cifar10", "cifar100"],
    n_train: int | None = None,
    n_test: int = 20,
    seed: int = 0,
    given: Given | None = None,
) -> CifarArchive:
    """Write ``cifar-10-python.tar.gz`` or ``cifar-100-python.tar.gz`` into ``dest_dir``.

    ``n_train`` defaults to 50 for cifar10 (10 per ``data_batch_*``) and 200 for cifar100, so every class is in
    train; fewer than the number of classes raises ``ValueError``. CIFAR-10 train images are split over the five
    batches with ``np.array_split`` (sizes differ by at most one). Labels cycle through the classes; test covers
    all classes only if ``n_test`` >= number of classes (true for cifar10 by default, not for cifar100).
    """
    if variant not in ("cifar10", "cifar100"):
        raise ValueError(f"unknown variant {variant!r}")
    is10 = variant == "cifar10"
    classes = list(CIFAR10_LABEL_NAMES if is10 else CIFAR100_FINE_LABEL_NAMES)
    if n_train is None:
        n_train = 50 if is10 else 200
    if n_train < len(classes) or n_test < 0:
        raise ValueError(f"{variant} needs n_train >= {len(classes)} (every class in train) and n_test >= 0")

    rng = np.random.default_rng(seed)
    train_images = rng.integers(0, 256, size=(n_train, 32, 32, 3), dtype=np.uint8)
    test_images = rng.integers(0, 256, size=(n_test, 32, 32, 3), dtype=np.uint8)
    train_labels = cyclic_labels(n_train, len(classes)).tolist()
    test_labels = cyclic_labels(n_test, len(classes)).tolist()
    if given is not None:  # (N, 32, 32, 3) uint8 images and their labels, instead of noise
        train_images, test_images = given[0], given[2]
        train_labels, test_labels = given[1].tolist(), given[3].tolist()
        n_train, n_test = len(train_images), len(test_images)

    members: dict[str, bytes] = {}
    if is10:
        base = "cifar-10-batches-py"
        idx_parts = np.array_split(np.arange(n_train), 5)
        train_names = [f"data_batch_{i}" for i in range(1, 6)]
        for i, (name, idx) in enumerate(zip(train_names, idx_parts, strict=True), start=1):
            members[name] = _pickle(
                {
                    "batch_label": f"training batch {i} of 5",
                    "labels": [train_labels[j] for j in idx],
                    "data": _cifar_rows(train_images[idx]),
                    "filenames": [f"train_{j:05d}.png" for j in idx],
                }
            )
        test_names = ["test_batch"]
        members["test_batch"] = _pickle(
            {
                "batch_label": "testing batch 1 of 1",
                "labels": test_labels,
                "data": _cifar_rows(test_images),
                "filenames": [f"test_{j:05d}.png" for j in range(n_test)],
            }
        )
        meta_name, meta_key = "batches.meta", "label_names"
        members[meta_name] = _pickle(
            {"num_cases_per_batch": int(max(len(p) for p in idx_parts)), "label_names": classes, "num_vis": 3072}
        )
        train_coarse = test_coarse = None
    else:
        base = "cifar-100-python"
        train_coarse = [CIFAR100_FINE_TO_COARSE[y] for y in train_labels]
        test_coarse = [CIFAR100_FINE_TO_COARSE[y] for y in test_labels]
        train_names, test_names = ["train"], ["test"]
        for name, images, fine, coarse in (
            ("train", train_images, train_labels, train_coarse),
            ("test", test_images, test_labels, test_coarse),
        ):
            members[name] = _pickle(
                {
                    "filenames": [f"{name}_{j:05d}.png" for j in range(len(images))],
                    "batch_label": f"{name}ing batch 1 of 1",
                    "fine_labels": fine,
                    "coarse_labels": coarse,
                    "data": _cifar_rows(images),
                }
            )
        meta_name, meta_key = "meta", "fine_label_names"
        members[meta_name] = _pickle(
            {"fine_label_names": classes, "coarse_label_names": list(CIFAR100_COARSE_LABEL_NAMES)}
        )

    archive = Path(dest_dir) / ("cifar-10-python.tar.gz" if is10 else "cifar-100-python.tar.gz")
    data = tar_gz([dir_info(base)] + [(file_info(f"{base}/{n}", len(b)), b) for n, b in sorted(members.items())])
    write_file(archive, data)
    return CifarArchive(
        path=archive,
        tgz_md5=md5_bytes(data),
        sha256=sha256_bytes(data),
        base_folder=base,
        train_list=[[n, md5_bytes(members[n])] for n in train_names],
        test_list=[[n, md5_bytes(members[n])] for n in test_names],
        meta={"filename": meta_name, "key": meta_key, "md5": md5_bytes(members[meta_name])},
        train_images=train_images,
        train_labels=train_labels,
        test_images=test_images,
        test_labels=test_labels,
        classes=classes,
        train_coarse_labels=train_coarse,
        test_coarse_labels=test_coarse,
    )
