"""Sweeps (tasks/tools/sweep/, flows/sweep.py): a study's trials, pruning and winner depend on the sweep
params and the data only — not on the order trials finish in, the number of workers, a restarted
coordinator or a killed worker.

The fast tests drive the real Optuna study with a synthetic objective (a made-up learning curve per
trial): they check the coordinator's logic in a second. The slow ones run real sweeps of real trainings
on a real Dask scheduler and real worker processes on 127.0.0.1 (tests/tools/test_sweep_dask.py).
"""

from __future__ import annotations

import logging
import math
import random
from pathlib import Path
from typing import Any

import pytest

from tasks.core.cli import one_line
from tasks.core.config.base import ConfigError
from tasks.core.config.params import Params
from tasks.core.config.yaml_io import load_params
from tasks.tools.sweep import results
from tasks.tools.sweep import study as search
from tasks.tools.sweep.trials import (
    Pruning,
    TrialOutcome,
    TrialSpec,
    derived_seed,
    kept_value,
    trial_params,
    warmup_epochs,
)
from tests.conftest import write_params

SPACE = {
    "train.lr": {"type": "float", "low": 0.001, "high": 1.0, "log": True},
    "train.weight_decay": {"type": "float", "low": 0.0, "high": 0.01, "log": False},
    "train.batch_size": {"type": "categorical", "choices": [32, 64, 128]},
    "train.epochs": {"type": "int", "low": 2, "high": 6},
}


def _params(tmp_path: Path, **sweep: Any) -> Params:
    settings = {"trials": 12, "batch": 3, "space": SPACE, "startup_trials": 4, "warmup_epochs": 1, **sweep}
    return load_params(write_params(tmp_path / "params.yaml", {"sweep": settings}))


def _curve(spec: TrialSpec) -> list[dict[str, float]]:
    """A made-up validation curve: best near lr 0.1, rising with the epochs."""
    lr = spec.values["train.lr"]
    ceiling = 0.95 - 0.2 * abs(math.log10(lr) + 1) - 10 * spec.values["train.weight_decay"]
    epochs = spec.values["train.epochs"]
    return [{"epoch": e, "val_accuracy": ceiling * (1 - 0.5**e)} for e in range(1, epochs + 1)]


class Trainer:
    """Runs a batch's synthetic trials like the Dask workers do: pruned against `spec.earlier`, and
    handing results back in the order `order` puts them in (as the fastest worker would)."""

    def __init__(self, cfg: Any, order: str = "as-asked", fail_at_call: int | None = None) -> None:
        self.cfg, self.order, self.fail_at_call = cfg, order, fail_at_call
        self.ran: list[int] = []  # trial numbers, one per training

    def __call__(self, specs: list[TrialSpec]) -> list[TrialOutcome]:
        if self.fail_at_call is not None and len(self.ran) >= self.fail_at_call:
            raise KeyboardInterrupt("the coordinator dies")
        outcomes = [self._train(spec) for spec in specs]
        if self.order == "reversed":
            outcomes.reverse()
        elif self.order == "shuffled":
            random.Random(len(self.ran)).shuffle(outcomes)
        return outcomes

    def _train(self, spec: TrialSpec) -> TrialOutcome:
        self.ran.append(spec.number)
        pruning, history = Pruning(self.cfg, spec.earlier, spec.values["train.epochs"]), []
        for row in _curve(spec):
            history.append(row)
            if pruning.should_stop(spec.number, row):
                return TrialOutcome(spec.number, "pruned", row["val_accuracy"], history)
        value = kept_value(history, len(history), self.cfg.metric)  # the made-up curve rises: its last is its best
        return TrialOutcome(spec.number, "complete", value, history, fingerprint=spec.fingerprint)


def _run(params: Params, study_dir: Path, trainer: Trainer, storage: str | None = None) -> list[dict[str, Any]]:
    study = search.open_study(params.sweep, storage, study_dir, "fp")
    search.run_study(study, params.sweep, "fp", trainer)
    return results.table(study)


