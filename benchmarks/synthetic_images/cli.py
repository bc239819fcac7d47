"""Check datasets of our own making: realistic images generated offline, deterministically, in seconds.

The command line: write a dataset as an ImageFolder tree, draw a preview grid, or check its difficulty.

    python -m benchmarks.synthetic_images shapes /tmp/shapes --splits train=500,test=100
    python -m benchmarks.synthetic_images glyphs /tmp/glyphs --per-class 1000 --seed 1
    python -m benchmarks.synthetic_images garments --preview /tmp/garments.png
    python -m benchmarks.synthetic_images shapes --check        # logistic regression vs a small CNN (minutes)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.synthetic_images.datasets import DATASETS
from benchmarks.synthetic_images.difficulty import difficulty
from benchmarks.synthetic_images.writers import preview, write_imagefolder


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
