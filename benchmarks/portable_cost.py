"""B9: what determinism.cpu: portable costs: the train stage's epoch in portable vs native mode
(digits, small_cnn), and (B9-<model>) a training step of each model people pick, on 32x32 RGB images.

Each mode runs in a fresh process (the mode is fixed when torch and numpy load), on the same
prepared data with the default params and thread count; one untimed epoch (or two steps) first,
then the median of the timed ones, the two modes taking turns round by round. A row's ratio is the
median of the rounds' own ratios (`Figure.round_ratios`). The RGB steps time random pixels: the
kernels' cost does not depend on what the images show.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks import fma_peak
from benchmarks.data import params, prepared
from benchmarks.harness import ROOT, Figure, in_turn, median
from tasks.determinism import cpu_mode
from tasks.determinism.threads import resolve

# Each script starts its process in the mode it is given, as every entry point starts (tasks/determinism/
# bootstrap.py): `prepare` before anything loads numpy or torch, then `start`.
MODES = ["portable", "native"]  # the order of round 0; each round after reverses it (harness.in_turn)

_EPOCHS = """
import json, sys, time
from pathlib import Path
from tasks.determinism.bootstrap import prepare, start
prepare(sys.argv[1])
from benchmarks.data import params
from tasks.train.devices import resolve_device
from tasks.data.preprocess import load_split
from tasks.train.loop import build_training
p = params()
start(p.seed, p.determinism.num_threads, strict=p.determinism.strict, cpu=sys.argv[1])
# argv[4], the smoke run's: epochs of their first N batches (none: whole epochs)
cfg = p.train if sys.argv[4] == "none" else p.train.model_copy(update={"max_batches": int(sys.argv[4])})
training = build_training(cfg, p.seed, load_split(Path(sys.argv[2]), "train"), resolve_device(cfg.device))
training.train_epoch(1)  # warm-up: allocations, kernel set-up
seconds = []
for epoch in range(2, 2 + int(sys.argv[3])):
    began = time.perf_counter()
    training.train_epoch(epoch)
    seconds.append(time.perf_counter() - began)
print(json.dumps(seconds))
"""


_STEPS = """
import json, sys, time
from tasks.determinism.bootstrap import start
start(0, sys.argv[2] if sys.argv[2] == "auto" else int(sys.argv[2]), cpu=sys.argv[1])
import torch
from tasks.train.models import build_model
from benchmarks.data import random_rgb_batch
images, labels = random_rgb_batch(int(sys.argv[5]))
timed = {}
for name in sys.argv[4].split(","):
    model = build_model(name, 10, [0.5] * 3, [0.25] * 3)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    seconds = []
    for step in range(2 + int(sys.argv[3])):  # two untimed steps first
        began = time.perf_counter()
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimiser.step()
        seconds.append(time.perf_counter() - began)
    timed[name] = seconds[2:]
