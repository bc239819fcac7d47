"""A learning-rate range test (fastai's `lr_find`) on a preprocessed project: is `train.lr` the data's?

    python -m benchmarks.lr_range PROJECT [--steps 100] [--low 1e-4] [--high 2.0]

PROJECT holds params.yaml and artifacts/preprocessed (a project the train stage could run in). A new
model, built and fed as the train stage builds and feeds it (`build_training`, with the keys `auto`
leaves to the data resolved from the training split; mixup, cutmix, accumulation, clipping and amp
refused: this loop does not apply them), takes `--steps` optimiser steps at a learning
rate rising exponentially from `--low` to `--high`, and stops early once the loss is 4x its lowest.
Printed (JSON): the rate of the lowest smoothed loss (an exponential average, debiased as fastai's),
a tenth of it (fastai's usual suggestion), the rate of the steepest fall before it (past the first
SKIP_START points), and the curve. A `head_lr` keeps its ratio to `train.lr` throughout.
Seeded like the train stage (`params.seed`): the same data gives the same numbers.

Issue 70 asked whether `train.lr` should be measured this way from the data; docs/training.md
("Real image sets") has what it found on the real sets, and why the learning rate stays fixed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from tasks.core.config.yaml_io import load_params
from tasks.determinism.bootstrap import bootstrap, start

SMOOTHING = 0.9  # fastai's: the loss of one batch is too noisy to read a curve from
DIVERGED = 4.0  # stop once the smoothed loss is this many times its lowest
SKIP_START = 10  # points the steepest fall is not looked for in (fastai's skip_start): the debiased start
# Recipe keys this loop does not apply (the train stage's loop does): a range test with them on would
# describe another training, so it is refused rather than run without them.
UNSUPPORTED = {"mixup_alpha": 0.0, "cutmix_alpha": 0.0, "accumulate_steps": 1, "amp": "none", "grad_clip_norm": None}


def range_test(project: Path, steps: int, low: float, high: float) -> dict:
    """The range test on `project` (module docstring); computes with torch in this process."""
    params = load_params(project / "params.yaml")
    start(params.seed, params.determinism.num_threads, strict=params.determinism.strict)
    # torch and the train stage's modules load after start() pinned the CPU mode
    import torch

    from tasks.data.preprocess import load_split
    from tasks.train.auto import profile, resolve
    from tasks.train.loop import build_training
    from tasks.train.models import to_float

    changed = {key: getattr(params.train, key) for key, off in UNSUPPORTED.items() if getattr(params.train, key) != off}
    if changed:
        raise ValueError(f"{project / 'params.yaml'}: the range test does not apply train.{changed}: set them off")
    split = load_split(project / "artifacts" / "preprocessed", "train")
    cfg, _ = resolve(
        params.train, profile(split, load_split(project / "artifacts" / "preprocessed", "val", stream=True))
    )
    t = build_training(cfg, params.seed, split, torch.device("cpu"))
    t.hold_backbone(cfg.freeze_backbone_epochs > 0)  # as the first epoch holds it
    t.model.train()
    scales = [group["lr"] / cfg.lr for group in t.optimizer.param_groups]  # a head_lr keeps its ratio
    rates, smoothed, average = [], [], 0.0
    while len(rates) < steps:
        if not len(t.loader):
            raise ValueError(f"{project}: the training split gives no batch of train.batch_size {cfg.batch_size}")
        for images, labels in t.loader:
            rate = low * (high / low) ** (len(rates) / max(1, steps - 1))
            for group, scale in zip(t.optimizer.param_groups, scales, strict=True):
                group["lr"] = rate * scale
            t.optimizer.zero_grad(set_to_none=True)
            loss = t.criterion(t.model(to_float(images, t.device)), labels.to(t.device))
            loss.backward()
            t.optimizer.step()
            average = SMOOTHING * average + (1 - SMOOTHING) * loss.item()
            rates.append(rate)
            smoothed.append(average / (1 - SMOOTHING ** len(rates)))
            if len(rates) >= steps or not math.isfinite(smoothed[-1]) or smoothed[-1] > DIVERGED * min(smoothed):
                return _summary(rates, smoothed, cfg.lr)
    return _summary(rates, smoothed, cfg.lr)


def _summary(rates: list[float], smoothed: list[float], configured: float) -> dict:
    # numpy loads after bootstrap (main; torch has loaded it by now in any case): it reads the CPU
    # mode's variables when it is imported
    import numpy as np

    lowest = int(np.nanargmin(smoothed))
    slopes = np.gradient(np.array(smoothed), np.log(np.array(rates))) if len(rates) > 1 else np.zeros(1)
    skip = SKIP_START if lowest > SKIP_START else 0
    steepest = skip + int(np.argmin(slopes[skip : lowest + 1]))
    return {
        "steps": len(rates),
        "train_lr": configured,
        "lowest_loss_lr": rates[lowest],
        "tenth_of_it": rates[lowest] / 10,
        "steepest_lr": rates[steepest],
        "curve": [[rate, loss] for rate, loss in zip(rates, smoothed, strict=True)],
    }


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lr_range", description=__doc__.split("\n")[0])
    parser.add_argument("project", type=Path, help="a folder with params.yaml and artifacts/preprocessed")
    parser.add_argument("--steps", type=int, default=100, choices=range(2, 10_001), metavar="2..10000")
    parser.add_argument("--low", type=float, default=1e-4)
    parser.add_argument("--high", type=float, default=2.0)
    args = parser.parse_args(argv)
    bootstrap(args.project / "params.yaml")  # the CPU mode's variables, before torch loads
    print(json.dumps(range_test(args.project, args.steps, args.low, args.high)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
