"""One sweep trial: what its worker is given (`TrialSpec`) and reports (`TrialOutcome`), its params and
seeds, and the pruning decision inside it (`Pruning`: compared with earlier batches only).

The study that places the trials is tasks/tools/sweep/study.py; flows/sweep_worker.py runs one on a
Dask worker, through tasks/runner.py's `train_trial`.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tasks.core.config.params import Params
from tasks.core.config.sweep import SweepConfig


class Pruned(Exception):
    """Raised from a trial's epoch callback: stop training, the trial is a (pruned) result."""


@dataclass(frozen=True)
class TrialSpec:
    """What a worker needs to run one trial (pickled to it)."""

    number: int
    values: dict[str, Any]  # the searched train keys and their values, e.g. {"train.lr": 0.03}
    seed: int  # train.seed
    earlier: tuple[Any, ...] = ()  # optuna FrozenTrials of earlier batches, what pruning compares with
    fingerprint: str = ""  # the study's digest (tasks/tools/sweep/study.py `study_digest`)


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
    fingerprint: str = ""  # the study's digest; the name stays: outcome.json files on disk carry it

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def derived_seed(sweep_seed: int, number: int, purpose: str) -> int:
    """A 32-bit seed for trial `number` (numpy's SeedSequence: well-mixed, stable across versions)."""
    import numpy as np  # not at import: flows/sweep.py imports this module before the CPU mode is pinned

    salt = int.from_bytes(hashlib.sha256(purpose.encode()).digest()[:4], "little")
    return int(np.random.SeedSequence([sweep_seed, number, salt]).generate_state(1)[0])


def trial_params(base: Params, spec: TrialSpec) -> Params:
    """`base` with the trial's values and seed in its train section (validated like params.yaml).

    A sweep trains each trial in one process: the trials are the parallelism.
    """
    train = {**base.train.model_dump(), "seed": spec.seed, "strategy": "single"}
    train.update({key.removeprefix("train."): value for key, value in spec.values.items()})
    return Params.model_validate({**base.model_dump(), "train": train})


# `sweep.warmup_epochs: auto`: the share of a trial's epochs it runs before it can be pruned. An early
# epoch says little of where a trial ends under a cosine schedule: on the real icons (oxygen_icons,
# 50 epochs, 2026-12-04) a pruner free from epoch 2 stopped four of eight trials there, among them one
# at nearly the winner's learning rate (0.029 against 0.031): its best in two epochs was 0.125 against
# the earlier trials' median of 0.128. The winner had scored 0.107 in its second epoch; it ended at 0.714.
# With a quarter, the four ran 39-47 epochs (0.63-0.67) and the winner was the same, in 1,120 s, not 782.
WARMUP_SHARE = 4


def warmup_epochs(cfg: SweepConfig, epochs: int) -> int:
    """The epochs a trial of `epochs` runs before the median pruner may stop it: `sweep.warmup_epochs`,
    or under `auto` a quarter of them (at least 1)."""
    return max(1, epochs // WARMUP_SHARE) if cfg.warmup_epochs == "auto" else cfg.warmup_epochs


class Pruning:
    """The pruning decision for one trial of `epochs` epochs: its curve so far against the finished
    trials of earlier batches (an in-memory copy of them, so the answer cannot depend on what runs
    beside it)."""

    def __init__(self, cfg: SweepConfig, earlier: Sequence[Any], epochs: int) -> None:
        # heavy: optuna (~1.4 s, loads numpy), only when a study runs
        import optuna
        from optuna.pruners import MedianPruner, NopPruner

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        pruner = (
            NopPruner()
            if cfg.pruner == "none"
            else MedianPruner(n_startup_trials=0, n_warmup_steps=warmup_epochs(cfg, epochs) + 1, n_min_trials=1)
        )
        self._study = optuna.create_study(direction=cfg.direction, pruner=pruner)
        self._study.add_trials(earlier)
        self._metric = cfg.metric
        self._values: dict[int, float] = {}

    def should_stop(self, number: int, row: dict[str, float]) -> bool:
        # heavy: optuna (~1.4 s, loads numpy), only when a study runs
        from optuna.trial import FrozenTrial, TrialState

        value = row.get(self._metric)
        if value is None or not math.isfinite(value):
            return False
        self._values[int(row["epoch"])] = float(value)
        now = datetime.datetime.now()
        frozen = FrozenTrial(number, TrialState.RUNNING, None, now, None, {}, {}, {}, {}, dict(self._values), -1)
        return bool(self._study.pruner.prune(self._study, frozen))


def kept_value(history: Sequence[dict[str, float]], epoch: int, metric: str) -> float | None:
    """The metric at `epoch`, the one whose weights the trial kept (`train.keep`: the best by
    `train.monitor`, or the last): the trial is scored by what it would ship, not by its luckiest epoch."""
    row = next((row for row in history if int(row["epoch"]) == epoch), {})
    value = row.get(metric, math.nan)
    return value if math.isfinite(value) else None
