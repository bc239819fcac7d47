"""Check datasets of our own making: realistic images generated offline, deterministically, in seconds.

The default dataset (scikit-learn's 8x8 digits) is a toy; these have the size and structure of the
usual benchmarks, so that accuracy and timing claims can be checked beyond it without a download:

    glyphs     28x28 grey, 10 classes  MNIST-like: digits from jittered stroke templates, random pen width,
                                       affine (rotation, shear, aspect), blur and noise, white on black
    shapes     32x32 RGB, 10 classes   CIFAR-like: an object shape of random colour, size and rotation on a
                                       cluttered background, with distractor fragments, uneven light and noise
    shapes100  32x32 RGB, 100 classes  CIFAR-100-like: the same pictures, the class also naming the object's
                                       hue band (10 shapes x 10 hues; the background keeps any colour)
    garments   28x28 grey, 10 classes  Fashion-MNIST-like: jittered garment silhouettes with textured fill

Every image is a pure function of (class, rng); the rng of image `index` of class `label` is seeded
with (seed, label, index) alone, so a dataset does not depend on generation order, and the first n
images per class of a larger set are the n of a smaller one. Outlines are drawn at SS times the size
and box-filtered down (anti-aliasing) with PIL, whose own drawing needs no system font. Class lists are
sorted, so that ImageFolder's label (the sorted folder names) is the label here.

    python -m benchmarks.synthetic_images shapes /tmp/shapes --splits train=500,test=100
    python -m benchmarks.synthetic_images glyphs /tmp/glyphs --per-class 1000 --seed 1
    python -m benchmarks.synthetic_images garments --preview /tmp/garments.png
    python -m benchmarks.synthetic_images shapes --check        # logistic regression vs a small CNN (minutes)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from tasks.core.atomic import atomic_dir, atomic_file

Rng = np.random.Generator
Strokes = list[np.ndarray]  # polylines, (n, 2) arrays of (x, y), y down
SS = 4  # supersampling: outlines are drawn at SS x the size, then box-filtered down
SIZE_RGB = 32  # shapes: CIFAR's size
# How cluttered `shapes` is, set so that a small CNN trained on 500 images a class scores ~85%, not 100%:
# up to 2 distractors, a patterned object 1 in 10, a line across it 1 in 7, a lightness step of 0.3 between
# object and background when one can be had in 10 colour draws (~8% of the time it cannot: low contrast).
MAX_DISTRACTORS, PATTERNED, OCCLUDED, CONTRAST = 2, 0.1, 0.15, 0.3


# ---------------------------------------------------------------------------------------------------- geometry


def _rotation(degrees: float) -> np.ndarray:
    t = math.radians(degrees)
    return np.array([[math.cos(t), -math.sin(t)], [math.sin(t), math.cos(t)]])


def _chaikin(points: np.ndarray, rounds: int) -> np.ndarray:
    """Corner cutting: a polyline becomes a smooth curve through the same ends (a pen does not make kinks)."""
    for _ in range(rounds):
        if len(points) < 3:
            return points
        a, b = points[:-1], points[1:]
        cut = np.stack([0.75 * a + 0.25 * b, 0.25 * a + 0.75 * b], axis=1).reshape(-1, 2)
        points = np.concatenate([points[:1], cut, points[-1:]])
    return points


def _regular(n: int, radius: float = 1.0, phase: float = -90.0) -> np.ndarray:
    t = np.radians(phase + 360.0 * np.arange(n) / n)
    return radius * np.stack([np.cos(t), np.sin(t)], axis=1)


def _mask(polygons: list[np.ndarray], holes: list[np.ndarray], size: int) -> np.ndarray:
    """Coverage in [0, 1] of `polygons` minus `holes` (pixel coordinates of a size x size image)."""
    canvas = Image.new("L", (size * SS, size * SS), 0)
    draw = ImageDraw.Draw(canvas)
    for fill, group in ((255, polygons), (0, holes)):
        for polygon in group:
            draw.polygon([tuple(p) for p in (polygon * SS).tolist()], fill=fill)
    return np.asarray(canvas.resize((size, size), Image.Resampling.BOX), dtype=np.float32) / 255.0


def _stroke_mask(strokes: Strokes, width: float, size: int) -> np.ndarray:
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


def _smooth_noise(rng: Rng, size: int, cells: int, channels: int) -> np.ndarray:
    """Low-frequency noise in [0, 1]: a cells x cells random grid, bicubically enlarged."""
    grid = (rng.random((cells, cells, channels)) * 255).astype(np.uint8)
    image = Image.fromarray(grid[..., 0] if channels == 1 else grid)
    out = np.asarray(image.resize((size, size), Image.Resampling.BICUBIC), dtype=np.float32) / 255.0
    return out.reshape(size, size, channels)


@functools.cache
def _grid(size: int) -> np.ndarray:
    """(y, x) of every pixel, in [-0.5, 0.5]; cached (drawn from many times per image), never written to."""
    grid = np.mgrid[0:size, 0:size].astype(np.float32) / (size - 1) - 0.5
    grid.flags.writeable = False
    return grid


def _ramp(rng: Rng, size: int) -> np.ndarray:
    """A linear ramp in [-1, 1] across the image, in a random direction."""
    t = rng.uniform(0, 2 * math.pi)
    y, x = _grid(size)
    ramp = x * math.cos(t) + y * math.sin(t)
    return ramp / max(float(np.abs(ramp).max()), 1e-6)


def _colour(rng: Rng) -> np.ndarray:
    """Any colour, drawn the same way for objects, backgrounds and distractors: colour never tells the class."""
    return _hsv(rng.random(), rng.uniform(0.0, 1.0), rng.uniform(0.15, 1.0))


def _hsv(h: float, s: float, v: float) -> np.ndarray:
    k = (np.array([5.0, 3.0, 1.0]) + h * 6) % 6
    return (v - v * s * np.clip(np.minimum(k, 4 - k), 0, 1)).astype(np.float32)


# ---------------------------------------------------------------------------------------------------- glyphs
# Digits in a box x in [0, 0.6], y in [0, 1] (y down). Angles in degrees: 0 right, 90 down, -90 up.
# `sloppy` (per image) scales every random move: some writers are neat, some are not.


def _arc(rng: Rng, sloppy: float, cx: float, cy: float, rx: float, ry: float, t0: float, t1: float) -> np.ndarray:
    """An elliptic arc whose centre, radii and ends vary from hand to hand."""
    cx, cy = cx + rng.normal(0, 0.025 * sloppy), cy + rng.normal(0, 0.025 * sloppy)
    rx, ry = rx * (1 + rng.normal(0, 0.1 * sloppy)), ry * (1 + rng.normal(0, 0.08 * sloppy))
    t0, t1 = t0 + rng.normal(0, 10 * sloppy), t1 + rng.normal(0, 10 * sloppy)
    t = np.radians(np.linspace(t0, t1, max(6, int(abs(t1 - t0) / 20))))
    return np.stack([cx + rx * np.cos(t), cy + ry * np.sin(t)], axis=1)


def _pts(rng: Rng, sloppy: float, *points: tuple[float, float]) -> np.ndarray:
    """Control points, each moved, with a jittered midpoint on every segment (hand-drawn lines bow a little)."""
    p = np.asarray(points, dtype=np.float64)
    p = p + rng.normal(0, 0.035 * sloppy, p.shape)
    mids = (p[:-1] + p[1:]) / 2 + rng.normal(0, 0.02 * sloppy, (len(p) - 1, 2))
    out = np.empty((2 * len(p) - 1, 2))
    out[0::2], out[1::2] = p, mids
    return out


def _stroke(rng: Rng, *parts: np.ndarray) -> np.ndarray:
    """One pen stroke through `parts` in order, with a little tremor, smoothed."""
    p = np.concatenate(parts)
    return _chaikin(p + rng.normal(0, 0.008, p.shape), 2)


def _digit(label: int, rng: Rng, sloppy: float) -> Strokes:  # one case per digit: read it as a table
    a, p = functools.partial(_arc, rng, sloppy), functools.partial(_pts, rng, sloppy)
    s = functools.partial(_stroke, rng)
    v = rng.random()  # which of a digit's usual ways of writing it
    if label == 0:
        return [s(a(0.3, 0.5, 0.27, 0.48, -95, 272))] if v < 0.8 else [s(a(0.3, 0.5, 0.25, 0.48, -60, 330))]
    if label == 1:
        top = ((0.12, 0.24), (0.36, 0.0)) if v < 0.4 else ((0.36, 0.0),)
        strokes = [s(p(*top, (0.31, 1.0)))]
        return strokes + [s(p((0.1, 1.0), (0.52, 1.0)))] if v < 0.12 else strokes
    if label == 2:
        if v < 0.25:  # a loop where the curve meets the base
            return [
                s(
                    a(0.3, 0.28, 0.26, 0.26, -165, 25),
                    p((0.08, 0.9)),
                    a(0.14, 0.86, 0.1, 0.1, 90, -270)[3:],
                    p((0.6, 0.94)),
                )
            ]
        return [s(a(0.3, 0.28, 0.26, 0.26, -165, 25), p((0.04, 0.97), (0.6, 0.97)))]
    if label == 3:
        if v < 0.2:  # flat top
            return [s(p((0.02, 0.02), (0.56, 0.02), (0.22, 0.42)), a(0.3, 0.71, 0.28, 0.28, -100, 155))]
        return [s(a(0.3, 0.26, 0.25, 0.23, -160, 95), a(0.3, 0.73, 0.28, 0.26, -95, 155))]
    if label == 4:
        if v < 0.6:
            return [s(p((0.42, 0.0), (0.0, 0.66), (0.6, 0.66))), s(p((0.46, 0.22), (0.44, 1.0)))]
        return [s(p((0.08, 0.0), (0.03, 0.6), (0.6, 0.6))), s(p((0.49, 0.03), (0.47, 1.0)))]
    if label == 5:
        body = s(p((0.12, 0.03), (0.08, 0.45)), a(0.3, 0.68, 0.27, 0.29, -140, 150))
        return [body, s(p((0.12, 0.03), (0.57, 0.02)))]
    if label == 6:
        if v < 0.3:  # a straight back
            return [s(p((0.45, 0.0), (0.06, 0.7)), a(0.3, 0.74, 0.25, 0.25, 170, -175))]
        return [s(a(0.62, 0.72, 0.57, 0.72, -108, -180), a(0.3, 0.72, 0.26, 0.27, 180, -175))]
    if label == 7:
        start = ((0.0, 0.14), (0.02, 0.02)) if v < 0.2 else ((0.0, 0.02),)
        strokes = [s(p(*start, (0.6, 0.02), (0.4, 0.45), (0.25, 1.0)))]
        return strokes + [s(p((0.2, 0.52), (0.56, 0.5)))] if v > 0.8 else strokes
    if label == 8:
        if v < 0.4:  # one stroke: an S down, then back up
            return [
                s(
                    a(0.3, 0.26, 0.23, 0.24, 0, -250),
                    a(0.3, 0.72, 0.28, 0.26, -90, 270),
                    a(0.3, 0.26, 0.23, 0.24, 110, 0),
                )
            ]
        return [s(a(0.3, 0.26, 0.22, 0.24, -90, 272)), s(a(0.3, 0.73, 0.28, 0.26, -90, 272))]
    stem = p((0.57, 0.35), (0.48, 1.0)) if v < 0.7 else p((0.57, 0.35), (0.55, 0.8), (0.3, 1.0))
    return [s(a(0.3, 0.3, 0.27, 0.28, 10, 370), stem)]


def _warp(points: np.ndarray, rng: Rng, amount: float) -> np.ndarray:
    """A smooth random bend of the whole digit (an elastic distortion, applied to the pen path)."""
    f, phase = rng.uniform(0.5, 1.5, 2), rng.uniform(0, 2 * math.pi, 2)
    a = rng.normal(0, amount, 2)
    bend = np.stack(
        [
            a[0] * np.sin(2 * math.pi * f[0] * points[:, 1] + phase[0]),
            a[1] * np.sin(2 * math.pi * f[1] * points[:, 0] + phase[1]),
        ],
        axis=1,
    )
    return points + bend


def glyph(label: int, rng: Rng, size: int = 28) -> np.ndarray:
    """An MNIST-like handwritten digit `label`: (size, size) uint8, white on black, fitted in a 20/28 box."""
    sloppy = rng.uniform(0.5, 1.8)
    strokes = _digit(label, rng, sloppy)
    shear = np.array([[1.0, rng.uniform(-0.35, 0.35)], [0.0, 1.0]])
    affine = _rotation(rng.uniform(-15, 15)) @ shear @ np.diag([rng.uniform(0.7, 1.3), 1.0])
    warp = rng.integers(2**32)  # one bend for all strokes
    strokes = [_warp(st, np.random.default_rng(warp), 0.04 * sloppy) for st in strokes]
    strokes = [(st - (0.3, 0.5)) @ affine.T for st in strokes]
    every = np.concatenate(strokes)
    lo, hi = every.min(axis=0), every.max(axis=0)
    # MNIST: each digit scaled to fit a 20x20 box, then centred in 28x28.
    scale = size * (20 / 28) * rng.uniform(0.78, 1.0) / float((hi - lo).max())
    centre = size / 2 + np.clip(rng.normal(0, 1.0, 2), -2.5, 2.5)
    strokes = [(st - (lo + hi) / 2) * scale + centre for st in strokes]
    ink = _stroke_mask(strokes, rng.uniform(1.1, 3.6), size)
    blur = ImageFilter.GaussianBlur(rng.uniform(0.2, 0.7))
    ink = np.asarray(Image.fromarray((ink * 255).astype(np.uint8)).filter(blur)).astype(np.float32)
    ink *= 255 * rng.uniform(0.85, 1.0) / max(float(ink.max()), 1.0)
    ink += rng.normal(0, rng.uniform(0, 6), ink.shape)
    return np.clip(ink, 0, 255).astype(np.uint8)


# ---------------------------------------------------------------------------------------------------- shapes

SHAPES = ["arrow", "circle", "crescent", "cross", "heart", "pentagon", "ring", "square", "star", "triangle"]


def _outline(kind: str, rng: Rng) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(filled polygons, holes) of a shape of radius ~1 centred on 0, corners slightly moved."""
    holes: list[np.ndarray] = []
    if kind == "arrow":
        w, head = rng.uniform(0.14, 0.26), rng.uniform(0.45, 0.65)
        x = rng.uniform(0.0, 0.35)
        shape = np.array([(-1, -w), (x, -w), (x, -head), (1, 0), (x, head), (x, w), (-1, w)])
    elif kind in ("circle", "ring"):
        shape = _regular(48)
        if kind == "ring":
            holes = [_regular(48, rng.uniform(0.45, 0.65)) + rng.normal(0, 0.05, 2)]
    elif kind == "crescent":
        shape = _regular(48)
        holes = [_regular(48, rng.uniform(0.8, 0.95)) + (rng.uniform(0.35, 0.6), rng.normal(0, 0.05))]
    elif kind == "cross":
        w = rng.uniform(0.25, 0.38)
        arm = np.array([(w, -w), (1, -w), (1, w)])
        shape = np.concatenate([arm @ _rotation(90 * k).T for k in range(4)])
    elif kind == "heart":
        t = np.linspace(0, 2 * math.pi, 48, endpoint=False)
        x, y = 16 * np.sin(t) ** 3, -(13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t))
        shape = np.stack([x, y + 2.5], axis=1) / 16
    elif kind == "pentagon":
        shape = _regular(5)
    elif kind == "square":
        shape = _regular(4, phase=45) * 0.95
    elif kind == "star":
        shape = _regular(10, 1.1) * np.where(np.arange(10) % 2, rng.uniform(0.38, 0.55), 1.0)[:, None]
    else:  # triangle
        shape = _regular(3, 1.1) + (0, 0.2)
    return [shape + rng.normal(0, 0.03, shape.shape)], holes


