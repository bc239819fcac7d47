"""Issue 70.2's comparison under other training seeds: the defaults and the sweep's winner, each trained again.

A set's row (benchmarks/defaults_vs_sweep.py) compares two single trainings on a test split of a few
hundred images, where one image is 0.4 points and a recipe's score moves by more than that from one
initialisation and batch order to the next: the winner was also picked by one epoch's validation score.
Here each recipe trains again under other `train.seed`s on the same split, so the gap between them is
read from means, not from one draw of each:

    python -m benchmarks.defaults_vs_sweep twemoji --seeds 1,2    # after the set's row was run

Each training is the train stage then the evaluate stage (`python -m tasks train`, `evaluate`: what the
pipeline runs, without its MLflow record) in a copy of the set's project, with `train.seed` and, for
the winner, the study's best params written to its params.yaml; one thread each (portable mode: the
same bytes on any thread count), as many at once as there are cores. A copy whose evaluation is already
there is read, not trained again, so a run stopped part-way goes on where it was.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from tasks.core.config.yaml_io import set_params

# What a training copy leaves out of the set's project: the sweep's trials, MLflow's store, and every output
# of train and the stages after it (an evaluation already there would pass for the copy's own). Its data
# and preprocessed splits are what it trains on.
LEFT_OUT = (
    "artifacts/train",
    "artifacts/train-resume",
    "artifacts/evaluate",
    "artifacts/compress",
    "artifacts/export",
    "artifacts/sweep",
    "mlartifacts",
    "mlflow.db",
)
METRICS = "artifacts/evaluate/metrics.json"


def recipes(study_best: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """name -> params over the shipped ones: the defaults, and the study's winner if it has one."""
    return {"defaults": {}, **({"winner": dict(study_best["params"])} if study_best else {})}


def scores(metrics: dict[str, Any]) -> dict[str, float]:
    """What the comparison reads from the evaluate stage's metrics.json."""
    return {"test_accuracy": metrics["accuracy"], "macro_recall": metrics["macro_recall"]}


def copy_project(project: Path, dest: Path, overrides: dict[str, Any]) -> None:
    """`project` without what LEFT_OUT names, in `dest`, with `overrides`, tracking off and one thread."""
    skipped = {project / rel for rel in LEFT_OUT}
    shutil.copytree(project, dest, ignore=lambda folder, names: [n for n in names if Path(folder, n) in skipped])
    set_params(dest / "params.yaml", {"tracking.enabled": False, "determinism.num_threads": 1, **overrides})


def train_and_evaluate(copy: Path, env: dict[str, str]) -> None:
    """The train then the evaluate stage in `copy`; their output in `copy/stages.log`."""
    with (copy / "stages.log").open("a") as log:
        for stage in ("train", "evaluate"):
            done = subprocess.run(
                [sys.executable, "-m", "tasks", stage], cwd=copy, env=env, stdout=log, stderr=subprocess.STDOUT
            )
            if done.returncode != 0:
                raise RuntimeError(f"`python -m tasks {stage}` exited {done.returncode} in {copy} (log: {log.name})")


def run(project: Path, folder: Path, seeds: list[int], best: dict[str, Any] | None, env: dict[str, str]) -> None:
    """Each recipe under each seed in `folder/<recipe>-<seed>/`, those not evaluated yet trained there."""
    todo = []
    for name, params in recipes(best).items():
        for seed in seeds:
            copy = folder / f"{name}-{seed}"
            if (copy / METRICS).exists():
                continue
            if copy.exists():  # stopped part-way: a stage's half-written outputs are not resumed from
                shutil.rmtree(copy)
            copy_project(project, copy, {**params, "train.seed": seed})
            todo.append(copy)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(partial(train_and_evaluate, env=env), todo))  # (re-raises the first failed training)


def summary(folder: Path, earlier: dict[str, dict[int, dict[str, float]]]) -> dict[str, Any]:
    """Per recipe: each seed's test accuracy and macro recall (`earlier`'s first: the row's own trainings),
    their means, and the winner's mean minus the defaults' in points."""
    found: dict[str, dict[int, dict[str, float]]] = {name: dict(rows) for name, rows in earlier.items()}
    for metrics in sorted(folder.glob(f"*-*/{METRICS}")):
        name, _, seed = metrics.parents[2].name.rpartition("-")
        found.setdefault(name, {})[int(seed)] = scores(json.loads(metrics.read_text()))
    out: dict[str, Any] = {}
    for name, rows in found.items():
        out[name] = {
            "seeds": {str(seed): rows[seed] for seed in sorted(rows)},
            "mean_test_accuracy": statistics.mean(r["test_accuracy"] for r in rows.values()),
            "mean_macro_recall": statistics.mean(r["macro_recall"] for r in rows.values()),
        }
    if {"defaults", "winner"} <= out.keys():
        gap = out["winner"]["mean_test_accuracy"] - out["defaults"]["mean_test_accuracy"]
        out["winner_minus_defaults_points"] = round(100 * gap, 2)
    return out
