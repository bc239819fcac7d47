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

This module computes; flows/sweep.py runs the trials (Prefect tasks, on Dask) and records the study
(tasks/tools/sweep_results.py: its summary and files) in MLflow; tasks/stages.py's `train_trial` is
the train stage for one trial.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tasks.core.config.params import Params
from tasks.core.config.sweep import SearchSpace, SweepConfig
from tasks.core.errors import ExpectedFailure, Refused
from tasks.core.redact import redact

log = logging.getLogger(__name__)

JOURNAL = "journal.log"
FINGERPRINT_ATTR = "lockstep.fingerprint"  # the study's: what must not change for it to be resumed
# Sweep keys that may change between a run and its resumption: how it runs, not what it finds
# (`trials`: a resumed sweep may be asked for more).
RESUMABLE_KEYS = frozenset({"trials", "address", "workers", "storage", "retries", "applied"})


class SweepError(ValueError):
    """A sweep that cannot start or resume as asked (exit 2 at the entry point)."""


class SweepStorageUnavailable(ExpectedFailure):
    """The study's database does not answer or refuses the credentials (exit 1)."""


class StoredTrialRefused(Refused):
    """The study's storage holds a trial this sweep did not ask for: a key outside `sweep.space`, or a
    value outside its range (exit 3). Whoever can write the storage would otherwise choose what the
    next trial runs with, or what `--apply` writes into params.yaml."""


class Pruned(Exception):
    """Raised from a trial's epoch callback: stop training, the trial is a (pruned) result."""


@dataclass(frozen=True)
class TrialSpec:
    """What a worker needs to run one trial (pickled to it)."""

    number: int
    values: dict[str, Any]  # the searched train keys and their values, e.g. {"train.lr": 0.03}
    seed: int  # train.seed
    earlier: tuple[Any, ...] = ()  # optuna FrozenTrials of earlier batches, what pruning compares with
    fingerprint: str = ""


@dataclass
class TrialOutcome:
    """A trial's result, as the worker reports it (and keeps beside its checkpoints)."""

    number: int
    state: str  # complete | pruned | failed
    value: float | None = None  # the metric's best epoch (complete) or last epoch (pruned)
    history: list[dict[str, float]] = field(default_factory=list)
    run_id: str | None = None
    best_sha256: str | None = None
    error: str | None = None
    attempts: int = 1
    seconds: float = 0.0
    fingerprint: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


# --------------------------------------------------------------------------- seeds and parameters


def derived_seed(sweep_seed: int, number: int, purpose: str) -> int:
    """A 32-bit seed for trial `number` (numpy's SeedSequence: well-mixed, stable across versions)."""
    import numpy as np  # not at import: flows/sweep.py imports this module before the CPU mode is pinned

    salt = int.from_bytes(hashlib.sha256(purpose.encode()).digest()[:4], "little")
    return int(np.random.SeedSequence([sweep_seed, number, salt]).generate_state(1)[0])


