"""A torchvision ImageFolder tree of noise images: ``root/<class>/<class>_<i>.<ext>``, any size, mode or format."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

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
