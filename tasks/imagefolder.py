"""Users' own images: a folder of class sub-folders (torchvision's ImageFolder layout), streamed
into the raw format one block of decoded images at a time, so memory stays flat at any size.

    root/cat/001.png, root/cat/sub/002.jpg, root/dog/003.png, ...   ->  classes ["cat", "dog"]

Classes are the sub-folder names, sorted; files are taken recursively, sorted, so the ingested
bytes depend only on the folder's content. Files without an image extension (README.txt,
.DS_Store) are skipped and reported; a file with an image extension that does not decode is an
error naming it, as is an empty class folder (a silently missing class would shift every label).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tasks.data_format import write_raw_blocks
from tasks.errors import ExpectedFailure

log = logging.getLogger(__name__)

# The same list as torchvision.datasets.folder.IMG_EXTENSIONS (a test holds them equal); copied so
# that the download stage does not import torchvision (~3.5 s) just for a tuple.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
BLOCK = 512  # images decoded per written block


@dataclass(frozen=True)
class FolderScan:
    root: Path
    classes: list[str]
    files: list[str]  # str, not Path: a third of the memory per file, which counts at millions of files
    labels: np.ndarray  # (N,) int64, index into classes
    skipped: list[str]  # files without an image extension


def _visible(name: str) -> bool:
    return not name.startswith(".")


def find_root(path: Path) -> Path:
    """The folder holding the class folders: archives often wrap them in one top-level folder."""
    path = Path(path)
    while True:
        entries = [e for e in os.scandir(path) if _visible(e.name)]
        dirs = [e for e in entries if e.is_dir()]
        files = [e for e in entries if e.is_file()]
        if len(dirs) == 1 and not files and any(e.is_dir() for e in os.scandir(dirs[0].path)):
            path = Path(dirs[0].path)
        else:
            return path


def scan(root: Path) -> FolderScan:
    """Classes and image files under `root`; raises ExpectedFailure for layouts that cannot be a dataset."""
    root = Path(root)
    if not root.is_dir():
        raise ExpectedFailure(f"{root}: not a directory (data.path must be a folder of class folders, or an archive)")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and _visible(e.name))
    if len(classes) < 2:
        raise ExpectedFailure(f"{root}: found {len(classes)} class folder(s) {classes}; a classifier needs at least 2")
    files: list[str] = []
    labels: list[int] = []
    skipped: list[str] = []
    for label, name in enumerate(classes):
        found = 0
        for folder, subdirs, names in os.walk(root / name):
            subdirs[:] = sorted(d for d in subdirs if _visible(d))
            for file in sorted(n for n in names if _visible(n)):
                path = os.path.join(folder, file)
                if os.path.splitext(file)[1].lower() in IMG_EXTENSIONS:
                    files.append(path)
                    labels.append(label)
                    found += 1
                else:
                    skipped.append(path)
        if found == 0:
            raise ExpectedFailure(f"{root / name}: class folder has no images (extensions: {' '.join(IMG_EXTENSIONS)})")
    if skipped:
        shown = ", ".join(os.path.relpath(p, root) for p in skipped[:5])
        log.warning(
            "%s: skipped %d file(s) without an image extension: %s%s",
            root,
            len(skipped),
            shown,
            " ..." if len(skipped) > 5 else "",
        )
    return FolderScan(root, classes, files, np.asarray(labels, dtype=np.int64), skipped)


def _decode(path: str, mode: str, size: tuple[int, int] | None) -> np.ndarray:
    """One image as (H, W, C) uint8; `size` is (height, width) to resize to, or None to keep."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image = image.convert(mode)  # decodes fully: truncated files fail here, not later
            if size is not None and image.size != (size[1], size[0]):
                image = image.resize((size[1], size[0]), Image.Resampling.BILINEAR)
            pixels = np.asarray(image, dtype=np.uint8)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ExpectedFailure(f"{path}: not a readable image: {exc}") from None
    return pixels.reshape(pixels.shape[0], pixels.shape[1], -1)


def ingest_folder(
    root: Path, out_dir: Path, channels: int, image_size: tuple[int, int] | None, source: str
) -> FolderScan:
    """Decode every image under `root` into a raw snapshot at `out_dir` (atomically).

    Without `image_size`, every image must have the first image's size; the error names the
    first that differs and says how to resize.
    """
    found = scan(find_root(root))
    mode = "RGB" if channels == 3 else "L"
    first = _decode(found.files[0], mode, image_size)
    height, width = first.shape[:2]

    def blocks() -> Iterator[np.ndarray]:
        block = np.empty((BLOCK, height, width, channels), dtype=np.uint8)
        filled = 0
        for path in tqdm(found.files, desc="decoding images", unit="img", disable=None, leave=False):
            pixels = _decode(path, mode, image_size)
            if pixels.shape[:2] != (height, width):
                raise ExpectedFailure(
                    f"{path}: {pixels.shape[1]}x{pixels.shape[0]} pixels, but {found.files[0]} is "
                    f"{width}x{height}; set data.image_size: [height, width] to resize all images"
                )
            block[filled] = pixels
            filled += 1
            if filled == BLOCK:
                yield block
                filled = 0
        if filled:
            yield block[:filled]

    shape = (len(found.files), height, width, channels)
    write_raw_blocks(out_dir, blocks(), shape, found.labels, found.classes, source)
    return found