def distributions(space: dict[str, SearchSpace]) -> dict[str, Any]:
    """The Optuna distribution of each searched key."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    made: dict[str, Any] = {}
    for key, s in space.items():
        if s.type == "categorical":
            made[key] = CategoricalDistribution(list(s.choices or ()))
        elif s.type == "int":
            step = 1 if s.step is None else int(s.step)
            made[key] = IntDistribution(int(s.low or 0), int(s.high or 0), log=s.log, step=step)
        else:
            made[key] = FloatDistribution(s.low or 0.0, s.high or 0.0, log=s.log, step=s.step)
    return made


def check_stored_trial(trial: Any, cfg: SweepConfig, space: dict[str, Any] | None = None) -> None:
    """Refuse (StoredTrialRefused, one line naming the trial and the key) a trial read back from the
    study's storage unless its params are exactly the keys of `sweep.space`, each with a value inside
    its declared distribution, and none reaches the network (REMOTE_KEYS, as for API overrides)."""
    from tasks.core.config.policy import remote_keys_in

    space = distributions(cfg.space) if space is None else space
    params = trial.params
    extra, missing = sorted(set(params) - set(space)), sorted(set(space) - set(params))
    remote = remote_keys_in(extra)
    problems = [(key, "reaches the network or other machines") for key in remote]
    problems += [(key, "is not in sweep.space") for key in extra if key not in remote]
    problems += [
        (key, f"{redact(repr(params[key]))[:80]} is outside its declared range {_declared(space[key])}")
        for key in sorted(set(params) & set(space))
        if not _inside(space[key], params[key])
    ]
    problems += [(key, "is missing (a trial this sweep asked has every key of sweep.space)") for key in missing]
    if problems:
        key, why = problems[0]
        more = f" (and {len(problems) - 1} more key(s))" if len(problems) > 1 else ""
        raise StoredTrialRefused(
            f"sweep storage: study {cfg.name!r} trial {trial.number}: {key} {why}{more}: the storage holds a "
            "trial this sweep did not ask for (who else writes it?); nothing run, params.yaml untouched"
        )


def _inside(distribution: Any, value: Any) -> bool:
    """`value` is one the Optuna `distribution` can draw (its own `to_internal_repr` and `_contains`)."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(distribution, CategoricalDistribution):
        if not any(type(value) is type(choice) and value == choice for choice in distribution.choices):
            return False  # Optuna's own lookup takes True for 1 and 1 for 1.0
    else:
        numbers = int if isinstance(distribution, IntDistribution) else (int, float)
        if isinstance(value, bool) or not isinstance(value, numbers):
            return False
    try:
        return bool(distribution._contains(distribution.to_internal_repr(value)))
    except (ValueError, TypeError, OverflowError):
        return False


def _declared(distribution: Any) -> str:
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(distribution, CategoricalDistribution):
        return str(list(distribution.choices))
    kind = "int" if isinstance(distribution, IntDistribution) else "float"
    return f"{kind} [{distribution.low}, {distribution.high}]"


def trial_params(base: Params, spec: TrialSpec) -> Params:
    """`base` with the trial's values and seed in its train section (validated like params.yaml).

    A sweep trains each trial in one process: the trials are the parallelism.
    """
    train = {**base.train.model_dump(), "seed": spec.seed, "strategy": "single"}
    train.update({key.removeprefix("train."): value for key, value in spec.values.items()})
    return Params.model_validate({**base.model_dump(), "train": train})


def fingerprint(params: Params, data_digest: str) -> str:
    """What a study's trials depend on: the sweep's settings, every param a trial reads, the data."""
    sweep = params.sweep.model_dump(exclude=set(RESUMABLE_KEYS))
    fixed = {"seed": params.seed, "determinism": params.determinism.model_dump(), "train": params.train.model_dump()}
    text = json.dumps({"sweep": sweep, "fixed": fixed, "data": data_digest}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def data_digest(pre_dir: Path) -> str:
    """sha256 over the preprocessed files (names and contents): the data every trial must see."""
    from tasks.core.hashing import file_digest

    files = sorted(p for p in Path(pre_dir).rglob("*") if p.is_file())
    if not files:
        raise SweepError(f"{pre_dir}: no preprocessed data (the sweep runs download, stats and preprocess first)")
    lines = [f"{p.relative_to(pre_dir).as_posix()} {file_digest(p)}" for p in files]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


# --------------------------------------------------------------------------- the study


def open_study(cfg: SweepConfig, storage: str | None, study_dir: Path, print_fingerprint: str) -> Any:
    """The study `cfg.name` (created, or loaded to resume when it was made with the same fingerprint)."""
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
    recorded = study.user_attrs.get(FINGERPRINT_ATTR)
    if recorded is None and not study.trials:
        study.set_user_attr(FINGERPRINT_ATTR, print_fingerprint)
    elif recorded != print_fingerprint:
        raise SweepError(
            f"sweep.name: study {cfg.name!r} ({len(study.trials)} trials) was run with other sweep settings, "
            "train params or data: resuming it would mix them; choose another sweep.name, or delete "
            f"{study_dir} to start again"
        )
    return study


def check_storage(storage: str | None) -> None:
    """Fail in seconds, in one line, when the study's database does not answer or refuses the
    credentials: before a cluster starts and the data stages run (and before Prefect logs a traceback)."""
    if storage is None:
        return
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
    from optuna.samplers import RandomSampler, TPESampler

    seed = derived_seed(cfg.seed, number, "sampler")
    if cfg.sampler == "random":
        return RandomSampler(seed=seed)
    # constant liar: a batch's later trials see its earlier ones as running and are placed elsewhere
    return TPESampler(seed=seed, n_startup_trials=cfg.startup_trials, multivariate=True, constant_liar=True)


def _finished(trial: Any) -> bool:
    return trial.state.is_finished()


def next_batch(study: Any, cfg: SweepConfig, print_fingerprint: str) -> list[TrialSpec]:
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
        TrialSpec(t.number, dict(t.params), derived_seed(cfg.seed, t.number, "train"), earlier, print_fingerprint)
        for t in trials[start : start + cfg.batch]
        if not _finished(t)
    ]


