"""Issue 70.2: the defaults against a short sweep, on a real image set and the same split of it.

    python -m benchmarks.defaults_vs_sweep oxygen_icons [--work DIR] [--set sweep.trials=4 ...]
    python -m benchmarks.defaults_vs_sweep mnist5k --defaults-only
    python -m benchmarks.defaults_vs_sweep fashion_mnist --collect     # the row again from DIR/<set>/
    python -m benchmarks.defaults_vs_sweep twemoji --seeds 1,2         # both recipes under other seeds

As a user would, in a copy of the repository's tracked files (benchmarks/pipeline_overhead.py
`project_copy`): params.yaml pointed at the set's folder (`make real-sets`; the imagefolder source, the
set's channels, every other key as shipped), then `python -m flows.pipeline` (`make run`: the defaults),
then `python -m flows.sweep` (`make sweep`: params.yaml's sweep section). The sweep's winner is scored on
the test split by the evaluate stage from the trial's own best.safetensors, the weights `--apply` and the
train stage rebuild (docs/sweeps.md); the defaults' own weights are put back after.

Each set's row replaces its earlier one in benchmarks/results/real-sets-sweeps.json: the defaults' test
accuracy, macro recall, epochs and train seconds (the sum of its epoch lines' clock), the sweep's trials,
its winner's test accuracy, and the points between them. Everything a row reads is kept in DIR/<set>/
(`defaults.log`, `defaults-metrics.json`, `winner-metrics.json`, the project; DIR is
artifacts/bench-defaults-vs-sweep unless given), so `--collect` writes it again without training.
`--seeds` trains the defaults and the winner again under other training seeds in DIR/<set>/seeds/
(benchmarks/train_seeds.py), and the row then gives each recipe's mean beside its single run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks import train_seeds
from benchmarks.harness import RESULTS, ROOT, machine
from benchmarks.pipeline_overhead import project_copy
from benchmarks.real_sets.sets import SETS
from tasks.core.atomic import write_text
from tasks.core.config.yaml_io import load_params, set_params

OUT = RESULTS / "real-sets-sweeps.json"
DROPPED = ("run_id", "error", "best_sha256")  # a trial's keys that say nothing once the run is gone
EPOCH_LINE = re.compile(r"epoch \d+/\d+: .*, ([\d.]+) s$")  # the train stage's line for each epoch


def run_set(name: str, work: Path, overrides: list[str], sweep: bool) -> Path:
    """The set's defaults, then (with `sweep`) its sweep and the winner's score, in `work/<name>/`."""
    # here, not at the top: only a run (not --collect) needs the registry clients' code and Pillow
    from benchmarks.real_sets.build import build

    if (work / name).exists():  # its defaults would be a no-op run, its sweep a resumed study
        raise SystemExit(f"{work / name} exists: remove it for a new run, or --collect its row again")
    folder = build(name, say=lambda line: print(line, file=sys.stderr)).folder
    project, env = project_copy(work / name, smoke=False, first_run=False)
    set_params(
        project / "params.yaml",
        {"data.source": "imagefolder", "data.path": str(folder), "data.channels": SETS[name].channels},
    )
    _logged([sys.executable, "-m", "flows.pipeline"], project, env, work / name / "defaults.log")
    shutil.copy2(project / "artifacts/evaluate/metrics.json", work / name / "defaults-metrics.json")
    if sweep:
        sets = [arg for override in overrides for arg in ("--set", override)]
        _logged([sys.executable, "-m", "flows.sweep", *sets], project, env, work / name / "sweep.log")
        _score_winner(project, env, work / name)
    return work / name


def _logged(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> None:
    with log.open("w") as out:
        done = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"{' '.join(cmd[1:])} exited {done.returncode} in {cwd} (log {log}):\n{tail}")


def _study(project: Path) -> dict[str, Any]:
    name = load_params(project / "params.yaml").sweep.name
    return json.loads((project / "artifacts/sweep" / name / "study/sweep.json").read_text())


def _score_winner(project: Path, env: dict[str, str], folder: Path) -> None:
    """The evaluate stage on the winner's weights, then the defaults' weights and evaluation back in place."""
    best = _study(project)["best"]
    if best is None or "weights" not in best:
        raise SystemExit(f"{project}: the sweep has no winner with weights here (sweep.json's best): nothing to score")
    trained, evaluated = project / "artifacts/train/best.safetensors", project / "artifacts/evaluate"
    kept, kept_evaluated = folder / "defaults-best.safetensors", folder / "defaults-evaluate"
    shutil.copy2(trained, kept)
    shutil.copytree(evaluated, kept_evaluated)
    shutil.copy2(project / best["weights"], trained)
    try:
        _logged([sys.executable, "-m", "tasks", "evaluate"], project, env, folder / "winner-evaluate.log")
        shutil.copy2(evaluated / "metrics.json", folder / "winner-metrics.json")
    finally:
        shutil.copy2(kept, trained)
        shutil.rmtree(evaluated)
        shutil.copytree(kept_evaluated, evaluated)


def train_seconds(log: str) -> float:
    """The training's seconds: the sum of its epoch lines' clock (the stage's own, without imports)."""
    return round(sum(float(m.group(1)) for line in log.splitlines() if (m := EPOCH_LINE.search(line))), 1)


def row(name: str, folder: Path) -> dict[str, Any]:
    """The set's row from what `run_set` left in `folder`."""
    project = folder / "project-x1"
    metrics = json.loads((folder / "defaults-metrics.json").read_text())
    trained = json.loads((project / "artifacts/train/train.json").read_text())
    history = json.loads((project / "artifacts/train/history.json").read_text())
    defaults = {
        "test_accuracy": metrics["accuracy"],
        "macro_recall": metrics["macro_recall"],
        "test_images": metrics["num_samples"],
        "best_val_accuracy": trained["best_val_accuracy"],
        "epochs": len(history),
        "auto": {key: choice["value"] for key, choice in trained.get("recipe", {}).items()},
        "train_s": train_seconds((folder / "defaults.log").read_text()),
    }
    host = machine()
    where = {"cpu": host["cpu"], "cores": host["cores"], "flags": host["fingerprint"].get("hw.cpu.flags")}
    result: dict[str, Any] = {"set": name, "date": datetime.date.today().isoformat(), "machine": where}
    result["default"] = defaults
    if not (folder / "winner-metrics.json").exists():
        return result | {"sweeps": []}
    study, winner = _study(project), json.loads((folder / "winner-metrics.json").read_text())  # (a winner)
    if (folder / "seeds").exists():
        # the row's own two trainings: the defaults' under the top-level seed (train.seed null), the winner's
        # under the seed its trial was given
        seed = load_params(project / "params.yaml").train_seed
        own = {
            "defaults": {seed: train_seeds.scores(metrics)},
            "winner": {study["best"]["seed"]: train_seeds.scores(winner)},
        }
        result["train_seeds"] = train_seeds.summary(folder / "seeds", own)
    finished = sorted(t["seconds"] for t in study["trials"] if t["state"] == "complete")
    sweep = {
        "study": study["study"],
        "states": study["states"],
        "seconds": study["seconds"],
        # a complete trial's wall time beside another (2 at a time): the target's "time of 3 sweep trials"
        "complete_trial_median_s": finished[len(finished) // 2] if finished else None,
        "best": {key: study["best"][key] for key in ("trial", "params", "seed", "value", "best_sha256")},
        "best_test_accuracy": winner["accuracy"],
        "best_macro_recall": winner["macro_recall"],
        "trials": [{k: v for k, v in t.items() if k not in DROPPED} for t in study["trials"]],
    }
    gap = round(100 * (winner["accuracy"] - metrics["accuracy"]), 2)
    return result | {"sweeps": [sweep], "sweep_best_minus_defaults_points": gap}


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(seed) for seed in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"--seeds {text!r}: expected integers >= 0 separated by commas, e.g. 1,2")
    return seeds


def merged(report: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`report` with `new` in place of the row of its set (or after the others)."""
    rows = [r for r in report.get("rows", []) if r["set"] != new["set"]]
    return {**report, "rows": [*rows, new]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.defaults_vs_sweep", description=__doc__.split("\n")[0])
    parser.add_argument("set", choices=list(SETS))
    parser.add_argument("--work", type=Path, default=ROOT / "artifacts" / "bench-defaults-vs-sweep")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--defaults-only", action="store_true", help="no sweep (a set the defaults nearly ace)")
    parser.add_argument("--collect", action="store_true", help="the row from what an earlier run left in --work")
    parser.add_argument(
        "--seeds", type=_seeds, metavar="N,N", help="after a run: the defaults and the winner under these train seeds"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    work = args.work.resolve()
    if args.seeds:
        if not (work / args.set / "project-x1" / "dvc.lock").exists():  # else project_copy would start a new one
            raise SystemExit(f"--seeds: {work / args.set}/project-x1 has no run of the set: run its row first")
        project, env = project_copy(work / args.set, smoke=False, first_run=False)  # (the run's)
        train_seeds.run(project, work / args.set / "seeds", args.seeds, _study(project)["best"], env)
    collect = args.collect or args.seeds
    folder = work / args.set if collect else run_set(args.set, work, args.overrides, not args.defaults_only)
    new = row(args.set, folder)
    report = json.loads(args.out.read_text()) if args.out.exists() else {}
    write_text(args.out, json.dumps(merged(report, new), indent=1) + "\n")
    print(json.dumps({k: v for k, v in new.items() if k != "sweeps"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
