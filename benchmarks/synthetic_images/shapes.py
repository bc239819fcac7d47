"""The shapes and shapes100 datasets' images: CIFAR-like pictures of an object shape on a cluttered background."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from benchmarks.synthetic_images.drawing import (
    Rng,
    hsv,
    linear_ramp,
    pixel_grid,
    polygon_mask,
    random_colour,
    regular_polygon,
    rotation,
    smooth_noise,
    stroke_mask,
)

SIZE_RGB = 32  # shapes: CIFAR's size
# How cluttered `shapes` is, set so that a small CNN trained on 500 images a class scores ~85%, not 100%:
# up to 2 distractors, a patterned object 1 in 10, a line across it 1 in 7, a lightness step of 0.3 between
# object and background when one can be had in 10 colour draws (~8% of the time it cannot: low contrast).
MAX_DISTRACTORS, PATTERNED, OCCLUDED, CONTRAST = 2, 0.1, 0.15, 0.3

SHAPES = ["arrow", "circle", "crescent", "cross", "heart", "pentagon", "ring", "square", "star", "triangle"]


def _outline(kind: str, rng: Rng) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(filled polygons, holes) of a shape of radius ~1 centred on 0, corners slightly moved."""
    holes: list[np.ndarray] = []
    if kind == "arrow":
        w, head = rng.uniform(0.14, 0.26), rng.uniform(0.45, 0.65)
        x = rng.uniform(0.0, 0.35)
        shape = np.array([(-1, -w), (x, -w), (x, -head), (1, 0), (x, head), (x, w), (-1, w)])
    elif kind in ("circle", "ring"):
        shape = regular_polygon(48)
        if kind == "ring":
            holes = [regular_polygon(48, rng.uniform(0.45, 0.65)) + rng.normal(0, 0.05, 2)]
    elif kind == "crescent":
        shape = regular_polygon(48)
        holes = [regular_polygon(48, rng.uniform(0.8, 0.95)) + (rng.uniform(0.35, 0.6), rng.normal(0, 0.05))]
    elif kind == "cross":
        w = rng.uniform(0.25, 0.38)
        arm = np.array([(w, -w), (1, -w), (1, w)])
        shape = np.concatenate([arm @ rotation(90 * k).T for k in range(4)])
    elif kind == "heart":
        t = np.linspace(0, 2 * math.pi, 48, endpoint=False)
        x, y = 16 * np.sin(t) ** 3, -(13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t))
        shape = np.stack([x, y + 2.5], axis=1) / 16
    elif kind == "pentagon":
        shape = regular_polygon(5)
    elif kind == "square":
        shape = regular_polygon(4, phase=45) * 0.95
    elif kind == "star":
        shape = regular_polygon(10, 1.1) * np.where(np.arange(10) % 2, rng.uniform(0.38, 0.55), 1.0)[:, None]
    else:  # triangle
        shape = regular_polygon(3, 1.1) + (0, 0.2)
    return [shape + rng.normal(0, 0.03, shape.shape)], holes


def _place(shape: tuple[list[np.ndarray], list[np.ndarray]], rng: Rng, radius: float, centre: np.ndarray) -> np.ndarray:
    """Coverage of `shape` (filled, holes) turned and a little stretched at random, `radius` px around `centre`."""
    m = rotation(rng.uniform(0, 360)) @ np.diag([rng.uniform(0.85, 1.15), 1.0]) * radius
    polygons, holes = shape
    return polygon_mask([p @ m.T + centre for p in polygons], [h @ m.T + centre for h in holes], SIZE_RGB)


def _background(rng: Rng, size: int) -> np.ndarray:
    """Clutter: a gradient, stripes, blobs or smooth noise, in random colours, often two blended."""
    out = np.zeros((size, size, 3), np.float32)
    for layer in range(1 if rng.random() < 0.5 else 2):
        kind = rng.integers(4)
        c0, c1 = random_colour(rng), random_colour(rng)
        if kind == 0:
            t = (linear_ramp(rng, size) + 1) / 2
        elif kind == 1:
            t = 0.5 + 0.5 * np.sin(linear_ramp(rng, size) * rng.uniform(3, 14) + rng.uniform(0, 2 * math.pi))
            t = t if rng.random() < 0.5 else (t > 0.5).astype(np.float32)
        elif kind == 2:
            t = smooth_noise(rng, size, int(rng.integers(2, 7)), 1)[..., 0]
        else:
            y, x = pixel_grid(size)
            t = np.zeros((size, size), np.float32)
            for cx, cy, r in rng.uniform((-0.5, -0.5, 0.06), (0.5, 0.5, 0.33), (int(rng.integers(2, 6)), 3)):
                t = np.maximum(t, np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r)))
        layer_image = c0 + (c1 - c0) * t[..., None]
        out = layer_image if layer == 0 else out * (1 - (w := rng.uniform(0.2, 0.5))) + layer_image * w
    return out + rng.normal(0, rng.uniform(0.0, 0.05), out.shape).astype(np.float32)


