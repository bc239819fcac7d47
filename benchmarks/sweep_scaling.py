"""B10: a sweep's speed-up from 1 to 2 Dask workers (flows/sweep.py), on an 8-trial study.

The same study (same params: the results are identical, tests/tools/test_sweep_dask.py) runs on a local
cluster of 1 worker and of 2, one trial per worker at a time, on the default thread count
(`determinism.num_threads: auto`: one worker's trials take every core, two workers' half each).
The figure is the trial phase (the study's batches, from the
first trial asked to the last result told: `seconds` in the sweep's sweep.json), which is what more
workers shorten; the command's start-up (Prefect server, Dask cluster, data stages skipped by DVC) is
in the details. Trials are digits trainings long enough to dominate their batch's Prefect and Dask
overhead; pruning is off and the batch is 4, so both workers have whole trials to run throughout
(with pruning, a batch waits for its slowest trial: that cost is the design's, README "Sweeps").
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import Figure, run_timed
from benchmarks.pipeline_overhead import project_copy
from tasks.core.config.yaml_io import set_params
from tasks.determinism.threads import shared_env

TARGET = 1.8  # speed-up of 2 workers over 1


def b10(work: Path, smoke: bool = False) -> list[Figure]:
    project, env = project_copy(work, smoke)
    settings = {
        "sweep.trials": 2 if smoke else 8,
        "sweep.batch": 2 if smoke else 4,
        "sweep.pruner": "none",
        "train.epochs": 1 if smoke else 8,
    }
    set_params(project / "params.yaml", settings)
    seconds, wall, busy = {}, {}, {}
    for workers in (1, 2):
        name = f"bench-{workers}w-{time.monotonic_ns()}"  # a new study each time: nothing resumed
        overrides = ["--set", f"sweep.name={name}", "--set", f"sweep.workers={workers}"]
        wall[workers] = run_timed([sys.executable, "-m", "flows.sweep", *overrides], project, env, expect="trial")
        summary = json.loads((project / "artifacts" / "sweep" / name / "study" / "sweep.json").read_text())
        seconds[workers] = summary["seconds"]
        # how much of the workers' time went into trials: the rest waited on a batch's slowest trial,
        # on the coordinator or on Prefect and Dask
        busy[workers] = round(sum(row["seconds"] or 0 for row in summary["trials"]) / (workers * seconds[workers]), 3)
    speedup = seconds[1] / seconds[2]
    ceiling = _two_trainings_side_by_side(project, env, rounds=1 if smoke else 2)
    missed = speedup < TARGET and ceiling["speedup"] < TARGET
    argued = (
        f"two plain trainings of one trial (no Prefect, Dask or MLflow) side by side ran "
        f"{ceiling['speedup']:.2f}x faster than one after the other on this machine "
        f"({ceiling['alone_s']:.2f} s alone, {ceiling['pair_s']:.2f} s for the pair): no scheduler of two "
        f"trials can reach {TARGET}x here; the sweep reached {speedup:.2f}x, {speedup / ceiling['speedup']:.0%} of that"
    )
    return [
        Figure(
            id="B10",
            measure=f"sweep of {settings['sweep.trials']} trials: trial phase, 2 Dask workers vs 1",
            lockstep=seconds[2],
            baseline=seconds[1],
            target=f"<= {1 / TARGET:.3f}x (>= {TARGET}x speed-up)",
            met=None if smoke else speedup >= TARGET,
            details={
                "speedup": round(speedup, 3),
                "runs": {"1 worker": [seconds[1]], "2 workers": [seconds[2]]},
                "command_wall_s": wall,
                "worker_busy_fraction": busy,
                "settings": settings,
                "ceiling": ceiling,
            },
            argued=argued if missed else None,
        )
    ]


# One trial's training as the sweep's first trial runs it, without the sweep around it.
_TRAIN = """
import sys, time
from pathlib import Path
from tasks.determinism.bootstrap import bootstrap, start
params = bootstrap()
d = params.determinism
start(params.seed, d.num_threads, strict=d.strict, cpu=d.cpu)
from tasks.train.stage import train
began = time.perf_counter()
train(params.train, params.seed, Path("artifacts/preprocessed"), Path(sys.argv[1]))
print(time.perf_counter() - began)
"""


def _two_trainings_side_by_side(project: Path, env: dict[str, str], rounds: int) -> dict[str, float]:
    """What two workers can gain at most on this machine: one training alone vs two at once (each
    process timing its training only, not its imports), the best of `rounds` rounds."""

    def start(out: str, side_by_side: int = 1) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", _TRAIN, str(project / "artifacts" / "ceiling" / out)],
            cwd=project,
            env={**env, **shared_env(side_by_side)},  # a pair shares the cores, as two workers' trials do
            stdout=subprocess.PIPE,
            text=True,
        )

    def seconds(*procs: subprocess.Popen[str]) -> list[float]:
        outputs = [proc.communicate()[0] for proc in procs]
        if any(proc.returncode for proc in procs):
            raise RuntimeError(f"a plain training failed in {project}")
        return [float(out.strip().splitlines()[-1]) for out in outputs]

    alones, pairs = [], []
    for r in range(rounds):  # taking turns, the best round of each: a slow moment must not flatter either
        alones += seconds(start(f"alone{r}"))
        pairs.append(max(seconds(start(f"pair{r}a", 2), start(f"pair{r}b", 2))))
    alone, pair = min(alones), min(pairs)
    return {"alone_s": round(alone, 3), "pair_s": round(pair, 3), "speedup": round(2 * alone / pair, 3)}
