"""B3: what a run costs when nothing changed — a no-op `dvc repro` and a no-op Prefect flow run.

A scheduled retraining run finds nothing new most nights, so its fixed cost is what users pay most
often. Both are timed as users start them (fresh processes, wall clock) in a copy of the
repository whose pipeline has run once; the two take turns. The targets are absolute budgets (2 s
and 10 s), so each figure's baseline is its budget and the ratio is the share of it used.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import ROOT, Figure, alternate, median
from tasks.config import set_params

BUDGET_S = {"dvc": 2.0, "flow": 10.0}


def project_copy(work: Path, smoke: bool) -> tuple[Path, dict[str, str]]:
    """The repository's tracked files in `work/project`, the pipeline run once there; (path, env)."""
    dest = work / "project"
    if not (dest / "dvc.lock").exists():
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
        for rel in filter(None, listed.stdout.split("\0")):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
        if smoke:  # the no-op costs the same after a tiny run; the smoke run only checks it works
            set_params(dest / "params.yaml", {
                "train.epochs": 1, "train.num_workers": 0, "compress.variants": ["static_int8"],
                "compress.calibration_size": 64, "compress.latency_runs": 20, "compress.latency_warmup": 1,
                "export.min_top1_agreement": 0.0, "export.max_accuracy_drop": 1.0})  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "DVC_", "LOCKSTEP_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if not (dest / "dvc.lock").exists():
        git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@lockstep.invalid"]
        for cmd in (["git", "init", "-q"], [*git, "add", "-A"], [*git, "commit", "-qm", "bench copy"],
                    ["dvc", "repro", "download"], ["dvc", "repro"]):  # fmt: skip
            done = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode} in {dest}:\n{done.stderr[-3000:]}")
    return dest, env


def b3(work: Path, rounds: int, smoke: bool = False) -> list[Figure]:
    project, env = project_copy(work, smoke)

    def timed(cmd: list[str], expect: str):
        def case() -> float:
            start = time.perf_counter()
            done = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
            elapsed = time.perf_counter() - start
            if done.returncode != 0 or expect not in done.stdout:
                raise RuntimeError(f"{' '.join(cmd)} (exit {done.returncode}) was not a no-op:\n{done.stdout[-2000:]}"
                                   f"\n{done.stderr[-2000:]}")  # fmt: skip
            return elapsed

        return case

    times = alternate({"dvc": timed(["dvc", "repro"], "Data and pipelines are up to date"),
                       "flow": timed([sys.executable, "-m", "flows.pipeline"], "none (everything up to date)")},
                      rounds=rounds, warmup=1)  # fmt: skip
    figures = []
    for name, measure in (("dvc", "no-op `dvc repro`"), ("flow", "no-op Prefect flow run (`make run`)")):
        figure = Figure(f"B3-{name}", f"{measure} vs its budget", median(times[name]), BUDGET_S[name],
                        f"<= {BUDGET_S[name]:g} s", None, details={"runs": {name: times[name]}})  # fmt: skip
        figure.met = figure.lockstep <= BUDGET_S[name]
        figures.append(figure)
    return figures

