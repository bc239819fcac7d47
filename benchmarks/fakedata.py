"""Tiny, deterministic stand-ins for published datasets, written in their real on-disk formats.

Everything here is a pure function of its arguments (including ``seed``): the same call writes byte-identical
files, so tests can pin checksums. Archives are made reproducible by zeroing every timestamp/owner field
(gzip ``mtime=0``; tar ``mtime=0``, ``uid/gid=0``, empty user/group names; zip dates fixed at 1980-01-01) and by
adding members in sorted order.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import struct
import tarfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image

__all__ = [
    "CIFAR10_LABEL_NAMES",
    "CIFAR100_COARSE_LABEL_NAMES",
    "CIFAR100_FINE_LABEL_NAMES",
    "CIFAR100_FINE_TO_COARSE",
    "CifarArchive",
    "MnistFiles",
    "cifar_archive",
    "imagefolder_tree",
    "md5_bytes",
    "md5_file",
    "mnist_files",
    "pack",
    "sha256_bytes",
    "sha256_file",
    "tar_with_member",
    "tar_with_symlink",
    "zip_with_member",
    "zip_with_symlink",
]

# The zip format cannot represent dates before 1980; this is the conventional "no date" value.
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)

CIFAR10_LABEL_NAMES: tuple[str, ...] = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)

# Real CIFAR-100 names, in the order of the published ``meta`` file (alphabetical).
CIFAR100_FINE_LABEL_NAMES: tuple[str, ...] = (
    "apple",
    "aquarium_fish",
    "baby",
    "bear",
    "beaver",
    "bed",
    "bee",
    "beetle",
    "bicycle",
    "bottle",
    "bowl",
    "boy",
    "bridge",
    "bus",
    "butterfly",
    "camel",
    "can",
    "castle",
    "caterpillar",
    "cattle",
    "chair",
    "chimpanzee",
    "clock",
    "cloud",
    "cockroach",
    "couch",
    "crab",
    "crocodile",
    "cup",
    "dinosaur",
    "dolphin",
    "elephant",
    "flatfish",
    "forest",
    "fox",
    "girl",
    "hamster",
    "house",
    "kangaroo",
    "keyboard",
    "lamp",
    "lawn_mower",
    "leopard",
    "lion",
    "lizard",
    "lobster",
    "man",
    "maple_tree",
    "motorcycle",
    "mountain",
    "mouse",
    "mushroom",
    "oak_tree",
    "orange",
    "orchid",
    "otter",
    "palm_tree",
    "pear",
    "pickup_truck",
    "pine_tree",
    "plain",
    "plate",
    "poppy",
    "porcupine",
    "possum",
    "rabbit",
    "raccoon",
    "ray",
    "road",
    "rocket",
    "rose",
    "sea",
    "seal",
    "shark",
    "shrew",
    "skunk",
    "skyscraper",
    "snail",
    "snake",
    "spider",
    "squirrel",
    "streetcar",
    "sunflower",
    "sweet_pepper",
    "table",
    "tank",
    "telephone",
    "television",
    "tiger",
    "tractor",
    "train",
    "trout",
    "tulip",
    "turtle",
    "wardrobe",
    "whale",
    "willow_tree",
    "wolf",
    "woman",
    "worm",
)

CIFAR100_COARSE_LABEL_NAMES: tuple[str, ...] = (
    "aquatic_mammals",
    "fish",
    "flowers",
    "food_containers",
    "fruit_and_vegetables",
    "household_electrical_devices",
    "household_furniture",
    "insects",
    "large_carnivores",
    "large_man-made_outdoor_things",
    "large_natural_outdoor_scenes",
    "large_omnivores_and_herbivores",
    "medium_mammals",
    "non-insect_invertebrates",
    "people",
    "reptiles",
    "small_mammals",
    "trees",
    "vehicles_1",
    "vehicles_2",
)

# fine label index -> coarse label index, as in the real dataset (each superclass has exactly 5 classes).
CIFAR100_FINE_TO_COARSE: tuple[int, ...] = (
    4,
    1,
    14,
    8,
    0,
    6,
    7,
    7,
    18,
    3,
    3,
    14,
    9,
    18,
    7,
    11,
    3,
    9,
    7,
    11,
    6,
    11,
    5,
    10,
    7,
    6,
    13,
    15,
    3,
    15,
    0,
    11,
    1,
    10,
    12,
    14,
    16,
    9,
    11,
    5,
    5,
    19,
    8,
    8,
    15,
    13,
    14,
    17,
    18,
    10,
    16,
    4,
    17,
    4,
    2,
    0,
    17,
    4,
    18,
    17,
    10,
    3,
    2,
    12,
    12,
    16,
    12,
    1,
    9,
    19,
    2,
    10,
    0,
    1,
    16,
    12,
    9,
    13,
    15,
    13,
    16,
    19,
    2,
    4,
    6,
    19,
    5,
    5,
    8,
    19,
    18,
    1,
    2,
    15,
    6,
    0,
    17,
    8,
    14,
    13,
)


# --------------------------------------------------------------------------------------------------- hashing


def md5_bytes(data: bytes) -> str:
    """Hex md5 of ``data`` (the digest torchvision checks)."""
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def md5_file(path: Path) -> str:
    """Hex md5 of a file's bytes."""
    return md5_bytes(Path(path).read_bytes())


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    return sha256_bytes(Path(path).read_bytes())


