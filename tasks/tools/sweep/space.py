"""A sweep's search space as Optuna distributions, and the check that a trial read back from the
study's storage is one this sweep asked for (`check_stored_trial`)."""

from __future__ import annotations

from typing import Any

from tasks.core.config.policy import remote_keys_in
from tasks.core.config.sweep import SearchSpace, SweepConfig
from tasks.core.errors import Refused
from tasks.core.redact import redact


class StoredTrialRefused(Refused):
    """The study's storage holds a trial this sweep did not ask for: a key outside `sweep.space`, or a
    value outside its range (exit 3). Whoever can write the storage would otherwise choose what the
    next trial runs with, or what `--apply` writes into params.yaml."""


def distributions(space: dict[str, SearchSpace]) -> dict[str, Any]:
    """The Optuna distribution of each searched key."""
    # heavy: optuna (~1.4 s, loads numpy), only when a study runs
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
    # heavy: optuna (~1.4 s, loads numpy), only when a study runs
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
    # heavy: optuna (~1.4 s, loads numpy), only when a study runs
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(distribution, CategoricalDistribution):
        return str(list(distribution.choices))
    kind = "int" if isinstance(distribution, IntDistribution) else "float"
    return f"{kind} [{distribution.low}, {distribution.high}]"