def _paint(image: np.ndarray, alpha: np.ndarray, rng: Rng, colour: np.ndarray, patterned: float = 0.25) -> np.ndarray:
    """`image` with `colour` laid over where `alpha` covers it, shaded (a ramp), patterned with odds `patterned`."""
    fill = colour * (1 + rng.uniform(0, 0.4) * linear_ramp(rng, len(alpha)))[..., None]
    if rng.random() < patterned:  # a two-colour pattern: a shape is known by its outline, not its texture
        stripes = np.sin(linear_ramp(rng, len(alpha)) * rng.uniform(6, 16)) > 0
        fill = np.where(stripes[..., None], fill, random_colour(rng))
    return image * (1 - alpha[..., None]) + fill * alpha[..., None]


def _distractors(image: np.ndarray, rng: Rng, count: int) -> np.ndarray:
    """Lines and partial shapes (cut by the frame, or small): clutter a classifier must ignore."""
    size = len(image)
    for _ in range(count):
        if rng.random() < 0.4:
            strokes = [rng.uniform(-4, size + 4, (int(rng.integers(2, 4)), 2))]
            alpha = stroke_mask(strokes, rng.uniform(0.7, 2.5), size)
        else:
            kind = SHAPES[rng.integers(len(SHAPES))]
            centre, radius = rng.uniform(0, size, 2), rng.uniform(0.08, 0.16) * size
            if rng.random() < 0.5:  # larger, at the frame and partly outside it
                centre[rng.integers(2)] = rng.choice([-0.1, 1.1]) * size
                radius = rng.uniform(0.2, 0.4) * size
            alpha = _place(_outline(kind, rng), rng, radius, centre)
        image = _paint(image, alpha, rng, random_colour(rng))
    return image


def shape(label: int, rng: Rng, size: int = SIZE_RGB) -> np.ndarray:
    """A CIFAR-like picture of shape SHAPES[label]: (size, size, 3) uint8."""
    return _picture(label, rng, size, random_colour)


def shape100(label: int, rng: Rng, size: int = SIZE_RGB) -> np.ndarray:
    """A CIFAR-100-like picture: class = (shape SHAPES[label // 10], hue band label % 10 of the object).

    Background and distractors keep any colour, so a hue is told from the object, not the frame.
    """

    def tinted(rng: Rng) -> np.ndarray:  # hue within its tenth of the circle, clearly saturated
        return hsv((label % 10 + rng.uniform(0.15, 0.85)) / 10, rng.uniform(0.55, 1.0), rng.uniform(0.35, 1.0))

    return _picture(label // 10, rng, size, tinted)


def _picture(kind: int, rng: Rng, size: int, object_colour: Callable[[Rng], np.ndarray]) -> np.ndarray:
    image = _background(rng, size)
    image = _distractors(image, rng, int(rng.integers(0, MAX_DISTRACTORS + 1)))
    centre = size / 2 + np.clip(rng.normal(0, 0.08 * size, 2), -0.15 * size, 0.15 * size)
    alpha = _place(_outline(SHAPES[kind], rng), rng, rng.uniform(0.28, 0.42) * size, centre)
    behind = (image * alpha[..., None]).sum((0, 1)) / max(float(alpha.sum()), 1.0)
    luma = np.array([0.3, 0.59, 0.11], np.float32)
    for _ in range(10):  # mostly clear against what is behind it (lightness, not hue); sometimes, as in photos, barely
        colour = object_colour(rng)
        if abs(float((colour - behind) @ luma)) > CONTRAST:
            break
    image = _paint(image, alpha, rng, colour, patterned=PATTERNED)
    if rng.random() < OCCLUDED:  # a line across the object: occlusion
        image = _paint(
            image, stroke_mask([rng.uniform(0, size, (2, 2))], rng.uniform(0.7, 2), size), rng, random_colour(rng)
        )
    light = 1 + rng.uniform(0, 0.5) * linear_ramp(rng, size)
    mean = image.mean()
    image = ((image - mean) * rng.uniform(0.6, 1.2) + mean + rng.uniform(-0.12, 0.12)) * light[..., None]
    image += rng.normal(0, rng.uniform(0.01, 0.04), image.shape)
    return (np.clip(image, 0, 1) * 255 + 0.5).astype(np.uint8)