def test_results_do_not_depend_on_the_order_trials_finish_in(tmp_path: Path) -> None:
    params = _params(tmp_path)
    tables = {
        order: _run(params, tmp_path / order, Trainer(params.sweep, order))
        for order in ("as-asked", "reversed", "shuffled")
    }
    assert tables["as-asked"] == tables["reversed"] == tables["shuffled"]
    rows = tables["as-asked"]
    assert [row["trial"] for row in rows] == list(range(12))
    # pruning compares with earlier batches only: nothing in the first batch is pruned, something later is
    assert all(row["state"] == "complete" for row in rows[:3])
    assert any(row["state"] == "pruned" for row in rows[3:])
    # each trial's seed is its own, from the sweep seed and its number
    assert len({row["seed"] for row in rows}) == 12
    assert rows[0]["seed"] == derived_seed(0, 0, "train")


class _Lines(logging.Handler):
    """The records one logger emits, counted at that logger. (pytest's caplog once saw each record
    twice in a full-tier worker, after other modules had run Prefect in the same process, while
    Prefect's console printed each once: its capture handlers, not the study, doubled them.)"""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_each_trial_told_is_a_line_with_the_study_s_progress_and_the_best_so_far(tmp_path: Path) -> None:
    params = _params(tmp_path)
    logger, seen = logging.getLogger(search.__name__), _Lines()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(seen)
    try:
        rows = _run(params, tmp_path / "study", Trainer(params.sweep))
    finally:
        logger.removeHandler(seen)
        logger.setLevel(level)
    lines = [line for line in seen.lines if "best so far" in line]
    assert len(lines) == 12 and lines[0].startswith("sweep lockstep: trial 0 complete val_accuracy ")
    assert "(1 of 12 done, 0 pruned, 0 failed); best so far: trial 0, val_accuracy" in lines[0]
    pruned = sum(row["state"] == "pruned" for row in rows)
    best = max((r for r in rows if r["state"] == "complete"), key=lambda r: (r["value"], -r["trial"]))
    leader = f"trial {best['trial']}, val_accuracy {best['value']:.4f}"
    assert lines[-1].endswith(f"(12 of 12 done, {pruned} pruned, 0 failed); best so far: {leader}")


def test_another_sweep_seed_gives_other_trials(tmp_path: Path) -> None:
    one = _run(_params(tmp_path), tmp_path / "a", Trainer(_params(tmp_path).sweep))
    other_params = _params(tmp_path, seed=1)
    other = _run(other_params, tmp_path / "b", Trainer(other_params.sweep))
    assert [r["train.lr"] for r in one] != [r["train.lr"] for r in other]


@pytest.mark.parametrize("storage", ["journal", "rdb"])
def test_a_restarted_coordinator_resumes_without_repeating_a_finished_trial(tmp_path: Path, storage: str) -> None:
    params = _params(tmp_path)
    whole = _run(params, tmp_path / "whole", Trainer(params.sweep))

    url = f"sqlite:///{tmp_path / 'optuna.db'}" if storage == "rdb" else None  # as a PostgreSQL URL would be
    first = Trainer(params.sweep, fail_at_call=6)  # dies when the third batch starts
    with pytest.raises(KeyboardInterrupt):
        _run(params, tmp_path / "resumed", first, url)
    second = Trainer(params.sweep, order="reversed")
    resumed = _run(params, tmp_path / "resumed", second, url)  # a new coordinator: the study from storage

    assert resumed == whole
    assert first.ran == list(range(6)) and second.ran == list(range(6, 12))


def test_a_study_is_not_resumed_with_other_settings(tmp_path: Path) -> None:
    params = _params(tmp_path)
    _run(params, tmp_path / "study", Trainer(params.sweep))
    other = _params(tmp_path, pruner="none")
    with pytest.raises(search.SweepError, match="other sweep settings"):
        search.open_study(other.sweep, None, tmp_path / "study", "other fingerprint")


def test_more_trials_continue_a_finished_study(tmp_path: Path) -> None:
    params = _params(tmp_path)
    _run(params, tmp_path / "study", Trainer(params.sweep))
    more = _params(tmp_path, trials=15)
    trainer = Trainer(more.sweep)
    rows = _run(more, tmp_path / "study", trainer)
    assert trainer.ran == [12, 13, 14] and len(rows) == 15