def _place(shape: tuple[list[np.ndarray], list[np.ndarray]], rng: Rng, radius: float, centre: np.ndarray) -> np.ndarray:
    """Coverage of `shape` (filled, holes) turned and a little stretched at random, `radius` px around `centre`."""
    m = _rotation(rng.uniform(0, 360)) @ np.diag([rng.uniform(0.85, 1.15), 1.0]) * radius
    polygons, holes = shape
    return _mask([p @ m.T + centre for p in polygons], [h @ m.T + centre for h in holes], SIZE_RGB)


def _background(rng: Rng, size: int) -> np.ndarray:
    """Clutter: a gradient, stripes, blobs or smooth noise, in random colours, often two blended."""
    out = np.zeros((size, size, 3), np.float32)
    for layer in range(1 if rng.random() < 0.5 else 2):
        kind = rng.integers(4)
        c0, c1 = _colour(rng), _colour(rng)
        if kind == 0:
            t = (_ramp(rng, size) + 1) / 2
        elif kind == 1:
            t = 0.5 + 0.5 * np.sin(_ramp(rng, size) * rng.uniform(3, 14) + rng.uniform(0, 2 * math.pi))
            t = t if rng.random() < 0.5 else (t > 0.5).astype(np.float32)
        elif kind == 2:
            t = _smooth_noise(rng, size, int(rng.integers(2, 7)), 1)[..., 0]
        else:
            y, x = _grid(size)
            t = np.zeros((size, size), np.float32)
            for cx, cy, r in rng.uniform((-0.5, -0.5, 0.06), (0.5, 0.5, 0.33), (int(rng.integers(2, 6)), 3)):
                t = np.maximum(t, np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r)))
        layer_image = c0 + (c1 - c0) * t[..., None]
        out = layer_image if layer == 0 else out * (1 - (w := rng.uniform(0.2, 0.5))) + layer_image * w
    return out + rng.normal(0, rng.uniform(0.0, 0.05), out.shape).astype(np.float32)