def _write(path: Path, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _gzip(data: bytes) -> bytes:
    # mtime=0 keeps the gzip header free of the wall clock, so the bytes (and md5) are reproducible.
    return gzip.compress(data, compresslevel=9, mtime=0)


def _cyclic_labels(n: int, num_classes: int) -> np.ndarray:
    # Cycling (rather than sampling) guarantees every class appears once n >= num_classes.
    return np.arange(n, dtype=np.int64) % num_classes


# ----------------------------------------------------------------------------------------------------- MNIST


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
            out.append(_write(raw_dir / path.name.removesuffix(".gz"), gzip.decompress(path.read_bytes())))
        return out


def idx_bytes(array: np.ndarray) -> bytes:
    """Encode a uint8 array in IDX format: magic ``0x0000 08 <ndim>`` then big-endian uint32 dims, then data."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    # 0x08 = unsigned byte; 2049 / 2051 are the magics for 1-d labels / 3-d images.
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes(order="C")


# Given images: (train images, train labels, test images, test labels) to write instead of noise.
Given = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


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
    train_labels = _cyclic_labels(n_train, num_classes).astype(np.uint8)
    test_labels = _cyclic_labels(n_test, num_classes).astype(np.uint8)
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
        data = _gzip(idx_bytes(array))
        _write(dest / name, data)
        resources.append((name, md5_bytes(data)))
        sha[name] = sha256_bytes(data)
    return MnistFiles(dest, resources, train_images, train_labels, test_images, test_labels, sha)


# ----------------------------------------------------------------------------------------------------- CIFAR


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
    train_labels = _cyclic_labels(n_train, len(classes)).tolist()
    test_labels = _cyclic_labels(n_test, len(classes)).tolist()
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
    data = _tar_gz([_dir_info(base)] + [(_file_info(f"{base}/{n}", len(b)), b) for n, b in sorted(members.items())])
    _write(archive, data)
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


# ----------------------------------------------------------------------------------------------- ImageFolder

_EXTENSIONS = {"JPEG": ".jpg", "TIFF": ".tif"}


def imagefolder_tree(
    root: Path,
    classes: Sequence[str] = ("cat", "dog", "fish"),
    per_class: int = 4,
    size: tuple[int, int] | Sequence[tuple[int, int]] = (12, 10),
    mode: str = "RGB",
    seed: int = 0,
    fmt: str = "PNG",
) -> dict[str, list[Path]]:
    """Write ``root/<class>/<class>_<i>.<ext>`` noise images; return class -> files (in write order).

    ``size`` is PIL's (width, height), or a list of them cycled over a running image counter across all classes
    (so even ``per_class=1`` gives mixed sizes). ``mode`` is any PIL mode; L/RGB/RGBA are drawn directly, others are
    converted from RGB. The extension follows ``fmt`` (PNG -> .png, JPEG -> .jpg, ...).
    """
    sizes: list[tuple[int, int]] = (
        [(int(size[0]), int(size[1]))] if isinstance(size[0], int) else [(int(w), int(h)) for w, h in size]
    )
    if not sizes:
        raise ValueError("size must not be empty")
    ext = _EXTENSIONS.get(fmt.upper(), "." + fmt.lower())
    rng = np.random.default_rng(seed)
    root = Path(root)
    out: dict[str, list[Path]] = {}
    k = 0
    for cls in classes:
        (root / cls).mkdir(parents=True, exist_ok=True)
        out[cls] = []
        for i in range(per_class):
            w, h = sizes[k % len(sizes)]
            k += 1
            channels = {"L": 0, "RGB": 3, "RGBA": 4}.get(mode, 3)
            shape = (h, w) if channels == 0 else (h, w, channels)
            img = Image.fromarray(rng.integers(0, 256, size=shape, dtype=np.uint8))
            if img.mode != mode:
                img = img.convert(mode)
            path = root / cls / f"{cls}_{i}{ext}"
            img.save(path, format=fmt)
            out[cls].append(path)
    return out


# --------------------------------------------------------------------------------------------------- archives


def _normalize_info(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _file_info(name: str, size: int, mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode = size, mode
    return _normalize_info(info)


def _dir_info(name: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    return _normalize_info(info), None


def _tar_gz(entries: Sequence[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    """Serialize members in the given order (names kept verbatim: no stripping of ``/`` or ``..``), then gzip."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    # Compress separately: tarfile's own "w:gz" stamps the current time into the gzip header.
    return _gzip(buf.getvalue())


def _zip_info(name: str, mode: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=ZIP_EPOCH)
    info.create_system = 3  # Unix, so extractors interpret the mode bits in external_attr
    info.external_attr = mode << 16
    return info


def pack(src_dir: Path, archive: Path, kind: Literal["tar.gz", "zip"], prefix: str = "") -> str:
    """Pack ``src_dir`` into ``archive`` reproducibly (members under ``prefix/`` if given); return its sha256.

    Directories get their own entries; symlinks are stored as symlinks (not followed).
    """
    src_dir = Path(src_dir)
    prefix = prefix.strip("/")
    # (archive name, path) for every directory and file, parents before children thanks to sorting.
    items: list[tuple[str, Path]] = [(prefix, src_dir)] if prefix else []
    for dirpath, dirnames, filenames in os.walk(src_dir):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(src_dir).as_posix()
            items.append((f"{prefix}/{rel}" if prefix else rel, path))
    items.sort(key=lambda item: item[0])

    if kind == "tar.gz":
        entries: list[tuple[tarfile.TarInfo, bytes | None]] = []
        for name, path in items:
            if path.is_symlink():
                info = _normalize_info(tarfile.TarInfo(name))
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, os.readlink(path), 0o777
                entries.append((info, None))
            elif path.is_dir():
                entries.append(_dir_info(name))
            else:
                data = path.read_bytes()
                entries.append((_file_info(name, len(data)), data))
        data = _tar_gz(entries)
    elif kind == "zip":
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            for name, path in items:
                if path.is_symlink():
                    zf.writestr(_zip_info(name, 0o120777), os.readlink(path).encode(), zipfile.ZIP_STORED)
                elif path.is_dir():
                    info = _zip_info(name + "/", 0o40755)
                    info.external_attr |= 0x10  # MS-DOS directory flag
                    zf.writestr(info, b"", zipfile.ZIP_STORED)
                else:
                    zf.writestr(_zip_info(name, 0o100644), path.read_bytes(), zipfile.ZIP_DEFLATED)
        data = buf.getvalue()
    else:
        raise ValueError(f"unknown archive kind {kind!r}")
    _write(Path(archive), data)
    return sha256_bytes(data)


# --------------------------------------------------------------------------------------- malicious archives


def tar_with_member(archive: Path, name: str, data: bytes = b"x") -> str:
    """Write a .tar.gz with one regular file under the verbatim ``name`` (e.g. ``../evil.txt``, ``/tmp/evil.txt``)."""
    out = _tar_gz([(_file_info(name, len(data)), data)])
    _write(Path(archive), out)
    return sha256_bytes(out)


def tar_with_symlink(
    archive: Path, link_name: str, target: str, then_file: str | None = None, data: bytes = b"x"
) -> str:
    """Write a .tar.gz with symlink ``link_name -> target``, then optionally a file ``then_file`` (e.g. through it)."""
    link = _normalize_info(tarfile.TarInfo(link_name))
    link.type, link.linkname, link.mode = tarfile.SYMTYPE, target, 0o777
    entries: list[tuple[tarfile.TarInfo, bytes | None]] = [(link, None)]
    if then_file is not None:
        entries.append((_file_info(then_file, len(data)), data))
    out = _tar_gz(entries)
    _write(Path(archive), out)
    return sha256_bytes(out)


def zip_with_member(archive: Path, name: str, data: bytes = b"x") -> str:
    """Write a zip with one member under the raw ``name`` (ZipInfo keeps ``..`` and leading ``/``)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(_zip_info(name, 0o100644), data, zipfile.ZIP_STORED)
    _write(Path(archive), buf.getvalue())
    return sha256_bytes(buf.getvalue())


def zip_with_symlink(archive: Path, link_name: str, target: str) -> str:
    """Write a zip whose member ``link_name`` is a Unix symlink to ``target`` (mode 0o120777, data = target)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(_zip_info(link_name, 0o120777), target.encode(), zipfile.ZIP_STORED)
    _write(Path(archive), buf.getvalue())
    return sha256_bytes(buf.getvalue())
