"""Hyperparameter search whose results do not depend on timing: Optuna, in batches.

Optuna run with parallel workers is reproducible only one trial at a time: a worker asks for
parameters when it is free, so what the sampler has seen (and what a pruner compares with) depends on
which trial finished first. Here one coordinator owns the study and every trial is placed by number:

- Trials are asked in batches of `sweep.batch`, in trial-number order, each with a sampler seeded
  from `sweep.seed` and its number: trial n's parameters depend on the results of the batches before
  its own and nothing else, also after the coordinator restarts.
- A batch runs in parallel (as many at once as there are workers); results are told back in
  trial-number order once the whole batch is done.
- A trial is pruned by comparing its per-epoch validation metric with the finished trials of earlier
  batches only (a frozen copy it is given: `TrialSpec.earlier`), never with its running neighbours.
- Each trial trains with its own seed, derived from `sweep.seed` and its number.

The cost against Optuna's own parallel mode: a worker that finishes early waits for its batch (the
batch is as slow as its slowest trial), and the sampler learns from a result one batch later.

This module keeps the study (asks, tells, resumes); tasks/tools/sweep/trials.py is one trial (its
spec, outcome, seed and pruning), tasks/tools/sweep/space.py the search space and the check of what the
storage gives back. flows/sweep.py runs the trials (Prefect tasks, on Dask: flows/sweep_worker.py) and
records the study (tasks/tools/sweep/results.py: its summary and files) in MLflow; tasks/runner.py's
`train_trial` is the train stage for one trial.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tasks.core.config.params import Params
from tasks.core.config.sweep import SweepConfig
from tasks.core.errors import ExpectedFailure
from tasks.core.hashing import file_digest
from tasks.core.redact import redact
from tasks.tools.sweep.space import check_stored_trial, distributions
from tasks.tools.sweep.trials import TrialOutcome, TrialSpec, derived_seed

log = logging.getLogger(__name__)

JOURNAL = "journal.log"
# The study's digest (`study_digest`): what must not change for it to be resumed. The attribute keeps
# its first name: studies already on disk carry it.
STUDY_DIGEST_ATTR = "lockstep.fingerprint"
# Sweep keys that may change between a run and its resumption: how it runs, not what it finds
# (`trials`: a resumed sweep may be asked for more).
RESUMABLE_KEYS = frozenset({"trials", "address", "workers", "storage", "retries", "applied", "budget_s"})


class SweepError(ValueError):
    """A sweep that cannot start or resume as asked (exit 2 at the entry point)."""


class SweepStorageUnavailable(ExpectedFailure):
    """The study's database does not answer or refuses the credentials (exit 1)."""


# --------------------------------------------------------------------------- what a study depends on