def _paint(image: np.ndarray, alpha: np.ndarray, rng: Rng, colour: np.ndarray, patterned: float = 0.25) -> np.ndarray:
    """`image` with `colour` laid over where `alpha` covers it, shaded (a ramp), patterned with odds `patterned`."""
    fill = colour * (1 + rng.uniform(0, 0.4) * _ramp(rng, len(alpha)))[..., None]
    if rng.random() < patterned:  # a two-colour pattern: a shape is known by its outline, not its texture
        stripes = np.sin(_ramp(rng, len(alpha)) * rng.uniform(6, 16)) > 0
        fill = np.where(stripes[..., None], fill, _colour(rng))
    return image * (1 - alpha[..., None]) + fill * alpha[..., None]


def _distractors(image: np.ndarray, rng: Rng, count: int) -> np.ndarray:
    """Lines and partial shapes (cut by the frame, or small): clutter a classifier must ignore."""
    size = len(image)
    for _ in range(count):
        if rng.random() < 0.4:
            strokes = [rng.uniform(-4, size + 4, (int(rng.integers(2, 4)), 2))]
            alpha = _stroke_mask(strokes, rng.uniform(0.7, 2.5), size)
        else:
            kind = SHAPES[rng.integers(len(SHAPES))]
            centre, radius = rng.uniform(0, size, 2), rng.uniform(0.08, 0.16) * size
            if rng.random() < 0.5:  # larger, at the frame and partly outside it
                centre[rng.integers(2)] = rng.choice([-0.1, 1.1]) * size
                radius = rng.uniform(0.2, 0.4) * size
            alpha = _place(_outline(kind, rng), rng, radius, centre)
        image = _paint(image, alpha, rng, _colour(rng))
    return image


