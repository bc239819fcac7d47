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

Each copy's last epoch is scored on the test split too (`artifacts/evaluate-last/`), beside the epoch
the train stage keeps, the best by validation: on a validation split of a few dozen images (the
sprites' 39) that choice is partly chance, and the two together show how much (2026-12-06, the
training page).
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
LAST = "artifacts/evaluate-last/metrics.json"  # the same evaluation of the last epoch's weights
# The evaluate stage's function on last.safetensors, in a process started as `python -m tasks` starts
# (bootstrap before numpy and torch load), with the copy's own code (its folder comes first on sys.path).
_LAST_EPOCH = """
from pathlib import Path
from tasks.determinism.bootstrap import bootstrap, start
p = bootstrap("params.yaml")
start(p.seed, p.determinism.num_threads, strict=p.determinism.strict, cpu=p.determinism.cpu)
from tasks.core import layout
from tasks.train.evaluate import evaluate
evaluate(p.evaluate, layout.TRAIN_DIR / "last.safetensors", layout.PREPROCESSED_DIR, Path("artifacts/evaluate-last"))
"""


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
    """The train then the evaluate stage in `copy`, then the last epoch scored; their output in
    `copy/stages.log`. A copy evaluated already (before the last epoch was scored) is only scored."""
    steps = {"train": ["-m", "tasks", "train"], "evaluate": ["-m", "tasks", "evaluate"], "last": ["-c", _LAST_EPOCH]}
    if (copy / METRICS).exists():
        steps = {"last": steps["last"]}
    with (copy / "stages.log").open("a") as log:
        for step, args in steps.items():
            done = subprocess.run([sys.executable, *args], cwd=copy, env=env, stdout=log, stderr=subprocess.STDOUT)
            if done.returncode != 0:
                raise RuntimeError(f"{step} exited {done.returncode} in {copy} (log: {log.name})")


def run(project: Path, folder: Path, seeds: list[int], best: dict[str, Any] | None, env: dict[str, str]) -> None:
    """Each recipe under each seed in `folder/<recipe>-<seed>/`, those not evaluated yet trained there."""
    todo = []
    for name, params in recipes(best).items():
        for seed in seeds:
            copy = folder / f"{name}-{seed}"
            if (copy / LAST).exists():
                continue
            if (copy / METRICS).exists():  # evaluated before the last epoch was scored: only that is left
                todo.append(copy)
                continue
            if copy.exists():  # stopped part-way: a stage's half-written outputs are not resumed from
                shutil.rmtree(copy)
            copy_project(project, copy, {**params, "train.seed": seed})
            todo.append(copy)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(partial(train_and_evaluate, env=env), todo))  # (re-raises the first failed training)


def summary(folder: Path, earlier: dict[str, dict[int, dict[str, float]]]) -> dict[str, Any]:
    """Per recipe: each seed's test accuracy and macro recall (`earlier`'s first: the row's own trainings),
    their means, and the winner's mean minus the defaults' in points; where the copies' last epochs were
    scored, the same of those ("last_epoch": the copies only) and how far each is from its kept epoch."""
    found, last = _found(folder, METRICS, earlier), _found(folder, LAST, {})
    out: dict[str, Any] = {name: _means(rows) for name, rows in found.items()}
    for name, rows in last.items():
        kept = found[name]
        out[name]["last_epoch"] = _means(rows) | {
            "last_minus_kept_points": round(
                100 * statistics.mean(rows[seed]["test_accuracy"] - kept[seed]["test_accuracy"] for seed in rows), 2
            )
        }
    if {"defaults", "winner"} <= out.keys():
        gap = out["winner"]["mean_test_accuracy"] - out["defaults"]["mean_test_accuracy"]
        out["winner_minus_defaults_points"] = round(100 * gap, 2)
    return out


def _found(folder: Path, metrics_file: str, earlier: dict[str, dict[int, dict[str, float]]]) -> dict[str, Any]:
    """recipe -> seed -> scores, from each copy's `metrics_file` after `earlier`'s."""
    found: dict[str, dict[int, dict[str, float]]] = {name: dict(rows) for name, rows in earlier.items()}
    for metrics in sorted(folder.glob(f"*-*/{metrics_file}")):
        name, _, seed = metrics.parents[2].name.rpartition("-")
        found.setdefault(name, {})[int(seed)] = scores(json.loads(metrics.read_text()))
    return found


def _means(rows: dict[int, dict[str, float]]) -> dict[str, Any]:
    return {
        "seeds": {str(seed): rows[seed] for seed in sorted(rows)},
        "mean_test_accuracy": statistics.mean(r["test_accuracy"] for r in rows.values()),
        "mean_macro_recall": statistics.mean(r["macro_recall"] for r in rows.values()),
    }
