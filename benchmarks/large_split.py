"""B12: one training epoch, and a scoring pass, over a split several times larger than the memory it may use.

    python -m benchmarks.large_split [--gib 4] [--budget-mib 1536] [--work DIR] [--json FILE]

A preprocessed folder is written as the preprocess stage lays it out (uint8 `train_images.npy`,
labels, `meta.json` with every file's sha256), holding `gib` GiB of 64x64 greyscale training images
(seeded noise on class templates), then a fresh process does what the train stage does with it:
`load_split(..., stream=True)` for train and val (each file's sha256 checked first), `build_training`,
one epoch and its validation; then the whole split scored as the evaluate stage scores the test
split. Its peak RSS (VmHWM, reset after the imports: benchmarks/scaling.py) must stay under
`budget_mib`.

The model is a linear probe on 16x16-pooled pixels, not a network: the claim is about memory, and a
network's memory does not depend on the size of the data, while its compute over 4 GiB of pixels
would take a 2-core CPU hours. The epoch's time is then the data path's: reading, shuffling,
shifting and converting every image once.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.data import params
from benchmarks.harness import ROOT, Figure
from benchmarks.scaling import _start_peak, _status_mib
from tasks.core.hashing import file_digest
from tasks.data.formats import NpyWriter
from tasks.data.preprocess import FORMAT, load_split
from tasks.determinism.bootstrap import start

GIB, MIB = 2**30, 2**20
SHAPE = (1, 64, 64)  # C, H, W
CLASSES = 10
CHUNK = 16_384  # images generated and written at a time
BUDGET_MIB = 1536


def write_split_folder(out: Path, train_bytes: int, seed: int = 0) -> int:
    """A preprocessed folder with `train_bytes` of training images (rounded down to whole images) and
    small val and test splits; the number of training images."""
    rng = np.random.default_rng(seed)
    templates = rng.integers(0, 256, (CLASSES, *SHAPE), dtype=np.uint8)
    sizes = {"train": train_bytes // int(np.prod(SHAPE)), "val": 2048, "test": 2048}
    out.mkdir(parents=True, exist_ok=True)
    for name, count in sizes.items():
        labels = (np.arange(count) % CLASSES).astype(np.int64)
        with NpyWriter(out / f"{name}_images.npy", (count, *SHAPE)) as writer:
            for start in range(0, count, CHUNK):
                part = labels[start : start + CHUNK]
                noise = rng.integers(0, 64, (len(part), *SHAPE), dtype=np.uint8)
                writer.write(templates[part] // 2 + noise)
        np.save(out / f"{name}_labels.npy", labels, allow_pickle=False)
    meta = {
        "format": FORMAT,
        "classes": [str(c) for c in range(CLASSES)],
        "split_sizes": sizes,
        "num_classes": CLASSES,
        "image_shape": list(SHAPE),
        "mean": [0.3],
        "std": [0.2],
        "published": [],
        "split_assign": "random",
        "sha256": {p.name: file_digest(p) for p in sorted(out.glob("*.npy"))},
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return sizes["train"]


def child(pre: Path) -> dict[str, Any]:
    """The train stage's data path for one epoch, in this (fresh) process: peak RSS and seconds."""
    p = params()
    start(p.seed, p.determinism.num_threads, strict=p.determinism.strict)
    # torch and the training loop load in the child alone, pinned first: the parent only writes the split
    import torch
    from torch import nn

    from tasks.train.loop import build_training
    from tasks.train.models import predict

    probe = nn.Sequential(nn.AvgPool2d(16), nn.Flatten(), nn.Linear(16, CLASSES))
    cfg = p.train.model_copy(update={"model": "small_cnn", "epochs": 1, "hflip": False, "batch_size": 512})
    before, reset = _start_peak()
    began = time.perf_counter()
    train, val = load_split(pre, "train", stream=True), load_split(pre, "val", stream=True)
    loaded = time.perf_counter()
    training = build_training(cfg, p.seed, train, torch.device("cpu"), model=probe)
    row = training.epoch(1, val)
    done = time.perf_counter()
    # then the whole split scored as evaluate scores the test split (read from its file a few batches at
    # a time, tasks/train/models.py's predict): only the logits stay
    logits = predict(probe, load_split(pre, "train", stream=True).images, torch.device("cpu"), 1024)
    scored = time.perf_counter()
    (peak,) = _status_mib("VmHWM")
    return {
        "before_mib": before,
        "peak_mib": peak,
        "peak_reset": reset,
        "load_s": loaded - began,  # both splits' sha256 checked
        "epoch_s": done - loaded,
        "predict_s": scored - done,  # with the file's sha256 check
        "logits": list(logits.shape),
        "images": len(train.labels),
        "val_accuracy": row["val_accuracy"],
    }


def b12(work: Path, gib: float = 4.0, budget_mib: float = BUDGET_MIB, smoke: bool = False) -> list[Figure]:
    """The figure: peak RSS of one epoch over `gib` GiB (smoke: 32 MiB, no verdict)."""
    if smoke:
        gib = 1 / 32
    pre = work / f"large-split-{gib:g}gib"
    if not (pre / "meta.json").exists():
        write_split_folder(pre, int(gib * GIB))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.large_split", "--child", str(pre)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"B12 child exited {done.returncode}:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    data_mib = (pre / "train_images.npy").stat().st_size / MIB
    result.update(data_mib=data_mib, images_per_s=result["images"] / result["epoch_s"])
    return [
        Figure(
            "B12",
            f"one epoch, then a scoring pass, over a {data_mib / 1024:.2f} GiB split "
            "(64x64 grey, streamed from its file): peak RSS",
            result["peak_mib"],
            budget_mib,
            f"<= {budget_mib:.0f} MiB with {data_mib / 1024:.2f} GiB of data",
            None if smoke else result["peak_mib"] <= budget_mib,
            unit="MiB",
            details=result,
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--budget-mib", type=float, default=BUDGET_MIB)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    with tempfile.TemporaryDirectory(prefix="lockstep-b12-") as tmp:
        figures = b12(args.work or Path(tmp), args.gib, args.budget_mib)
    rows = [f.row() for f in figures]
    print(json.dumps(rows, indent=2))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
