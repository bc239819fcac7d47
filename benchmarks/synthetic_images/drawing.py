"""What every synthetic picture is drawn with: anti-aliased masks of polygons and pen strokes, smooth noise,
ramps and colours. Masks are drawn at SS times the size and box-filtered down."""

from __future__ import annotations

import functools
import math

import numpy as np
from PIL import Image, ImageDraw

Rng = np.random.Generator
Strokes = list[np.ndarray]  # polylines, (n, 2) arrays of (x, y), y down
SS = 4  # supersampling: outlines are drawn at SS x the size, then box-filtered down


def rotation(degrees: float) -> np.ndarray:
    """The 2x2 matrix that turns points by `degrees` about the origin."""
    t = math.radians(degrees)
    return np.array([[math.cos(t), -math.sin(t)], [math.sin(t), math.cos(t)]])


def chaikin(points: np.ndarray, rounds: int) -> np.ndarray:
    """Corner cutting: a polyline becomes a smooth curve through the same ends (a pen does not make kinks)."""
    for _ in range(rounds):
        if len(points) < 3:
            return points
        a, b = points[:-1], points[1:]
        cut = np.stack([0.75 * a + 0.25 * b, 0.25 * a + 0.75 * b], axis=1).reshape(-1, 2)
        points = np.concatenate([points[:1], cut, points[-1:]])
    return points


def regular_polygon(n: int, radius: float = 1.0, phase: float = -90.0) -> np.ndarray:
    """The `n` corners of a regular polygon of `radius` around 0, the first at `phase` degrees (-90: the top)."""
    t = np.radians(phase + 360.0 * np.arange(n) / n)
    return radius * np.stack([np.cos(t), np.sin(t)], axis=1)


def polygon_mask(polygons: list[np.ndarray], holes: list[np.ndarray], size: int) -> np.ndarray:
    """Coverage in [0, 1] of `polygons` minus `holes` (pixel coordinates of a size x size image)."""
    canvas = Image.new("L", (size * SS, size * SS), 0)
    draw = ImageDraw.Draw(canvas)
    for fill, group in ((255, polygons), (0, holes)):
        for polygon in group:
            draw.polygon([tuple(p) for p in (polygon * SS).tolist()], fill=fill)
    return np.asarray(canvas.resize((size, size), Image.Resampling.BOX), dtype=np.float32) / 255.0


def stroke_mask(strokes: Strokes, width: float, size: int) -> np.ndarray:
    """Coverage in [0, 1] of round-capped pen strokes `width` px wide (pixel coordinates)."""
    canvas = Image.new("L", (size * SS, size * SS), 0)
    draw = ImageDraw.Draw(canvas)
    w = max(1, round(width * SS))
    for stroke in strokes:
        points = [tuple(p) for p in (stroke * SS).tolist()]
        draw.line(points, fill=255, width=w)  # smooth curves: the gaps at joints are sub-pixel
        for x, y in (points[0], points[-1]):  # round caps: PIL's line ends are square
            draw.ellipse((x - w / 2, y - w / 2, x + w / 2, y + w / 2), fill=255)
    return np.asarray(canvas.resize((size, size), Image.Resampling.BOX), dtype=np.float32) / 255.0


def smooth_noise(rng: Rng, size: int, cells: int, channels: int) -> np.ndarray:
    """Low-frequency noise in [0, 1]: a cells x cells random grid, bicubically enlarged."""
    grid = (rng.random((cells, cells, channels)) * 255).astype(np.uint8)
    image = Image.fromarray(grid[..., 0] if channels == 1 else grid)
    out = np.asarray(image.resize((size, size), Image.Resampling.BICUBIC), dtype=np.float32) / 255.0
    return out.reshape(size, size, channels)


@functools.cache
def pixel_grid(size: int) -> np.ndarray:
    """(y, x) of every pixel, in [-0.5, 0.5]; cached (drawn from many times per image), never written to."""
    grid = np.mgrid[0:size, 0:size].astype(np.float32) / (size - 1) - 0.5
    grid.flags.writeable = False
    return grid


def linear_ramp(rng: Rng, size: int) -> np.ndarray:
    """A linear ramp in [-1, 1] across the image, in a random direction."""
    t = rng.uniform(0, 2 * math.pi)
    y, x = pixel_grid(size)
    ramp = x * math.cos(t) + y * math.sin(t)
    return ramp / max(float(np.abs(ramp).max()), 1e-6)


def random_colour(rng: Rng) -> np.ndarray:
    """Any colour, drawn the same way for objects, backgrounds and distractors: colour never tells the class."""
    return hsv(rng.random(), rng.uniform(0.0, 1.0), rng.uniform(0.15, 1.0))


def hsv(h: float, s: float, v: float) -> np.ndarray:
    """The (r, g, b) float32 colour, each in [0, 1], of hue `h`, saturation `s` and value `v` in [0, 1]."""
    k = (np.array([5.0, 3.0, 1.0]) + h * 6) % 6
    return (v - v * s * np.clip(np.minimum(k, 4 - k), 0, 1)).astype(np.float32)
