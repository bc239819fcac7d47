"""B9: what determinism.cpu: portable costs: the train stage's epoch in portable vs native mode.

Each mode runs in a fresh process (the mode is fixed when torch and numpy load), on the same
prepared data with the default params and thread count; one untimed epoch first, then the median
of the timed ones, the two modes taking turns round by round.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.data import params, prepared
from benchmarks.harness import ROOT, Figure, fixed_threads, median
from tasks import cpu_mode

_EPOCHS = """
import json, sys, time
from pathlib import Path
from tasks import cpu_mode
cpu_mode.pin_env(sys.argv[1])
from benchmarks.data import params
from tasks.determinism import pin_everything
from tasks.distributed import resolve_device
from tasks.preprocess import load_split
from tasks.training import build_training
p = params()
pin_everything(p.seed, p.determinism.num_threads, p.determinism.strict, sys.argv[1])
training = build_training(p.train, p.seed, load_split(Path(sys.argv[2]), "train"), resolve_device(p.train.device))
training.train_epoch(1)  # warm-up: allocations, kernel set-up
seconds = []
for epoch in range(2, 2 + int(sys.argv[3])):
    start = time.perf_counter()
    training.train_epoch(epoch)
    seconds.append(time.perf_counter() - start)
print(json.dumps(seconds))
"""


def _epochs(mode: str, pre: Path, epochs: int) -> list[float]:
    env = cpu_mode.clean_env(dict(os.environ))
    done = subprocess.run(
        [sys.executable, "-c", _EPOCHS, mode, str(pre), str(epochs)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"B9 {mode} epochs failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def b9(work: Path, rounds: int, epochs: int = 3) -> list[Figure]:
    p = params()
    fixed_threads(p.determinism.num_threads)
    pre = prepared(work)
    runs: dict[str, list[float]] = {"portable": [], "native": []}
    for _ in range(rounds):
        for mode in runs:
            runs[mode] += _epochs(mode, pre, epochs)
    portable, native = median(runs["portable"]), median(runs["native"])
    return [
        Figure(
            "B9",
            "train epoch: determinism.cpu portable (same bytes on any AVX2 CPU) vs native",
            portable,
            native,
            "<= 1.3x",
            portable / native <= 1.3,
            details={"runs": runs, "threads": p.determinism.num_threads, "model": p.train.model},
        )
    ]
