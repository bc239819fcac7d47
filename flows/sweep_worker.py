"""A sweep's trials: the Prefect task that trains one, on whichever Dask worker runs it.

A module of its own, not flows/sweep.py: Dask pickles the task by reference to its module, and the
entry point runs as `__main__` (`python -m flows.sweep`), which a worker cannot import.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

from flows import prefect_settings
from tasks.core import layout
from tasks.core.atomic import write_text
from tasks.core.cli import one_line
from tasks.core.config.params import Params
from tasks.core.hashing import file_digest
from tasks.runner import train_trial
from tasks.tools.sweep.study import SweepError, data_digest
from tasks.tools.sweep.trials import Pruned, Pruning, TrialOutcome, TrialSpec, kept_value, trial_params
from tasks.tracking.runs import PARENT_ENV

# One trial at a time per process: a trial seeds the process-wide RNGs and sets torch's thread
# count, so two in one process (a Dask worker with several threads) would draw from each other's.
_ONE_TRIAL = threading.Lock()


@dataclass(frozen=True)
class SweepContext:
    """What every trial shares, sent with it to its worker. No path of the coordinator's: a worker on
    another machine has its own clone, wherever its user put it."""

    params: Params  # the base params (the trial's values go into its train section)
    parent_run_id: str | None
    tracking_uri: str
    data_digest: str
    study_dir: str  # relative to the project: artifacts/sweep/<name>, in the worker's own clone


# --------------------------------------------------------------------------- one trial, on a worker


def dask_setup(worker: object) -> None:
    """Dask's hook for a preloaded module (`--preload flows.sweep_worker`): load what a trial needs while the
    worker waits for its first one. The first trial in a fresh process otherwise spends ~10 s of
    its time importing torch (and torch._dynamo, which the optimisers pull in), MLflow and the stages.
    In a thread: the worker must go on answering its scheduler meanwhile."""
    prefect_settings.configure()  # the worker's own: importing flows/ configures nothing
    threading.Thread(target=warm_up, name="lockstep-warm-up", daemon=True).start()


def warm_up() -> None:
    import mlflow  # noqa: F401
    import torch._dynamo  # noqa: F401

    import tasks.runner  # noqa: F401
    import tasks.train.stage  # noqa: F401


@task(name="trial", cache_policy=NO_CACHE, task_run_name="trial {spec.number}")
def trial_task(spec: TrialSpec, context: SweepContext) -> TrialOutcome:
    """Train one trial; its outcome, also kept in its folder (a resumed sweep does not run it again)."""
    # Everything is in module-level functions: Dask pickles this task's function by value (Prefect
    # wraps it), with the globals it names; a function is pickled by reference, a lock not at all.
    return run_trial(spec, context)


def run_trial(spec: TrialSpec, context: SweepContext) -> TrialOutcome:
    with _ONE_TRIAL:
        return _run_trial(spec, context, attempt=task_run.run_count or 1)


def _run_trial(spec: TrialSpec, context: SweepContext, attempt: int) -> TrialOutcome:
    # The worker's own clone (the code it imported), not the coordinator's path: machines share no disk.
    project = layout.ROOT
    if not (project / layout.PREPROCESSED_DIR).is_dir():
        raise SweepError(f"this worker has no {project / layout.PREPROCESSED_DIR}: see flows/sweep.py on workers")
    os.chdir(project)
    out_dir = project / context.study_dir / f"trial-{spec.number:04d}"
    kept = _kept_outcome(out_dir, spec)
    if kept is not None:
        return kept
    if data_digest(layout.PREPROCESSED_DIR) != context.data_digest:
        raise SweepError(f"{project / layout.PREPROCESSED_DIR}: not the data this sweep started on (digest differs)")
    params = trial_params(context.params, spec)
    os.environ["MLFLOW_TRACKING_URI"] = context.tracking_uri
    os.environ.pop(PARENT_ENV, None)  # nested in this sweep's run, never in an earlier trial's
    if context.parent_run_id is not None:
        os.environ[PARENT_ENV] = context.parent_run_id
    # here: tasks.train.auto loads numpy, which the coordinator (flows/sweep.py imports this module) must
    # not load before its bootstrap pins determinism.cpu
    from tasks.train.auto import epochs_on

    epochs = epochs_on(params.train, project / layout.PREPROCESSED_DIR)  # the pruner's warm-up: a share of them
    pruning, history, started = Pruning(params.sweep, spec.earlier, epochs), [], time.monotonic()

    def on_epoch(row: dict[str, float]) -> None:
        history.append(row)
        if pruning.should_stop(spec.number, row):
            raise Pruned(f"trial {spec.number} pruned at epoch {int(row['epoch'])}")

    tags = {"sweep.study": params.sweep.name, "sweep.trial": spec.number, "sweep.attempt": attempt}
    result, run_id = train_trial(params, out_dir, on_epoch, tags)

    outcome = TrialOutcome(
        number=spec.number,
        state="complete" if result is not None else "pruned",
        value=kept_value(history, result.best_epoch, params.sweep.metric) if result is not None else None,
        history=history,
        run_id=run_id,
        best_sha256=file_digest(out_dir / "best.safetensors") if result is not None else None,
        attempts=attempt,
        seconds=round(time.monotonic() - started, 2),
        fingerprint=spec.fingerprint,
    )
    if outcome.state == "pruned":
        outcome.value = history[-1].get(params.sweep.metric)
    write_text(out_dir / "outcome.json", outcome.to_json())
    return outcome


def _kept_outcome(out_dir: Path, spec: TrialSpec) -> TrialOutcome | None:
    """The outcome a previous run of this sweep wrote for this trial, if it is this trial's."""
    path = out_dir / "outcome.json"
    if not path.exists():
        return None
    kept = TrialOutcome(**json.loads(path.read_text()))
    return kept if kept.number == spec.number and kept.fingerprint == spec.fingerprint else None


# --------------------------------------------------------------------------- the coordinator


def run_batch(specs: list[TrialSpec], context: SweepContext, retries: int) -> list[TrialOutcome]:
    """Submit the batch's trials (the task runner places them on workers) and wait for all of them."""
    runner = trial_task.with_options(retries=retries, retry_delay_seconds=0)
    futures = [(spec, runner.submit(spec, context)) for spec in specs]
    outcomes = []
    for spec, future in futures:
        future.wait()
        state = future.state
        if state.is_completed():
            outcomes.append(future.result())
        else:  # crashed or failed after its retries: a result of the sweep, not its failure
            error = future.result(raise_on_failure=False)
            message = (
                one_line(f"{type(error).__name__}: {error}") if isinstance(error, BaseException) else state.message
            )
            get_run_logger().warning("trial %d failed after %d attempts: %s", spec.number, retries + 1, message)
            outcomes.append(TrialOutcome(spec.number, "failed", error=message, attempts=retries + 1))
    return outcomes