def shape(label: int, rng: Rng, size: int = SIZE_RGB) -> np.ndarray:
    """A CIFAR-like picture of shape SHAPES[label]: (size, size, 3) uint8."""
    return _picture(label, rng, size, _colour)


def shape100(label: int, rng: Rng, size: int = SIZE_RGB) -> np.ndarray:
    """A CIFAR-100-like picture: class = (shape SHAPES[label // 10], hue band label % 10 of the object).

    Background and distractors keep any colour, so a hue is told from the object, not the frame.
    """

    def tinted(rng: Rng) -> np.ndarray:  # hue within its tenth of the circle, clearly saturated
        return _hsv((label % 10 + rng.uniform(0.15, 0.85)) / 10, rng.uniform(0.55, 1.0), rng.uniform(0.35, 1.0))

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
            image, _stroke_mask([rng.uniform(0, size, (2, 2))], rng.uniform(0.7, 2), size), rng, _colour(rng)
        )
    light = 1 + rng.uniform(0, 0.5) * _ramp(rng, size)
    mean = image.mean()
    image = ((image - mean) * rng.uniform(0.6, 1.2) + mean + rng.uniform(-0.12, 0.12)) * light[..., None]
    image += rng.normal(0, rng.uniform(0.01, 0.04), image.shape)
    return (np.clip(image, 0, 1) * 255 + 0.5).astype(np.uint8)


