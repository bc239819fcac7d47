"""A check dataset written to disk: as PNGs in torchvision's ImageFolder layout, or as a preview grid."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from benchmarks.synthetic_images.datasets import dataset_named, generate
from tasks.core.atomic import atomic_dir, atomic_file


def _split_parts(n_per_class: int | None, splits: dict[str, int] | None) -> list[tuple[str, int, int]]:
    """(sub-folder, first image number, images per class) of each part of an ImageFolder tree."""
    if splits is None:
        if n_per_class is None:
            raise ValueError("give n_per_class or splits")
        return [("", 0, n_per_class)]
    if n_per_class is not None and n_per_class != sum(splits.values()):
        raise ValueError(f"n_per_class {n_per_class} != the splits' sum {sum(splits.values())}")
    parts, start = [], 0
    for split, count in splits.items():
        if not split.isidentifier() or count < 0:
            raise ValueError(f"bad split {split!r}: {count} (a name like train, test or val, and a count >= 0)")
        parts.append((split, start, count))
        start += count  # the splits take consecutive image numbers: no image is in two of them
    return parts


def write_imagefolder(
    folder: str | Path,
    name: str,
    n_per_class: int | None = None,
    seed: int = 0,
    splits: dict[str, int] | None = None,
) -> Path:
    """Write dataset `name` as PNGs in torchvision's ImageFolder layout; returns `folder`.

    Without splits: folder/<class>/<number>.png, n_per_class per class. With splits ({"train": 500,
    "test": 100}: images per class): folder/<split>/<class>/<number>.png, the splits taking consecutive
    image numbers (train 0..499, test 500..599). The tree is built beside `folder` and renamed onto it
    once complete, replacing any previous one. File names are zero-padded, so sorted = generated order.
    """
    folder = Path(folder)
    dataset = dataset_named(name)
    parts = _split_parts(n_per_class, splits)
    digits = max(5, len(str(sum(count for _, _, count in parts))))
    with atomic_dir(folder) as staging:
        for split, start, count in parts:
            for label in dataset.classes:
                (staging / split / label).mkdir(parents=True)
            for chunk in range(0, count, 100):  # bounded memory at any size
                n = min(100, count - chunk)
                images, labels, classes = generate(name, n, seed, start + chunk)
                for i, (image, label) in enumerate(zip(images, labels.tolist(), strict=True)):
                    path = staging / split / classes[label] / f"{start + chunk + i // len(classes):0{digits}d}.png"
                    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(path)
    return folder


def preview(name: str, out: str | Path, per_class: int = 12, seed: int = 0, zoom: int = 3) -> Path:
    """A PNG grid for people to look at: one row per class, `per_class` examples, enlarged `zoom` x."""
    images, labels, classes = generate(name, per_class, seed)
    h, w, _ = images.shape[1:]
    margin = 8 + 7 * max(len(c) for c in classes)
    grid = Image.new("RGB", (margin + per_class * w * zoom, len(classes) * (h * zoom + 2)), "white")
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()  # bundled with Pillow: no system font needed
    for label, cls in enumerate(classes):
        strip = np.concatenate(list(images[labels == label]), axis=1)
        tile = Image.fromarray(strip[..., 0] if strip.shape[-1] == 1 else strip).convert("RGB")
        top = label * (h * zoom + 2)
        grid.paste(tile.resize((per_class * w * zoom, h * zoom), Image.Resampling.NEAREST), (margin, top))
        draw.text((4, top + h * zoom // 2 - 6), cls, fill="black", font=font)
    out = Path(out)
    with atomic_file(out) as temporary:
        grid.save(temporary, format="PNG")
    return out
