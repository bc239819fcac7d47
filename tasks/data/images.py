"""One image file (or bytes) to the pixels a model takes: the decoding rules every entry shares.

Ingest (tasks/data/folders.py), `python -m tasks.tools.predict` and the served model (tasks/ship/serving.py)
all decode here, so an image a user scores is converted exactly as the training images were: to
the model's channels (PIL's "L" or "RGB" conversion), then resized bilinearly to its height and
width when its size differs. Only PIL and numpy: the served model imports this module too.
"""

from __future__ import annotations

import warnings
from typing import IO, TYPE_CHECKING

import numpy as np

from tasks.core.errors import ExpectedFailure

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage  # imported lazily below: PIL is only needed to decode

# The same list as torchvision.datasets.folder.IMG_EXTENSIONS (a test holds them equal); copied so
# that the download stage does not import torchvision (~3.5 s) just for a tuple.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def mode_of(channels: int) -> str:
    """PIL's conversion mode for a model's channel count."""
    return "RGB" if channels == 3 else "L"


def open_checked(source: str | IO[bytes], max_pixels: int, name: str | None = None) -> PILImage:
    """`source` opened (header read, nothing decoded), refused when larger than `max_pixels`."""
    from PIL import Image

    shown = name or source
    try:
        with warnings.catch_warnings():  # PIL warns above 89 M pixels; our own limit decides, below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(source)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ExpectedFailure(f"{shown}: not a readable image: {exc}") from None
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise ExpectedFailure(
            f"{shown}: {width}x{height} = {width * height} pixels, more than data.max_image_pixels ({max_pixels})"
        )
    return image


def decode(
    source: str | IO[bytes], mode: str, size: tuple[int, int] | None, max_pixels: int, name: str | None = None
) -> np.ndarray:
    """One image as (H, W, C) uint8; `size` is (height, width) to resize to, or None to keep."""
    from PIL import Image

    try:
        with open_checked(source, max_pixels, name) as image:
            image = image.convert(mode)  # decodes fully: truncated files fail here, not later
            if size is not None and image.size != (size[1], size[0]):
                image = image.resize((size[1], size[0]), Image.Resampling.BILINEAR)
            pixels = np.asarray(image, dtype=np.uint8)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ExpectedFailure(f"{name or source}: not a readable image: {exc}") from None
    return pixels.reshape(pixels.shape[0], pixels.shape[1], -1)