# ---------------------------------------------------------------------------------------------------- garments
# Silhouettes in a unit box, y down; tops as their right half (x >= 0.5, from the neck down to the hem),
# mirrored. Shoes point left, as in Fashion-MNIST. As there, classes overlap: a shirt may have short
# sleeves, a dress sleeves, a sneaker a high collar; details (collar, zip, seams) are often not visible.

GARMENTS = ["ankle_boot", "bag", "coat", "dress", "pullover", "sandal", "shirt", "sneaker", "trouser", "tshirt"]
# fmt: off
_LONG_SLEEVE = [(0.95, 0.3), (1.0, 0.94), (0.86, 0.95), (0.81, 0.42)]  # elbow, cuff out, cuff in, armpit
_SHORT_SLEEVE = [(1.0, 0.36), (0.84, 0.44), (0.79, 0.32)]  # sleeve end out, in, armpit
_TOPS = {  # odds of long sleeves, neck depth, hem height
    "coat": (1.0, 0.22, 1.0), "pullover": (0.95, 0.1, 0.94), "shirt": (0.65, 0.16, 0.97), "tshirt": (0.12, 0.12, 0.96),
}
_OUTLINES = {
    "ankle_boot": [(0.0, 0.86), (0.04, 0.72), (0.3, 0.62), (0.44, 0.52), (0.48, 0.08), (0.94, 0.06), (0.96, 0.6),
                   (1.0, 0.8), (1.0, 0.94), (0.0, 0.94)],
    "bag": [(0.05, 0.35), (0.95, 0.35), (1.0, 0.97), (0.0, 0.97)],
    "sandal": [(0.0, 0.7), (1.0, 0.62), (1.0, 0.72), (0.0, 0.78)],
    "sneaker": [(0.0, 0.66), (0.04, 0.52), (0.3, 0.44), (0.48, 0.3), (0.76, 0.26), (0.95, 0.3), (1.0, 0.56),
                (1.0, 0.74), (0.0, 0.74)],
    "trouser": [(0.28, 0.0), (0.72, 0.0), (0.78, 1.0), (0.56, 1.0), (0.5, 0.28), (0.44, 1.0), (0.22, 1.0)],
}
_STRAPS = {  # drawn with the pen, part of the silhouette; a sandal shows some of its straps
    "bag": [[(0.3, 0.36), (0.33, 0.1), (0.5, 0.04), (0.67, 0.1), (0.7, 0.36)],
            [(0.1, 0.36), (0.2, -0.3), (0.5, -0.45), (0.8, -0.3), (0.9, 0.36)]],
    "sandal": [[(0.08, 0.72), (0.22, 0.5), (0.38, 0.68)], [(0.42, 0.67), (0.58, 0.42), (0.74, 0.64)],
               [(0.78, 0.63), (0.86, 0.3), (0.98, 0.62)], [(0.58, 0.42), (0.86, 0.32)], [(0.2, 0.7), (0.5, 0.45)]],
}
_DETAILS = {  # seams, zips, soles: lines of another shade inside the silhouette
    "ankle_boot": [[(0.02, 0.86), (1.0, 0.86)], [(0.5, 0.1), (0.5, 0.5)]],
    "bag": [[(0.05, 0.5), (0.95, 0.5)]],
    "coat": [[(0.5, 0.22), (0.5, 1.0)], [(0.42, 0.02), (0.5, 0.22), (0.58, 0.02)], [(0.62, 0.7), (0.74, 0.7)]],
    "dress": [[(0.38, 0.42), (0.62, 0.42)]],
    "pullover": [[(0.19, 0.88), (0.81, 0.88)], [(0.4, 0.04), (0.5, 0.1), (0.6, 0.04)]],
    "shirt": [[(0.5, 0.16), (0.5, 0.99)], [(0.4, 0.03), (0.5, 0.16), (0.6, 0.03)], [(0.6, 0.25), (0.7, 0.25)]],
    "sneaker": [[(0.02, 0.66), (1.0, 0.66)], [(0.36, 0.42), (0.44, 0.36), (0.52, 0.31)]],
    "trouser": [[(0.28, 0.06), (0.72, 0.06)]],
}
# fmt: on