def test_a_failed_trial_is_a_result(tmp_path: Path) -> None:
    params = _params(tmp_path, trials=3)

    def crashing(specs: list[TrialSpec]) -> list[TrialOutcome]:
        return [TrialOutcome(spec.number, "failed", error="RuntimeError: boom", attempts=2) for spec in specs]

    study = search.open_study(params.sweep, None, tmp_path / "study", "fp")
    search.run_study(study, params.sweep, "fp", crashing)
    rows = results.table(study)
    assert [row["state"] for row in rows] == ["fail"] * 3
    assert rows[0]["error"] == "RuntimeError: boom"
    assert search.best_trial(study) is None


def test_the_best_trial_breaks_ties_by_number(tmp_path: Path) -> None:
    params = _params(tmp_path, trials=4, batch=4, pruner="none")

    def flat(specs: list[TrialSpec]) -> list[TrialOutcome]:
        return [TrialOutcome(s.number, "complete", 0.9, [{"epoch": 1, "val_accuracy": 0.9}]) for s in specs]

    study = search.open_study(params.sweep, None, tmp_path / "study", "fp")
    search.run_study(study, params.sweep, "fp", flat)
    assert search.best_trial(study).number == 0


def test_trial_params_put_the_values_and_the_seed_in_train(tmp_path: Path) -> None:
    params = _params(tmp_path)
    spec = TrialSpec(3, {"train.lr": 0.02, "train.epochs": 4}, seed=1234)
    trial = trial_params(params, spec)
    assert (trial.train.lr, trial.train.epochs, trial.train.seed, trial.train_seed) == (0.02, 4, 1234, 1234)
    assert trial.seed == params.seed  # the split is the project's
    assert trial.train.strategy == "single"


def test_derived_seeds_are_pinned() -> None:
    # numpy's SeedSequence is documented stable; a change here changes every recorded sweep
    assert derived_seed(0, 0, "train") != derived_seed(0, 1, "train")
    assert derived_seed(0, 0, "train") != derived_seed(0, 0, "sampler")
    assert [derived_seed(0, n, "train") for n in range(3)] == PINNED_SEEDS


PINNED_SEEDS = [4147804363, 2919965486, 4152727838]


def test_a_trial_is_scored_at_the_epoch_it_kept_not_its_luckiest() -> None:
    history = [
        {"epoch": 1, "val_accuracy": 0.5, "val_loss": 1.2},
        {"epoch": 2, "val_accuracy": 0.9, "val_loss": 0.7},  # the best by validation
        {"epoch": 3, "val_accuracy": 0.8, "val_loss": 0.6},  # the last
    ]
    assert kept_value(history, 2, "val_accuracy") == 0.9  # train.keep: best
    assert kept_value(history, 3, "val_accuracy") == 0.8  # train.keep: last
    assert kept_value(history, 2, "val_loss") == 0.7  # the kept epoch's loss, not the lowest of the run
    assert kept_value([{"epoch": 1, "val_accuracy": math.nan}], 1, "val_accuracy") is None  # never scored


@pytest.mark.parametrize(
    ("sweep", "message"),
    [
        (
            {"space": {"train.momentum": {"type": "float", "low": 0.5, "high": 1.0}}},
            "sweep.space.train.momentum: 1.0 is not a valid",
        ),
        ({"space": {"train.strategy": {"type": "categorical", "choices": ["ddp"]}}}, "a sweep searches train keys"),
        ({"space": {"train.seed": {"type": "int", "low": 0, "high": 9}}}, "a sweep searches train keys"),
        ({"space": {"evaluate.batch_size": {"type": "int", "low": 1, "high": 9}}}, "a sweep searches train keys"),
        ({"space": {"train.lr": {"type": "categorical", "low": 0.1, "choices": [0.1]}}}, "give choices"),
        ({"space": {"train.epochs": {"type": "int", "low": 1, "high": 2.5}}}, "whole numbers"),
        ({"space": {"train.momentum": {"type": "float", "low": 0.5, "high": 0.1}}}, "must be below high"),
        ({"metric": "val_loss", "direction": "maximize"}, "val_loss is optimised by minimize"),
        ({"address": "http://10.0.0.5:8786"}, "sweep.address"),
    ],
)
def test_bad_sweep_params_are_refused_naming_the_key(tmp_path: Path, sweep: dict, message: str) -> None:
    path = write_params(tmp_path / "params.yaml", {"sweep": sweep})
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_params(path)


