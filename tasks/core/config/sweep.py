"""The `sweep` section: a hyperparameter search over train keys."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from tasks.core.config.base import (
    MAX_EPOCHS,
    MAX_PROCESSES,
    Auto,
    Section,
    shown,
    url_credentials,
)
from tasks.core.config.policy import SWEEP_FORBIDDEN
from tasks.core.config.train import TrainConfig

Scalar = Annotated[bool | int | float | str, Field(union_mode="left_to_right")]


class SearchSpace(Section):
    """One searched train key: a float or int range (log scale optional), or a list of choices."""

    type: Literal["float", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = Field(None, gt=0)  # float/int: a grid (int default 1)
    choices: tuple[Scalar, ...] | None = Field(None, min_length=1, max_length=64, strict=False)

    @model_validator(mode="after")
    def _consistent(self) -> SearchSpace:
        if self.type == "categorical":
            if self.choices is None or self.low is not None or self.high is not None or self.log:
                raise ValueError("categorical: give choices (a list), not low/high/log")
            return self
        if self.choices is not None or self.low is None or self.high is None:
            raise ValueError(f"{self.type}: give low and high, not choices")
        if not self.low < self.high:
            raise ValueError(f"{self.type}: low ({self.low}) must be below high ({self.high})")
        if self.log and (self.low <= 0 or self.step is not None):
            raise ValueError(f"{self.type}: log scale needs low > 0 and no step")
        if self.type == "int" and not all(float(v).is_integer() for v in (self.low, self.high, self.step or 1)):
            raise ValueError("int: low, high and step must be whole numbers")
        return self

    def values(self) -> tuple[Any, ...]:
        """The values that must each be valid for the key: the choices, or both bounds."""
        if self.type == "categorical":
            return self.choices or ()
        assert self.low is not None and self.high is not None
        return (int(self.low), int(self.high)) if self.type == "int" else (self.low, self.high)


class AppliedSweep(Section):
    """Written by `python -m flows.sweep --apply`: the trial whose params train uses (lineage; a DVC param)."""

    study: str = Field(max_length=64)
    trial: int = Field(ge=0)
    # the trial's MLflow run (make reproduce ARGS=...); null: the sweep ran with tracking.enabled false
    run_id: str | None = Field(None, pattern=r"^[0-9a-f]{32}$")


class SweepConfig(Section):
    """A hyperparameter search over train keys (flows/sweep.py, tasks/tools/sweep/). Read by no stage but
    `applied`, which train records."""

    name: str = Field("lockstep", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # the Optuna study
    trials: int = Field(8, ge=1, le=10_000)
    # Trials asked together, run in parallel and told back in trial-number order: results depend on
    # this, never on how many workers run them (tasks/tools/sweep/study.py).
    batch: int = Field(2, ge=1, le=256)
    seed: int = Field(0, ge=0, lt=2**32)
    sampler: Literal["tpe", "random"] = "tpe"
    startup_trials: int = Field(4, ge=0, le=10_000)  # tpe: random trials before it models the results
    pruner: Literal["median", "none"] = "median"
    # median: epochs every trial runs before it can be pruned; auto: a quarter of the trial's epochs
    # (tasks/tools/sweep/trials.py `warmup_epochs`)
    warmup_epochs: Annotated[int, Field(ge=0, le=MAX_EPOCHS)] | Auto = "auto"
    metric: Literal["val_accuracy", "val_loss"] = "val_accuracy"
    direction: Literal["maximize", "minimize"] = "maximize"
    retries: int = Field(1, ge=0, le=10)  # a crashed trial is run again this many times, then recorded failed
    # Wall-clock seconds for the trials: no batch starts that would end past it, by the longest batch so far
    # (the first always runs). It decides how many batches run, never a trial's result; the same command
    # with more time resumes the study where it stopped. null: every trial.
    budget_s: float | None = Field(None, gt=0, le=30 * 86400)
    space: dict[str, SearchSpace] = Field(default_factory=dict, max_length=32)
    # Where trials run: a Dask scheduler (tls://host:8786, or tcp:// on loopback; or env LOCKSTEP_DASK_ADDRESS);
    # null: a local cluster of `workers` processes. Storage: an Optuna RDB URL (credentials: env LOCKSTEP_SWEEP_STORAGE,
    # never here); null: a journal file, artifacts/sweep/<name>/journal.log.
    address: str | None = Field(None, max_length=255, pattern=r"^(tcp|tls)://[^\s/@]+:\d{1,5}$")
    workers: int = Field(2, ge=1, le=MAX_PROCESSES)
    storage: str | None = Field(None, max_length=1024, pattern=r"^(sqlite|postgresql|mysql)(\+\w+)?://\S+$")
    applied: AppliedSweep | None = None

    @field_validator("space")
    @classmethod
    def _train_keys(cls, space: dict[str, SearchSpace]) -> dict[str, SearchSpace]:
        for key in space:
            leaf = key.removeprefix("train.")
            if not key.startswith("train.") or leaf not in TrainConfig.model_fields or leaf in SWEEP_FORBIDDEN:
                raise ValueError(
                    f"{shown(key)}: a sweep searches train keys (train.lr, train.weight_decay, ...), "
                    f"not {', '.join(sorted(SWEEP_FORBIDDEN))}"
                )
        return space

    @field_validator("storage")
    @classmethod
    def _no_credentials(cls, value: str | None) -> str | None:
        # A user name alone is fine (its password from ~/.pgpass); `sslkey=`, `passfile=` name files, not secrets.
        found = value and url_credentials(value, user_alone_ok=True, names=r"passw|pwd|secret|token")
        if found:
            raise ValueError(
                f"a password in a URL ({found}): put the URL in env LOCKSTEP_SWEEP_STORAGE (or use ~/.pgpass)"
            )
        return value

    @model_validator(mode="after")
    def _direction_fits_metric(self) -> SweepConfig:
        wanted = "maximize" if self.metric == "val_accuracy" else "minimize"
        if self.direction != wanted:
            raise ValueError(f"direction: {self.metric} is optimised by {wanted}, got {self.direction}")
        return self