def _half_outline(kind: str, rng: Rng) -> list[tuple[float, float]]:
    """The right half of a top or a dress, from the middle of the neckline to the middle of the hem."""
    if kind == "dress":
        shoulder = [(0.74, 0.06), (0.86, 0.22), (0.74, 0.28), (0.66, 0.3)] if rng.random() < 0.35 else [(0.66, 0.26)]
        return [(0.5, 0.07), (0.6, 0.02), (0.66, 0.03), *shoulder, (0.63, 0.42), (rng.uniform(0.75, 0.95), 0.99)]
    long_odds, neck, hem = _TOPS[kind]
    sleeve = _LONG_SLEEVE if rng.random() < long_odds else _SHORT_SLEEVE
    body = 0.5 + rng.uniform(0.27, 0.34)
    return [(0.5, neck), (0.61, 0.03), (0.82, 0.08), *sleeve, (body, hem)]


def _garment_parts(kind: str, rng: Rng) -> tuple[np.ndarray, Strokes, Strokes]:
    """(outline, straps, detail lines) of `kind`, every point moved a little (no two garments alike)."""
    if kind in _TOPS or kind == "dress":
        half = np.asarray(_half_outline(kind, rng))
        outline = np.concatenate([half, (half * (-1, 1) + (1, 0))[::-1]])
    else:
        outline = np.asarray(_OUTLINES[kind], dtype=np.float64)
        if kind == "sneaker" and rng.random() < 0.3:  # a high-top: the collar nearly as high as a boot's
            outline[4:6, 1] -= rng.uniform(0.1, 0.2)
    outline = outline + rng.normal(0, 0.025, outline.shape)
    straps = _STRAPS.get(kind, [])
    if straps:  # a bag has a handle, a shoulder strap or neither; a sandal 2 to 5 straps
        keep = rng.random(len(straps)) < 0.6 if kind == "sandal" else np.eye(3, 2, dtype=bool)[rng.integers(3)]
        straps = [s for s, k in zip(straps, keep, strict=True) if k]
    straps = [_chaikin(np.asarray(s) + rng.normal(0, 0.025, (len(s), 2)), 2) for s in straps]
    details = [np.asarray(s) + rng.normal(0, 0.015, (len(s), 2)) for s in _DETAILS.get(kind, []) if rng.random() < 0.5]
    return outline, straps, details


def _fabric(rng: Rng, size: int) -> np.ndarray:
    """Cloth in [0, 1]: a grey level with folds (smooth noise), sometimes stripes or a knit."""
    fabric = rng.uniform(0.15, 1.0) * (1 + rng.uniform(0.1, 0.6) * (_smooth_noise(rng, size, 5, 1)[..., 0] - 0.5))
    pattern = rng.random()
    if pattern < 0.25:
        stripes = np.sin(_ramp(rng, size) * rng.uniform(8, 30)) > 0
        fabric = np.where(stripes, fabric, fabric * rng.uniform(0.3, 0.8))
    elif pattern < 0.4:
        fabric = fabric * (1 - rng.uniform(0.2, 0.6) * (_smooth_noise(rng, size, 12, 1)[..., 0] > 0.6))
    return fabric + rng.normal(0, 0.04, (size, size))


