"""Benchmark data: the default dataset (digits), and larger generated versions of it.

`raw(work, scale)` writes a raw snapshot (the download stage's format) of digits repeated `scale`
times, each copy shifted by up to a pixel and with a little noise, so that a larger dataset is not
just the same bytes again; `prepared(work, scale)` runs stats and preprocess on it as the stages do.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import ROOT
from tasks.core.config.data import DataConfig
from tasks.core.config.params import Params
from tasks.core.config.yaml_io import load_params
from tasks.data.download import download
from tasks.data.formats import RawDataset, read_raw, write_raw
from tasks.data.preprocess import preprocess
from tasks.data.stats import compute_stats


def params() -> Params:
    """The repository's params.yaml: benchmarks measure the defaults users get."""
    return load_params(ROOT / "params.yaml")


def raw(work: Path, scale: int = 1, seed: int = 0) -> Path:
    """`work/data-x<scale>`: digits, `scale` times over; returns the snapshot's folder."""
    out = work / f"data-x{scale}"
    if (out / "meta.json").exists():
        return out
    base = work / "data-x1"
    if not (base / "meta.json").exists():
        download(DataConfig(source="digits"), base, work / "cache")
    if scale == 1:
        return base
    digits = read_raw(base)
    rng = np.random.default_rng(seed)
    copies = [np.asarray(digits.images)]
    for _ in range(scale - 1):
        shifted = np.roll(np.asarray(digits.images), tuple(rng.integers(-1, 2, size=2)), axis=(1, 2)).astype(np.int16)
        noisy = shifted + rng.integers(-8, 9, size=shifted.shape, dtype=np.int16)
        copies.append(np.clip(noisy, 0, 255).astype(np.uint8))
    labels = np.tile(digits.labels, scale)
    write_raw(RawDataset(np.concatenate(copies), labels, digits.classes, f"digits-x{scale}"), out)
    return out


def prepared(work: Path, scale: int = 1) -> Path:
    """`work/pre-x<scale>`: stats + preprocess of `raw(work, scale)` with the default params."""
    out = work / f"pre-x{scale}"
    if (out / "meta.json").exists():
        return out
    p = params()
    data = raw(work, scale)
    stats = compute_stats(data, p.split, p.seed, p.stats.chunk_size)
    (work / f"stats-x{scale}.json").write_text(json.dumps(asdict(stats)))
    preprocess(data, stats, p.split, p.seed, out)
    return out


def random_rgb_batch(batch: int) -> tuple[Any, Any]:
    """`batch` random 32x32 RGB images and labels of 10 classes, the same for every seed-0 process: what
    B9's and B13's training steps run on (the kernels' cost does not depend on what the images show)."""
    import torch  # after the caller's process was started in its CPU mode (portable_cost.py's scripts)

    generator = torch.Generator().manual_seed(0)
    return torch.rand(batch, 3, 32, 32, generator=generator), torch.randint(0, 10, (batch,), generator=generator)