print(json.dumps(timed))
"""


def _timed(script: str, mode: str, *args: object) -> Any:
    """What `script`, run in a fresh process started in CPU `mode`, printed last (JSON)."""
    env = cpu_mode.clean_env(dict(os.environ))
    done = subprocess.run(
        [sys.executable, "-c", script, mode, *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{mode} run failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def step_seconds(mode: str, threads: int | str, steps: int, model: str, batch: int) -> list[float]:
    """Seconds of each timed training step of `model` on random 32x32 RGB images, in a fresh process
    started in CPU `mode` with `threads` (a count, or `auto`), two untimed steps first."""
    return steps_seconds(mode, threads, steps, [model], batch)[model]


def steps_seconds(mode: str, threads: int | str, steps: int, models: list[str], batch: int) -> dict[str, list[float]]:
    """`step_seconds` for several models, one after another in one fresh process."""
    return _timed(_STEPS, mode, threads, steps, ",".join(models), batch)


# The models people pick (resnet9: the real-image recipe's), a row each; small_cnn is B9's epoch.
STEP_MODELS = ("resnet9", "resnet18", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny")
# The smoke run steps one of them: the code is the same for every model, and tests/train/test_zoo.py
# trains a step of each family in portable mode already. mobilenet_v3_small reaches the most kinds of
# layer (grouped and depthwise convolutions, squeeze-excitation, hardswish) for the least time.
SMOKE_STEP_MODELS = ("mobilenet_v3_small",)
TARGET = 1.3


def b9(
    work: Path,
    rounds: int,
    epochs: int = 3,
    steps: int = 8,
    batch: int = 32,
    one_process: bool = False,
    models: tuple[str, ...] = STEP_MODELS,
    epoch_rounds: int | None = None,
    max_batches: int | None = None,
    peak_iterations: int = fma_peak.ITERATIONS,
) -> list[Figure]:
    """B9 (the stage's epoch, in `epoch_rounds` processes per mode, `rounds` by default) and a B9-<model>
    row per `models` (`steps` steps of `batch` images), each model in a fresh process, or all in one per
    mode (`one_process`: the smoke run's, cheaper; so are its epochs, of their first `max_batches`
    batches). The epoch's rounds are cheap, and a process's speed varies more than its epochs do (where
    on the host it lands): more of them steady the median. Within a round a model's two modes run one
    right after the other, the first of them alternating from round to round: the host's speed drifts
    over minutes, so two modes a model apart would be compared at two speeds. Each round's ratio goes in
    the figure, and the row's ratio is their median. Then B13 (benchmarks/fma_peak.py): the CPU's FMA peak
    on the same threads (`peak_iterations` per run), and each model's step as a share of it."""
    p = params()
    threads = resolve(p.determinism.num_threads)  # each mode's process starts with it (the scripts above)
    pre = prepared(work)
    runs: dict[str, list[float]] = {"portable": [], "native": []}
    round_ratios: list[float] = []
    for turn in range(epoch_rounds or rounds):
        batches = max_batches or "none"
        epoch_seconds = {mode: _timed(_EPOCHS, mode, pre, epochs, batches) for mode in in_turn(MODES, turn)}
        for mode in runs:
            runs[mode] += epoch_seconds[mode]
        round_ratios.append(_ratio(epoch_seconds))
    rgb = {model: {"portable": [], "native": []} for model in models}
    rgb_ratios: dict[str, list[float]] = {model: [] for model in models}
    for turn in range(rounds):
        for group in [list(models)] if one_process else [[model] for model in models]:
            seconds = {mode: steps_seconds(mode, threads, steps, group, batch) for mode in in_turn(MODES, turn)}
            for model in group:
                for mode in runs:
                    rgb[model][mode] += seconds[mode][model]
                rgb_ratios[model].append(_ratio({mode: seconds[mode][model] for mode in runs}))
    measure = "train epoch: determinism.cpu portable (same bytes on any AVX2 CPU) vs native"
    epoch = _figure("B9", measure, runs, round_ratios)
    epoch.details.update(model=p.train.model)
    figures = [epoch]
    for model in models:
        measure = f"{model} train step, {batch} RGB images of 32x32: portable vs native"
        figures.append(_figure(f"B9-{model}", measure, rgb[model], rgb_ratios[model]))
    for figure in figures:
        figure.details.update(threads=threads)
        figure.target = f"<= {TARGET}x"
        figure.met = figure.ratio <= TARGET
    # B13: the same steps against the CPU's FMA peak (their operations counted once, natively)
    peak = fma_peak.peak_gflops(work, threads, iterations=peak_iterations, runs=max(rounds, 2))
    counted = _timed(fma_peak.WORK, "native", threads, ",".join(models), batch, max(rounds, 2))
    return figures + fma_peak.b13(peak, threads, batch, counted, rgb)


def _ratio(seconds: dict[str, list[float]]) -> float:
    """One round's portable/native ratio, of its medians."""
    return round(median(seconds["portable"]) / median(seconds["native"]), 3)


def _figure(name: str, measure: str, runs: dict[str, list[float]], round_ratios: list[float]) -> Figure:
    """Portable's median against native's, the row's ratio the median of the rounds' ratios; reported
    only (the caller sets a target)."""
    portable, native = median(runs["portable"]), median(runs["native"])
    return Figure(name, measure, portable, native, "report", None, details={"runs": runs}, round_ratios=round_ratios)