def garment(label: int, rng: Rng, size: int = 28) -> np.ndarray:
    """A Fashion-MNIST-like silhouette of GARMENTS[label]: (size, size) uint8, light on black, filling the frame."""
    outline, straps, details = _garment_parts(GARMENTS[label], rng)
    affine = _rotation(rng.uniform(-8, 8)) @ np.diag([rng.uniform(0.75, 1.25), rng.uniform(0.9, 1.1)])
    parts = [p @ affine.T for p in (outline, *straps, *details)]
    every = np.concatenate(parts[: 1 + len(straps)])
    lo, hi = every.min(axis=0), every.max(axis=0)
    scale = size * rng.uniform(0.84, 1.0) / float((hi - lo).max())  # Fashion-MNIST: the longer side fills the frame
    centre = size / 2 + rng.normal(0, 0.6, 2)
    parts = [(p - (lo + hi) / 2) * scale + centre for p in parts]
    strap_width = rng.uniform(1.2, 2.2)
    cover = np.maximum(_mask([parts[0]], [], size), _stroke_mask(parts[1 : 1 + len(straps)], strap_width, size))
    seams = _stroke_mask(parts[1 + len(straps) :], rng.uniform(0.6, 1.4), size) * cover
    image = _fabric(rng, size) * (1 - seams * rng.uniform(-0.4, 0.7)) * cover
    return (np.clip(image, 0, 1) * 255 + 0.5).astype(np.uint8)


# ---------------------------------------------------------------------------------------------------- datasets


@dataclass(frozen=True)
class Dataset:
    """A generator: `draw(label, rng)` -> one uint8 image of `shape` (H, W, C); labels index `classes`."""

    classes: tuple[str, ...]
    shape: tuple[int, int, int]
    draw: Callable[[int, Rng], np.ndarray]


DATASETS = {
    "glyphs": Dataset(tuple(str(d) for d in range(10)), (28, 28, 1), glyph),
    "shapes": Dataset(tuple(SHAPES), (SIZE_RGB, SIZE_RGB, 3), shape),
    "shapes100": Dataset(tuple(f"{k}_hue{h}" for k in SHAPES for h in range(10)), (SIZE_RGB, SIZE_RGB, 3), shape100),
    "garments": Dataset(tuple(GARMENTS), (28, 28, 1), garment),
}


def _dataset(name: str) -> Dataset:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}: one of {', '.join(DATASETS)}")
    return DATASETS[name]


