"""The garments dataset's images: Fashion-MNIST-like clothing silhouettes with a textured fill."""

from __future__ import annotations

import numpy as np

from benchmarks.synthetic_images.drawing import (
    Rng,
    Strokes,
    chaikin,
    linear_ramp,
    polygon_mask,
    rotation,
    smooth_noise,
    stroke_mask,
)

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
    straps = [chaikin(np.asarray(s) + rng.normal(0, 0.025, (len(s), 2)), 2) for s in straps]
    details = [np.asarray(s) + rng.normal(0, 0.015, (len(s), 2)) for s in _DETAILS.get(kind, []) if rng.random() < 0.5]
    return outline, straps, details


def _fabric(rng: Rng, size: int) -> np.ndarray:
    """Cloth in [0, 1]: a grey level with folds (smooth noise), sometimes stripes or a knit."""
    fabric = rng.uniform(0.15, 1.0) * (1 + rng.uniform(0.1, 0.6) * (smooth_noise(rng, size, 5, 1)[..., 0] - 0.5))
    pattern = rng.random()
    if pattern < 0.25:
        stripes = np.sin(linear_ramp(rng, size) * rng.uniform(8, 30)) > 0
        fabric = np.where(stripes, fabric, fabric * rng.uniform(0.3, 0.8))
    elif pattern < 0.4:
        fabric = fabric * (1 - rng.uniform(0.2, 0.6) * (smooth_noise(rng, size, 12, 1)[..., 0] > 0.6))
    return fabric + rng.normal(0, 0.04, (size, size))


def garment(label: int, rng: Rng, size: int = 28) -> np.ndarray:
    """A Fashion-MNIST-like silhouette of GARMENTS[label]: (size, size) uint8, light on black, filling the frame."""
    outline, straps, details = _garment_parts(GARMENTS[label], rng)
    affine = rotation(rng.uniform(-8, 8)) @ np.diag([rng.uniform(0.75, 1.25), rng.uniform(0.9, 1.1)])
    parts = [p @ affine.T for p in (outline, *straps, *details)]
    every = np.concatenate(parts[: 1 + len(straps)])
    lo, hi = every.min(axis=0), every.max(axis=0)
    scale = size * rng.uniform(0.84, 1.0) / float((hi - lo).max())  # Fashion-MNIST: the longer side fills the frame
    centre = size / 2 + rng.normal(0, 0.6, 2)
    parts = [(p - (lo + hi) / 2) * scale + centre for p in parts]
    strap_width = rng.uniform(1.2, 2.2)
    cover = np.maximum(polygon_mask([parts[0]], [], size), stroke_mask(parts[1 : 1 + len(straps)], strap_width, size))
    seams = stroke_mask(parts[1 + len(straps) :], rng.uniform(0.6, 1.4), size) * cover
    image = _fabric(rng, size) * (1 - seams * rng.uniform(-0.4, 0.7)) * cover
    return (np.clip(image, 0, 1) * 255 + 0.5).astype(np.uint8)