def _batch_start(trials: Sequence[Any], cfg: SweepConfig) -> int:
    first_open = min(t.number for t in trials if not _finished(t))
    return first_open - first_open % cfg.batch


def tell(study: Any, outcome: TrialOutcome, metric: str) -> None:
    """Record a trial's outcome in the study: its curve, state and value."""
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
    print_fingerprint: str,
    run_batch: Callable[[list[TrialSpec]], list[TrialOutcome]],
) -> Any:
    """Run batches until `cfg.trials` trials are finished; `run_batch` runs one batch (in parallel,
    anywhere) and returns its outcomes. Told in trial-number order, whatever order they finished in."""
    while batch := next_batch(study, cfg, print_fingerprint):
        log.info("sweep %s: trials %s", cfg.name, ", ".join(str(spec.number) for spec in batch))
        outcomes = {outcome.number: outcome for outcome in run_batch(batch)}
        for spec in batch:
            tell(study, outcomes[spec.number], cfg.metric)
            log.info("%s", progress(study, cfg, outcomes[spec.number]))
    return study


def best_trial(study: Any, cfg: SweepConfig | None = None) -> Any | None:
    """The best complete trial; a tie goes to the lower trial number (Optuna's own pick is storage order).
    With `cfg`, every trial read back is checked first (`check_stored_trial`): what --apply writes."""
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


# --------------------------------------------------------------------------- inside a trial


class Pruning:
    """The pruning decision for one trial: its curve so far against the finished trials of earlier
    batches (an in-memory copy of them, so the answer cannot depend on what runs beside it)."""

    def __init__(self, cfg: SweepConfig, earlier: Sequence[Any]) -> None:
        import optuna
        from optuna.pruners import MedianPruner, NopPruner

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        pruner = (
            NopPruner()
            if cfg.pruner == "none"
            else MedianPruner(n_startup_trials=0, n_warmup_steps=cfg.warmup_epochs + 1, n_min_trials=1)
        )
        self._study = optuna.create_study(direction=cfg.direction, pruner=pruner)
        self._study.add_trials(earlier)
        self._metric = cfg.metric
        self._values: dict[int, float] = {}

    def should_stop(self, number: int, row: dict[str, float]) -> bool:
        from optuna.trial import FrozenTrial, TrialState

        value = row.get(self._metric)
        if value is None or not math.isfinite(value):
            return False
        self._values[int(row["epoch"])] = float(value)
        now = datetime.datetime.now()
        frozen = FrozenTrial(number, TrialState.RUNNING, None, now, None, {}, {}, {}, {}, dict(self._values), -1)
        return bool(self._study.pruner.prune(self._study, frozen))


def best_value(history: Sequence[dict[str, float]], metric: str, direction: str) -> float | None:
    """The metric at the trial's best epoch."""
    values = [row[metric] for row in history if math.isfinite(row.get(metric, math.nan))]
    if not values:
        return None
    return max(values) if direction == "maximize" else min(values)