def generate(name: str, n_per_class: int, seed: int = 0, start: int = 0) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """`n_per_class` images of every class of dataset `name`: (images (N, H, W, C) uint8, labels int64, classes).

    Classes are interleaved (0, 1, ..., 9, 0, 1, ...), so any prefix is balanced. The images of class
    `c` are numbers start, start + 1, ... of that class, each drawn from an rng seeded with (seed, c,
    number): disjoint ranges of numbers are disjoint sets, and a number is the same image in any call.
    """
    dataset = _dataset(name)
    if n_per_class < 0 or seed < 0 or start < 0:
        raise ValueError(f"n_per_class, seed and start must be >= 0, not {n_per_class}, {seed}, {start}")
    k = len(dataset.classes)
    labels = np.tile(np.arange(k, dtype=np.int64), n_per_class)
    images = np.empty((len(labels), *dataset.shape), np.uint8)
    for i, label in enumerate(labels.tolist()):
        images[i] = dataset.draw(label, np.random.default_rng([seed, label, start + i // k])).reshape(dataset.shape)
    return images, labels, list(dataset.classes)


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
    dataset = _dataset(name)
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


# ---------------------------------------------------------------------------------------------------- difficulty


def _linear_accuracy(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray) -> dict:
    """Multinomial logistic regression on standardised raw pixels: what a model without spatial structure gets."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    t0 = time.perf_counter()
    scaler = StandardScaler().fit(x_train.reshape(len(x_train), -1).astype(np.float32))
    features = [scaler.transform(x.reshape(len(x), -1).astype(np.float32)) for x in (x_train, x_test)]
    # C = 0.01: the best of 1, 0.1, 0.01 and 0.001 on glyphs and garments (shapes: 10-14% at all four).
    model = LogisticRegression(C=0.01, max_iter=1000).fit(features[0], y_train)
    return {"linear_acc": float((model.predict(features[1]) == y_test).mean()), "linear_s": time.perf_counter() - t0}


def _pooled_cnn(channels: int, classes: int, width: int = 32):  # -> torch.nn.Module (torch imported lazily)
    """A CIFAR-style small CNN: four conv blocks with three 2x2 pools, so that its view (~40 px) takes in a
    whole object; small_cnn (one pool, ~10 px) sees corners and strokes, not shapes."""
    from torch import nn

    def block(c_in: int, c_out: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())

    w = width
    return nn.Sequential(
        *(block(channels, w), nn.MaxPool2d(2), block(w, 2 * w), nn.MaxPool2d(2)),
        *(block(2 * w, 4 * w), nn.MaxPool2d(2), block(4 * w, 4 * w)),
        *(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, classes)),
    )


def _cnn_accuracy(
    x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray, epochs: int, model_name: str
) -> dict:
    """`model_name` (pooled_cnn, or a tasks.train.models name) trained with params.yaml's recipe, plain
    PyTorch on the CPU."""
    import torch
    import torch.nn.functional as F

    from tasks.train.models import Classifier, build_model, predict

    train = torch.from_numpy(x_train).permute(0, 3, 1, 2).contiguous()
    labels = torch.from_numpy(y_train)
    pixels = train.float().div(255)
    mean, std, classes = pixels.mean((0, 2, 3)).tolist(), pixels.std((0, 2, 3)).tolist(), int(y_train.max()) + 1
    if model_name == "pooled_cnn":
        model = Classifier(_pooled_cnn(len(mean), classes), mean, std)
    else:
        model = build_model(model_name, classes, mean, std, list(x_train.shape[1:3]))
    # params.yaml's train section: SGD lr 0.05, momentum 0.9, weight decay 5e-4, cosine, batch 64,
    # label smoothing 0.1, random shift 1 px.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    t0 = time.perf_counter()
    for _ in range(epochs):
        model.train()
        for batch in torch.randperm(len(train)).split(64):
            dy, dx = torch.randint(-1, 2, (2,)).tolist()  # one random shift per batch, zero-filled
            x = torch.roll(F.pad(train[batch].float().div(255), (1, 1, 1, 1)), (dy, dx), (2, 3))[..., 1:-1, 1:-1]
            loss = F.cross_entropy(model(x), labels[batch], label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        scheduler.step()
    train_s = time.perf_counter() - t0
    logits = predict(model, x_test.transpose(0, 3, 1, 2).copy(), torch.device("cpu"), 256)
    accuracy = float((logits.argmax(1).numpy() == y_test).mean())
    return {"model": model_name, "cnn_acc": accuracy, "cnn_train_s": train_s, "epochs": epochs}


def difficulty(
    name: str,
    train_per_class: int = 500,
    test_per_class: int = 100,
    epochs: int = 15,
    seed: int = 0,
    model: str = "pooled_cnn",
    threads: int = 2,
) -> dict:
    """Test accuracy of a linear model on pixels and of a CNN, trained on `train_per_class` images a class.

    The test images are the numbers after the training ones: unseen. A dataset with real structure
    separates the two clearly; one that a CNN gets entirely right is too easy to tell models apart.
    """
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    x_train, y_train, _ = generate(name, train_per_class, seed)
    x_test, y_test, _ = generate(name, test_per_class, seed, start=train_per_class)
    result = {"dataset": name, "train": len(y_train), "test": len(y_test), "threads": threads}
    result["generate_s"] = time.perf_counter() - t0
    result |= _linear_accuracy(x_train, y_train, x_test, y_test)
    result |= _cnn_accuracy(x_train, y_train, x_test, y_test, epochs, model)
    return result


# ---------------------------------------------------------------------------------------------------- CLI


def _parse_splits(text: str) -> dict[str, int]:
    try:
        return {k.strip(): int(v) for k, v in (item.split("=") for item in text.split(","))}
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected name=count,... like train=500,test=100") from exc


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.synthetic_images", description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=sorted(DATASETS))
    parser.add_argument("folder", nargs="?", type=Path, help="write an ImageFolder tree here")
    parser.add_argument("--per-class", type=int, help="images per class (without --splits)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--splits", type=_parse_splits, help="images per class of each split: train=500,test=100")
    parser.add_argument("--preview", type=Path, help="write a PNG grid of examples per class here")
    parser.add_argument("--check", action="store_true", help="linear vs small_cnn accuracy (--per-class: train size)")
    parser.add_argument("--epochs", type=int, default=15, help="--check: CNN epochs")
    parser.add_argument("--model", default="pooled_cnn", help="--check: pooled_cnn, small_cnn or a torchvision name")
    args = parser.parse_args(argv)
    if args.folder is None and args.preview is None and not args.check:
        parser.error("give a FOLDER, --preview or --check")
    if args.folder is not None:
        if args.per_class is None and args.splits is None:
            parser.error("a FOLDER needs --per-class or --splits")
        t0 = time.perf_counter()
        write_imagefolder(args.folder, args.name, args.per_class, args.seed, args.splits)
        print(f"{args.folder}: written in {time.perf_counter() - t0:.1f} s")
    if args.preview is not None:
        print(preview(args.name, args.preview, seed=args.seed))
    if args.check:
        print(
            json.dumps(
                difficulty(args.name, args.per_class or 500, epochs=args.epochs, seed=args.seed, model=args.model),
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
