"""`make reproduce` of an x86-64 default run, on the emulated arm64 machine (issue 71).

    python -m tests.support.arm64_reproduce [--project DIR] [--out benchmarks/results/arm64-reproduce.json]

On x86-64, here: a clone of this checkout's HEAD runs the default pipeline (`python -m flows.pipeline`,
what `make run` runs), which logs its train run in the clone's MLflow store; `--project` names a project
that did so already. On the emulated arm64 machine (tests/support/arm64.py, `make arm64-env`), in that
project: `python -m tasks.tools.reproduce RUN`, as a user of an arm64 server would run it. It rebuilds the
run's code from its commit and its data from DVC's cache, runs stats -> preprocess -> train as processes of
their own (arm64 programs, emulated too: `arm64.binfmt`, root), compares the weights' sha256 with the
run's, and explains a difference through the fingerprint. The report keeps reproduce's JSON, and the
rebuilt weights beside the golden record's (tests/determinism/golden/default_weights.json).

Too slow for the test tiers (tens of minutes emulated), so it is run by hand, and its report kept. The
emulator executes each NEON and FMA instruction exactly; its time is no measure of a real arm64 CPU, and
the report drops reproduce's stage times (its JSON is kept, not its text, which gives their sum).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

import torch

from tasks.core.atomic import write_text
from tests.conftest import ROOT, subprocess_env
from tests.support import arm64

RESULTS = ROOT / "benchmarks/results/arm64-reproduce.json"
GOLDEN = ROOT / "tests/determinism/golden/default_weights.json"
EMULATED_S = 6 * 3600


def trained_project(where: Path) -> Path:
    """A clone of HEAD that ran the default pipeline on x86-64 (its run in the clone's MLflow store)."""
    project = where / "project"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(project)], check=True)
    done = subprocess.run(
        [sys.executable, "-m", "flows.pipeline"], cwd=project, env=subprocess_env(), capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"the x86-64 pipeline failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return project


def last_train_run(project: Path) -> str:
    """The id of the newest train stage run in `project`'s own MLflow store."""
    from mlflow import MlflowClient  # ~2 s: only once the project exists

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(
        experiments, "tags.mlflow.runName = 'train'", order_by=["attributes.start_time DESC"], max_results=1
    )
    if not runs:
        raise SystemExit(f"{project}: no train run in its MLflow store (mlflow.db)")
    return runs[0].info.run_id


def reproduce_on_arm64(project: Path, run_id: str) -> dict:
    """reproduce's JSON report of `run_id`, rebuilt by the emulated machine in `project`."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        done = arm64.run_python(
            ["-m", "tasks.tools.reproduce", run_id, "--json", str(report)],
            cwd=project,
            timeout_s=EMULATED_S,
            children=True,
        )
        if not report.exists():
            raise SystemExit(f"reproduce on arm64 wrote no report ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(report.read_text())


def measure(project: Path | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        project = project or trained_project(Path(tmp))
        run_id = last_train_run(project)
        made = reproduce_on_arm64(project, run_id)
    made.pop("stage_seconds", None)  # the emulator's time (module docstring)
    golden = json.loads(GOLDEN.read_text())[f"portable | torch {torch.__version__}"]
    rebuilt = {c["name"]: c["rebuilt"] for c in made["weights"]}
    return {
        "date": date.today().isoformat(),
        "arm64": f"qemu-aarch64-static -cpu {arm64.CPU} (tests/support/arm64.py): bytes, no timing",
        "run": run_id,
        "verdict": made["verdict"],
        "same_as_golden": {name: golden.get(name) == sha for name, sha in rebuilt.items()},
        "golden_recorded_on": golden["recorded_on"]["hw.cpu.model"],
        "reproduce": made,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.arm64_reproduce", description=__doc__.split("\n")[0])
    parser.add_argument("--project", type=Path, help="a project whose default run is trained (default: a new clone)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    arm64.build()
    report = measure(args.project.resolve() if args.project else None)
    write_text(args.out, json.dumps(report, indent=2) + "\n")
    print(json.dumps({key: report[key] for key in ("verdict", "same_as_golden")}, indent=1))
    return 0 if report["verdict"] == "identical" and all(report["same_as_golden"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
