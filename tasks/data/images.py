"""One image file (or bytes) to the pixels a model takes: the decoding rules every entry shares.

Ingest (tasks/data/folders.py), `python -m tasks.tools.predict` and the served model (tasks/ship/serving.py)
all decode here, so an image a user scores is converted exactly as the training images were: to
the model's channels (PIL's "L" or "RGB" conversion), then resized bilinearly to its height and
width when its size differs. Only PIL and numpy: the served model imports this module too.

Only the formats `IMG_EXTENSIONS` names are decoded (PNG, JPEG, BMP, PPM/PGM, TIFF, WebP), chosen by
the content, whatever the file's name: Pillow knows some forty more, and some hand the file to other
programs (EPS to Ghostscript) or to rarely used parsers. A file whose content is another format Pillow
knows is refused (exit 3: a safeguard, not damage; convert it); one no decoder recognises, or that
fails to decode, is unreadable (exit 1).
"""

from __future__ import annotations

import functools
import warnings
from typing import IO, TYPE_CHECKING

import numpy as np
from PIL import Image

from tasks.core.errors import ExpectedFailure, Refused

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage  # imported lazily below: PIL is only needed to decode

# The same list as torchvision.datasets.folder.IMG_EXTENSIONS (a test holds them equal); copied so
# that the download stage does not import torchvision (~3.5 s) just for a tuple. The one list of
# what lockstep reads: folders and predict pick files by it, and `formats()` decodes by it.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@functools.cache
def formats() -> tuple[str, ...]:
    """Pillow's names of the formats `IMG_EXTENSIONS` stand for (BMP, JPEG, PNG, PPM, TIFF, WEBP):
    the only decoders `Image.open` may try."""
    known = Image.registered_extensions()
    return tuple(sorted({known[extension] for extension in IMG_EXTENSIONS}))


def _other_format(source: str | IO[bytes]) -> str | None:
    """The format Pillow knows `source` as, when it is not one of `formats()`; None when none claims it.
    Only each format's check of the first 16 bytes runs (as `Image.open` does first), never a decoder."""
    try:
        if isinstance(source, str):
            with open(source, "rb") as file:
                prefix = file.read(16)
        else:
            source.seek(0)
            prefix = source.read(16)
            source.seek(0)
    except OSError:
        return None
    Image.init()
    for name in Image.ID:
        accept = Image.OPEN[name][1]
        if name in formats() or accept is None:
            continue
        try:
            claimed = accept(prefix)
        except Exception:  # noqa: BLE001 - a check that cannot read 16 bytes claims nothing
            continue
        if claimed and not isinstance(claimed, str):  # a str: "looks like it, but unsupported"
            return name
    return None


def mode_of(channels: int) -> str:
    """PIL's conversion mode for a model's channel count."""
    return "RGB" if channels == 3 else "L"


def open_checked(source: str | IO[bytes], max_pixels: int, name: str | None = None) -> PILImage:
    """`source` opened (header read, nothing decoded), refused when larger than `max_pixels`."""
    shown = name or source
    try:
        with warnings.catch_warnings():  # PIL warns above 89 M pixels; our own limit decides, below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(source, formats=formats())
    except Image.UnidentifiedImageError as exc:
        other = _other_format(source)
        if other is not None:  # a safeguard's refusal (exit 3); an unrecognised or broken file stays exit 1
            raise Refused(
                f"{shown}: its content is {other}, not one of the formats lockstep decodes "
                f"({', '.join(formats())}): convert it to PNG"
            ) from None
        raise ExpectedFailure(f"{shown}: not a readable image: {exc}") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ExpectedFailure(f"{shown}: not a readable image: {exc}") from None
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise ExpectedFailure(
            f"{shown}: {width}x{height} = {width * height} pixels, more than data.max_image_pixels ({max_pixels})"
        )
    return image


def _flattened(image: PILImage) -> PILImage:
    """A transparent image composited over white, as a viewer shows it. PIL's `convert("RGB")` (or "L")
    drops the alpha channel: an icon or drawing whose shape is in its alpha (one colour on a transparent
    background, as most icon themes draw them) would become a flat square, and every such image the
    same one. Images without transparency are returned as they are (their bytes do not change)."""
    if image.mode not in ("RGBA", "LA", "PA", "RGBa", "La") and "transparency" not in image.info:
        return image

    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)


def decode(
    source: str | IO[bytes], mode: str, size: tuple[int, int] | None, max_pixels: int, name: str | None = None
) -> np.ndarray:
    """One image as (H, W, C) uint8; `size` is (height, width) to resize to, or None to keep."""
    try:
        with open_checked(source, max_pixels, name) as image:
            image = _flattened(image).convert(mode)  # decodes fully: truncated files fail here, not later
            if size is not None and image.size != (size[1], size[0]):
                image = image.resize((size[1], size[0]), Image.Resampling.BILINEAR)
            pixels = np.asarray(image, dtype=np.uint8)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ExpectedFailure(f"{name or source}: not a readable image: {exc}") from None
    return pixels.reshape(pixels.shape[0], pixels.shape[1], -1)