def test_a_storage_url_with_a_password_is_refused_without_showing_it(tmp_path: Path) -> None:
    path = write_params(tmp_path / "params.yaml", {"sweep": {"storage": "postgresql://me:s3cret@db:5432/optuna"}})
    with pytest.raises(ConfigError, match="LOCKSTEP_SWEEP_STORAGE") as raised:
        load_params(path)
    shown = one_line(str(raised.value))  # the error line every entry point prints (and logs)
    assert "s3cret" not in shown and "postgresql://***@db:5432/optuna" in shown


def test_a_budget_stops_before_a_batch_that_would_overrun_it_and_more_time_resumes(tmp_path: Path) -> None:
    # each batch "takes" 100 s of the clock the trainer advances: 250 s hold two batches (the third
    # would end at 300 s), and the winner is the best of the trials a budget-free study ran first
    now = [0.0]

    class Timed(Trainer):
        def __call__(self, specs: list[TrialSpec]) -> list[TrialOutcome]:
            now[0] += 100.0
            return super().__call__(specs)

    (tmp_path / "whole").mkdir()
    unbounded = _params(tmp_path / "whole")
    whole = _run(unbounded, tmp_path / "whole" / "study", Trainer(unbounded.sweep))
    params = _params(tmp_path, budget_s=250)
    trainer = Timed(params.sweep)
    study = search.open_study(params.sweep, None, tmp_path / "study", "fp")
    search.run_study(study, params.sweep, "fp", trainer, clock=lambda: now[0])
    assert trainer.ran == list(range(6))
    assert results.table(study) == [row for row in whole if row["trial"] < 6]
    # budget_s may change between runs of one study (it decides how many batches run, not what they give)
    more = _params(tmp_path, budget_s=10_000)
    search.run_study(search.open_study(more.sweep, None, tmp_path / "study", "fp"), more.sweep, "fp", trainer)
    assert trainer.ran == list(range(12)) and results.table(study) == whole


def test_the_auto_warm_up_is_a_quarter_of_the_trials_epochs(tmp_path: Path) -> None:
    """`sweep.warmup_epochs: auto` (the default): a trial of 40 epochs, far below an earlier one at every
    epoch, runs 10 before it can be pruned, then is at the end of its 11th; a given count is kept."""
    import optuna

    auto = _params(tmp_path, warmup_epochs="auto").sweep
    assert [warmup_epochs(auto, epochs) for epochs in (1, 7, 8, 40, 50, 200)] == [1, 1, 2, 10, 12, 50]
    assert warmup_epochs(_params(tmp_path, warmup_epochs=3).sweep, 40) == 3
    strong = optuna.trial.create_trial(value=0.9, intermediate_values={epoch: 0.9 for epoch in range(1, 41)})
    pruning = Pruning(auto, [strong], 40)
    stops = [pruning.should_stop(1, {"epoch": epoch, "val_accuracy": 0.1}) for epoch in range(1, 41)]
    assert stops.index(True) + 1 == 11


def test_a_local_cluster_starts_at_most_one_worker_a_core(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from flows import sweep as sweep_flow  # Prefect's import: only for this test

    monkeypatch.setattr(sweep_flow, "cores_given", lambda: 2)
    # on the module's logger itself: Prefect's logging set-up on import replaced the root's handlers
    monkeypatch.setattr(sweep_flow.log, "handlers", [caplog.handler])
    with caplog.at_level(logging.WARNING, logger=sweep_flow.__name__):
        assert [sweep_flow.local_workers(n) for n in (1, 2)] == [1, 2]
        assert not caplog.records
        assert sweep_flow.local_workers(4) == 2
    assert "sweep.workers is 4, and this machine gives 2 core(s): starting 2 local workers" in caplog.text
