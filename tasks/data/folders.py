"""Users' own images: a folder of class sub-folders (torchvision's ImageFolder layout), streamed
into the raw format one block of decoded images at a time, so memory stays flat at any size.

    root/cat/001.png, root/cat/sub/002.jpg, root/dog/003.png, ...   ->  classes ["cat", "dog"]

Classes are the sub-folder names, sorted; files are taken recursively, sorted, so the ingested
bytes depend only on the folder's content. Files without an image extension (README.txt,
.DS_Store) are skipped and reported; a file with an image extension that does not decode is an
error naming it, as is an empty class folder (a silently missing class would shift every label).

A folder holding exactly train/, test/ and optionally val/, each of the same class folders, is
a dataset with published splits: they are ingested in that order, each contiguous, and their
row ranges recorded in meta.json, so that the test set stays the one the dataset's users report on.

A folder (or an extracted archive) is refused, before anything is decoded, when it holds:
- a symbolic link: links are not followed (`cat -> .` would list every image again under `cat`,
  and a link can read files outside the folder);
- a FIFO, socket or device with an image name (opening a FIFO blocks forever);
- a name that is not UTF-8 or holds a control character (a newline forges log lines; class names
  go into meta.json, logs and the exported model's labels);
- two class names that differ only in case or Unicode form (`Cat`, `cat`): two classes on Linux,
  one on macOS and Windows;
- an image larger than `max_pixels` (read from its header, before decoding), or images that
  would decode to more than `max_bytes` in all.
"""

from __future__ import annotations

import logging
import os
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tasks.core.errors import ExpectedFailure
from tasks.core.redact import CONTROL, escape_controls
from tasks.data.formats import SPLITS, PublishedSplits, write_raw_blocks
from tasks.data.images import IMG_EXTENSIONS, decode, mode_of, open_checked

log = logging.getLogger(__name__)

BLOCK = 512  # images decoded per written block, at most
BLOCK_BYTES = 64 << 20  # ... and at most this many bytes of them (at least one image)
_NOT_UTF8 = re.compile("[\ud800-\udfff]")  # how Python decodes a file name's non-UTF-8 bytes


@dataclass(frozen=True)
class ImageLimits:
    max_pixels: int  # per image, width x height (data.max_image_pixels)
    max_bytes: int  # all images decoded, the size of data/images.npy (data.max_dataset_bytes)


@dataclass(frozen=True)
class FolderScan:
    root: Path
    classes: list[str]
    files: list[str]  # str, not Path: a third of the memory per file, which counts at millions of files
    labels: np.ndarray  # (N,) int64, index into classes
    skipped: list[str]  # files without an image extension
    published_splits: PublishedSplits | None = None  # rows of train/ [val/] test/, when laid out so


def _visible(name: str) -> bool:
    return not name.startswith(".")


def _shown(path: str | os.PathLike[str]) -> str:
    """`path` as one printable line: non-UTF-8 bytes as \\xNN, control characters escaped."""
    text = os.fsencode(path).decode("utf-8", "backslashreplace")
    return escape_controls(text)


def _check_name(path: str) -> None:
    name = os.path.basename(path)
    if _NOT_UTF8.search(name):
        raise ExpectedFailure(f"{_shown(path)}: name is not valid UTF-8; rename it (names reach logs and the model)")
    if CONTROL.search(name):
        raise ExpectedFailure(f"{_shown(path)}: name holds a control character; rename it (it would forge log lines)")


def _entries(folder: str) -> list[os.DirEntry[str]]:
    """Visible entries of `folder`, sorted by name, each name checked; links refused."""
    with os.scandir(folder) as listing:
        entries = sorted((e for e in listing if _visible(e.name)), key=lambda e: e.name)
    for entry in entries:
        _check_name(entry.path)
        if entry.is_symlink():
            raise ExpectedFailure(
                f"{_shown(entry.path)}: a symbolic link; links are not followed (one can list images twice, "
                "under two classes, or reach outside the folder): copy what it points to instead"
            )
    return entries


def find_root(path: Path) -> Path:
    """The folder holding the class folders: archives often wrap them in one top-level folder."""
    path = Path(path)
    while True:
        entries = _entries(str(path))
        dirs = [e for e in entries if e.is_dir(follow_symlinks=False)]
        wrapper = dirs[0].path if len(dirs) == 1 and len(entries) == 1 else None
        if wrapper is not None and any(e.is_dir(follow_symlinks=False) for e in _entries(wrapper)):
            path = Path(wrapper)
        else:
            return path


def _files_under(folder: str) -> Iterator[str]:
    """Regular files under `folder`, depth first, sorted (os.walk's order); links and special files refused."""
    stack = [folder]
    while stack:  # a stack, not recursion: an archive can nest folders thousands deep
        dirs = []
        for entry in _entries(stack.pop()):
            if entry.is_dir(follow_symlinks=False):
                dirs.append(entry.path)
            elif entry.is_file(follow_symlinks=False):
                yield entry.path
            else:
                raise ExpectedFailure(f"{_shown(entry.path)}: not a regular file or folder (a FIFO, socket or device)")
        stack.extend(reversed(dirs))


def _check_classes(root: Path, classes: list[str]) -> None:
    """Refuse names that one file system holds as two folders and another as one."""
    seen: dict[str, str] = {}
    for name in classes:
        key = unicodedata.normalize("NFC", unicodedata.normalize("NFC", name).casefold())
        if key in seen:
            raise ExpectedFailure(
                f"{_shown(root)}: class folders {seen[key]!r} and {name!r} differ only in case or Unicode form: "
                "two classes on Linux, one on macOS and Windows; merge or rename them"
            )
        seen[key] = name