def study_digest(params: Params, data_digest: str) -> str:
    """What a study's trials depend on: the sweep's settings, every param a trial reads, the data."""
    sweep = params.sweep.model_dump(exclude=set(RESUMABLE_KEYS))
    # What `trial_params` sets for every trial (the searched keys, its seed, its strategy) is no input of
    # the study: `--apply` writes the winner's into params.yaml, and `make tune` again must resume.
    overridden = {"seed", "strategy", *(key.removeprefix("train.") for key in params.sweep.space)}
    train = {key: value for key, value in params.train.model_dump().items() if key not in overridden}
    fixed = {"seed": params.seed, "determinism": params.determinism.model_dump(), "train": train}
    text = json.dumps({"sweep": sweep, "fixed": fixed, "data": data_digest}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def data_digest(pre_dir: Path) -> str:
    """sha256 over the preprocessed files (names and contents): the data every trial must see."""
    files = sorted(p for p in Path(pre_dir).rglob("*") if p.is_file())
    if not files:
        raise SweepError(f"{pre_dir}: no preprocessed data (the sweep runs download, stats and preprocess first)")
    lines = [f"{p.relative_to(pre_dir).as_posix()} {file_digest(p)}" for p in files]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


# --------------------------------------------------------------------------- the study


def open_study(cfg: SweepConfig, storage: str | None, study_dir: Path, digest: str) -> Any:
    """The study `cfg.name` (created, or loaded to resume when it was made with the same digest)."""
    # heavy: optuna (~1.4 s, loads numpy), only when a study runs
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if storage is None:
        study_dir.mkdir(parents=True, exist_ok=True)
        storage_obj: Any = JournalStorage(JournalFileBackend(str(study_dir / JOURNAL)))
    else:
        storage_obj = storage
    try:
        study = optuna.create_study(
            study_name=cfg.name, storage=storage_obj, direction=cfg.direction, load_if_exists=True
        )
    except Exception as exc:  # SQLAlchemy's errors for a database that is down or refuses us (and a
        if storage is None:  # driver's own); the journal file's are ours to show as they are
            raise
        raise _unavailable(storage, exc) from exc
    recorded = study.user_attrs.get(STUDY_DIGEST_ATTR)
    if recorded is None and not study.trials:
        study.set_user_attr(STUDY_DIGEST_ATTR, digest)
    elif recorded != digest:
        raise SweepError(
            f"sweep.name: study {cfg.name!r} ({len(study.trials)} trials) was run with other sweep settings, "
            "train params or data: resuming it would mix them; choose another sweep.name"
            + (f", or delete {study_dir} to start again" if storage is None else "")
        )
    return study


def check_storage(storage: str | None) -> None:
    """Fail in seconds, in one line, when the study's database does not answer or refuses the
    credentials: before a cluster starts and the data stages run (and before Prefect logs a traceback)."""
    if storage is None:
        return
    # optional: sqlalchemy (~0.9 s), only for a PostgreSQL study storage (the team stack)
    import sqlalchemy

    try:
        engine = sqlalchemy.create_engine(storage)
    except Exception as exc:  # a bad URL or a missing driver
        raise _unavailable(storage, exc) from exc
    try:
        with engine.connect():
            pass
    except Exception as exc:  # a database down or refusing us
        raise _unavailable(storage, exc) from exc
    finally:
        engine.dispose()


def _unavailable(storage: str, exc: BaseException) -> SweepStorageUnavailable:
    """One line: the storage (password masked) and the driver's own words (`password authentication
    failed for user ...`), without SQLAlchemy's wrapping and background link."""
    cause = getattr(exc, "orig", None) or exc
    return SweepStorageUnavailable(f"sweep storage {redact(storage)}: {' '.join(str(cause).split())[:300]}")


def _sampler(cfg: SweepConfig, number: int) -> Any:
    # heavy: optuna (~1.4 s, loads numpy), only when a study runs
    from optuna.samplers import RandomSampler, TPESampler

    seed = derived_seed(cfg.seed, number, "sampler")
    if cfg.sampler == "random":
        return RandomSampler(seed=seed)
    # constant liar: a batch's later trials see its earlier ones as running and are placed elsewhere
    return TPESampler(seed=seed, n_startup_trials=cfg.startup_trials, multivariate=True, constant_liar=True)


def _finished(trial: Any) -> bool:
    return trial.state.is_finished()


def next_batch(study: Any, cfg: SweepConfig, digest: str) -> list[TrialSpec]:
    """The trials to run next: the unfinished ones of the current batch (a resumed sweep), completed
    with new ones asked in number order; [] when `cfg.trials` are finished."""
    trials = study.get_trials(deepcopy=False)
    space = distributions(cfg.space)
    for trial in trials:  # before anything runs, is resumed or learnt from (the sampler, pruning)
        check_stored_trial(trial, cfg, space)
    if sum(_finished(t) for t in trials) >= cfg.trials:
        return []
    start = len(trials) - len(trials) % cfg.batch if all(_finished(t) for t in trials) else _batch_start(trials, cfg)
    for number in range(len(trials), min(start + cfg.batch, cfg.trials)):
        study.sampler = _sampler(cfg, number)  # per trial: the draw does not depend on the sampler's history
        asked = study.ask(fixed_distributions=space)
        asked.set_user_attr("seed", derived_seed(cfg.seed, number, "train"))
        if asked.number != number:
            raise SweepError(f"study {cfg.name!r}: asked trial {asked.number}, expected {number} (another writer?)")
    trials = study.get_trials(deepcopy=False)
    for trial in trials[start:]:  # read back from the storage again: checked again
        check_stored_trial(trial, cfg, space)
    earlier = tuple(t for t in trials if t.number < start and _finished(t))
    # the seed is derived again, not read back: the storage cannot choose it either
    return [
        TrialSpec(t.number, dict(t.params), derived_seed(cfg.seed, t.number, "train"), earlier, digest)
        for t in trials[start : start + cfg.batch]
        if not _finished(t)
    ]


def _batch_start(trials: Sequence[Any], cfg: SweepConfig) -> int:
    first_open = min(t.number for t in trials if not _finished(t))
    return first_open - first_open % cfg.batch


def tell(study: Any, outcome: TrialOutcome, metric: str) -> None:
    """Record a trial's outcome in the study: its curve, state and value."""
    # heavy: optuna (~1.4 s, loads numpy), only when a study runs
    from optuna.trial import Trial, TrialState

    trial_id = study.get_trials(deepcopy=False)[outcome.number]._trial_id
    trial = Trial(study, trial_id)
    for row in outcome.history:
        value = row.get(metric)
        if value is not None and math.isfinite(value):
            trial.report(float(value), int(row["epoch"]))
    for key in ("run_id", "best_sha256", "error", "attempts", "seconds"):
        if getattr(outcome, key) is not None:
            trial.set_user_attr(key, getattr(outcome, key))
    if outcome.state == "complete" and outcome.value is not None:
        study.tell(trial, outcome.value)
    elif outcome.state == "pruned":
        study.tell(trial, state=TrialState.PRUNED)
    else:
        study.tell(trial, state=TrialState.FAIL)


def run_study(
    study: Any,
    cfg: SweepConfig,
    digest: str,
    run_batch: Callable[[list[TrialSpec]], list[TrialOutcome]],
    clock: Callable[[], float] = time.monotonic,
) -> Any:
    """Run batches until `cfg.trials` trials are finished, or until the next batch would end past
    `cfg.budget_s` (by `clock`); `run_batch` runs one batch (in parallel, anywhere) and returns its
    outcomes. Told in trial-number order, whatever order they finished in."""
    started, longest = clock(), 0.0
    while True:
        spent = clock() - started
        # checked before the next batch is asked for: a stop leaves no trial asked and not run
        if cfg.budget_s is not None and spent + longest > cfg.budget_s:
            done = sum(t.state.is_finished() for t in study.get_trials(deepcopy=False))
            if done < cfg.trials:
                log.info(
                    "sweep %s: stopped within its budget of %.0f s (%.0f s spent, a batch takes up to %.0f s): "
                    "%d of %d trials done; the same command with a larger sweep.budget_s resumes it",
                    cfg.name, cfg.budget_s, spent, longest, done, cfg.trials,
                )  # fmt: skip
                break
        batch = next_batch(study, cfg, digest)
        if not batch:
            break
        log.info("sweep %s: trials %s", cfg.name, ", ".join(str(spec.number) for spec in batch))
        batch_started = clock()
        outcomes = {outcome.number: outcome for outcome in run_batch(batch)}
        longest = max(longest, clock() - batch_started)
        for spec in batch:
            tell(study, outcomes[spec.number], cfg.metric)
            log.info("%s", progress(study, cfg, outcomes[spec.number]))
    return study


def best_trial(study: Any, cfg: SweepConfig | None = None) -> Any | None:
    """The best complete trial; a tie goes to the lower trial number (Optuna's own pick is storage order).
    With `cfg`, every trial read back is checked first (`check_stored_trial`): what --apply writes."""
    # heavy: optuna (~1.4 s, loads numpy), only when a study runs
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    if cfg is not None:
        space = distributions(cfg.space)
        for trial in trials:
            check_stored_trial(trial, cfg, space)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if not complete:
        return None
    sign = 1 if study.direction.name == "MAXIMIZE" else -1
    return min(complete, key=lambda t: (-sign * t.value, t.number))


def progress(study: Any, cfg: SweepConfig, outcome: TrialOutcome) -> str:
    """One line for a person watching: which trial ended and how, how far the study is, the best so far."""
    # heavy: optuna (~1.4 s, loads numpy), only when a study runs
    from optuna.trial import TrialState

    states = [t.state for t in study.get_trials(deepcopy=False)]
    done = sum(state.is_finished() for state in states)
    value = f" {cfg.metric} {outcome.value:.4f}" if outcome.value is not None else ""
    best = best_trial(study)
    leader = f"trial {best.number}, {cfg.metric} {best.value:.4f}" if best is not None else "none yet"
    pruned, failed = states.count(TrialState.PRUNED), states.count(TrialState.FAIL)
    return (
        f"sweep {cfg.name}: trial {outcome.number} {outcome.state}{value} ({done} of {cfg.trials} done, "
        f"{pruned} pruned, {failed} failed); best so far: {leader}"
    )
