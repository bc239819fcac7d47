"""The glyphs dataset's images: MNIST-like handwritten digits, drawn with a jittered pen along stroke templates."""

from __future__ import annotations

import functools
import math

import numpy as np
from PIL import Image, ImageFilter

from benchmarks.synthetic_images.drawing import Rng, Strokes, chaikin, rotation, stroke_mask

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
    return chaikin(p + rng.normal(0, 0.008, p.shape), 2)


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
    affine = rotation(rng.uniform(-15, 15)) @ shear @ np.diag([rng.uniform(0.7, 1.3), 1.0])
    warp = rng.integers(2**32)  # one bend for all strokes
    strokes = [_warp(st, np.random.default_rng(warp), 0.04 * sloppy) for st in strokes]
    strokes = [(st - (0.3, 0.5)) @ affine.T for st in strokes]
    every = np.concatenate(strokes)
    lo, hi = every.min(axis=0), every.max(axis=0)
    # MNIST: each digit scaled to fit a 20x20 box, then centred in 28x28.
    scale = size * (20 / 28) * rng.uniform(0.78, 1.0) / float((hi - lo).max())
    centre = size / 2 + np.clip(rng.normal(0, 1.0, 2), -2.5, 2.5)
    strokes = [(st - (lo + hi) / 2) * scale + centre for st in strokes]
    ink = stroke_mask(strokes, rng.uniform(1.1, 3.6), size)
    blur = ImageFilter.GaussianBlur(rng.uniform(0.2, 0.7))
    ink = np.asarray(Image.fromarray((ink * 255).astype(np.uint8)).filter(blur)).astype(np.float32)
    ink *= 255 * rng.uniform(0.85, 1.0) / max(float(ink.max()), 1.0)
    ink += rng.normal(0, rng.uniform(0, 6), ink.shape)
    return np.clip(ink, 0, 255).astype(np.uint8)