def scan(root: Path) -> FolderScan:
    """Classes and image files under `root`; raises ExpectedFailure for layouts that cannot be a dataset."""
    root = Path(root)
    if not root.is_dir():
        raise ExpectedFailure(f"{root}: not a directory (data.path must be a folder of class folders, or an archive)")
    classes = [e.name for e in _entries(str(root)) if e.is_dir(follow_symlinks=False)]
    if len(classes) < 2:
        raise ExpectedFailure(f"{root}: found {len(classes)} class folder(s) {classes}; a classifier needs at least 2")
    _check_classes(root, classes)
    files: list[str] = []
    labels: list[int] = []
    skipped: list[str] = []
    for label, name in enumerate(classes):
        found = len(files)
        for path in _files_under(str(root / name)):
            if os.path.splitext(path)[1].lower() in IMG_EXTENSIONS:
                files.append(path)
                labels.append(label)
            else:
                skipped.append(path)
        if found == len(files):
            raise ExpectedFailure(f"{root / name}: class folder has no images (extensions: {' '.join(IMG_EXTENSIONS)})")
    if skipped:
        shown_skipped = ", ".join(os.path.relpath(p, root) for p in skipped[:5])
        log.warning(
            "%s: skipped %d file(s) without an image extension: %s%s",
            root,
            len(skipped),
            shown_skipped,
            " ..." if len(skipped) > 5 else "",
        )
    return FolderScan(root, classes, files, np.asarray(labels, dtype=np.int64), skipped)


def scan_layout(root: Path) -> FolderScan:
    """`scan(root)`, or, when `root` holds train/ [val/] test/ folders, their scans one after another."""
    names = {e.name for e in _entries(str(root)) if e.is_dir(follow_symlinks=False)} if root.is_dir() else set()
    if len(names) < 2 or not names <= set(SPLITS):
        return scan(root)
    if not {"train", "test"} <= names:
        raise ExpectedFailure(
            f"{_shown(root)}: split folders {sorted(names)} need both train/ and test/ (val/ is optional); "
            "rename the held-out folder to test/"
        )
    parts = {name: scan(root / name) for name in SPLITS if name in names}
    classes = parts["train"].classes
    ranges: PublishedSplits = {}
    start = 0
    for name, part in parts.items():
        if part.classes != classes:
            missing, extra = sorted(set(classes) - set(part.classes)), sorted(set(part.classes) - set(classes))
            raise ExpectedFailure(
                f"{_shown(root / name)}: class folders differ from train/'s (missing {missing}, extra {extra}); "
                "every split needs the same class folders, or labels would mean different classes"
            )
        ranges[name] = (start, start + len(part.files))
        start += len(part.files)
    return FolderScan(
        root,
        classes,
        [path for part in parts.values() for path in part.files],
        np.concatenate([part.labels for part in parts.values()]),
        [path for part in parts.values() for path in part.skipped],
        ranges,
    )


def _common_size(files: list[str], max_pixels: int) -> tuple[int, int]:
    """(height, width) that every image has, read from the headers alone; refused when one differs."""
    first: tuple[int, int] | None = None
    for path in tqdm(files, desc="checking image sizes", unit="img", disable=None, leave=False):
        with open_checked(path, max_pixels) as image:
            width, height = image.size
        if first is None:
            first = (height, width)
        elif (height, width) != first:
            raise ExpectedFailure(
                f"{path}: {width}x{height} pixels, but {files[0]} is {first[1]}x{first[0]}; "
                "set data.image_size: [height, width] to resize all images"
            )
    assert first is not None  # scan() found images
    return first


def ingest_folder(
    root: Path, out_dir: Path, channels: int, image_size: tuple[int, int] | None, source: str, limits: ImageLimits
) -> FolderScan:
    """Decode every image under `root` into a raw snapshot at `out_dir` (atomically).

    Without `image_size`, every image must have the first image's size; the error names the
    first that differs and says how to resize. Every size is checked (from the image headers)
    before any buffer is sized from it.
    """
    found = scan_layout(find_root(root))
    mode = mode_of(channels)
    height, width = image_size if image_size is not None else _common_size(found.files, limits.max_pixels)
    shape = (len(found.files), height, width, channels)
    total = int(np.prod(shape, dtype=np.int64))
    if total > limits.max_bytes:
        raise ExpectedFailure(
            f"{found.root}: {shape[0]} images of {width}x{height}x{channels} decode to {total} bytes, more than "
            f"data.max_dataset_bytes ({limits.max_bytes}); set a smaller data.image_size or raise the limit"
        )
    rows = max(1, min(BLOCK, BLOCK_BYTES // (height * width * channels)))

    def blocks() -> Iterator[np.ndarray]:
        block = np.empty((rows, height, width, channels), dtype=np.uint8)
        filled = 0
        for path in tqdm(found.files, desc="decoding images", unit="img", disable=None, leave=False):
            pixels = decode(path, mode, image_size, limits.max_pixels)
            if pixels.shape[:2] != (height, width):  # a header that lied about the size
                raise ExpectedFailure(
                    f"{path}: decoded to {pixels.shape[1]}x{pixels.shape[0]}, expected {width}x{height}"
                )
            block[filled] = pixels
            filled += 1
            if filled == rows:
                yield block
                filled = 0
        if filled:
            yield block[:filled]

    write_raw_blocks(out_dir, blocks(), shape, found.labels, found.classes, source, found.published_splits)
    return found
