"""Issue 35, point 2: whoever can write a sweep's Optuna storage (the journal file, a shared database)
must not steer the next run. Trials are planted in the storage by another writer, as an attacker with
write access would, and the sweep refuses them in one line (exit 3) before any trial runs, and
before `--apply` writes params.yaml: params read back are accepted only for keys in `sweep.space`,
with values inside their declared distribution, and never for keys that reach the network.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from flows.sweep import _apply
from tasks.core.cli import exit_code
from tasks.core.config.yaml_io import load_params
from tasks.tools.sweep.results import summarise
from tasks.tools.sweep.space import distributions
from tasks.tools.sweep.study import JOURNAL, open_study, run_study, study_digest
from tasks.tools.sweep.trials import TrialOutcome, TrialSpec, derived_seed
from tests.conftest import write_params

SPACE = {
    "train.lr": {"type": "float", "low": 0.001, "high": 1.0, "log": True},
    "train.batch_size": {"type": "categorical", "choices": [32, 64, 128]},
    "train.epochs": {"type": "int", "low": 2, "high": 6},
}
# merged into params.yaml's own space (train.weight_decay, train.label_smoothing)
GOOD = {
    "train.lr": 0.05,
    "train.batch_size": 64,
    "train.epochs": 3,
    "train.weight_decay": 0.001,
    "train.label_smoothing": 0.1,
}
RUN_ID = "0123456789abcdef0123456789abcdef"


def _setup(tmp_path: Path, storage: str, trials: int = 2) -> tuple[Path, Any, str | None]:
    params_file = write_params(tmp_path / "params.yaml", {"sweep": {"trials": trials, "batch": 1, "space": SPACE}})
    cfg = load_params(params_file).sweep
    url = f"sqlite:///{tmp_path / 'optuna.db'}" if storage == "rdb" else None
    open_study(cfg, url, tmp_path / "study", "fp")  # the sweep made the study (a first run)
    return params_file, cfg, url


def _plant(tmp_path: Path, cfg: Any, url: str | None, params: dict[str, Any], state: TrialState) -> None:
    """Another writer of the storage adds a trial (with distributions that fit its forged values)."""
    storage: Any = url or optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "study" / JOURNAL))
    )
    study = optuna.load_study(study_name=cfg.name, storage=storage)
    dists = {
        key: (
            CategoricalDistribution([value])
            if isinstance(value, str | bool)
            else IntDistribution(0, max(value, 1))
            if isinstance(value, int)
            else FloatDistribution(0.0, max(value, 1.0))
        )
        for key, value in params.items()
    }
    complete = state == TrialState.COMPLETE
    study.add_trial(
        create_trial(
            params=params,
            distributions=dists,
            state=state,
            value=0.999 if complete else None,
            user_attrs={"seed": 1, "run_id": RUN_ID} if complete else {"seed": 1},
        )
    )


class NoTraining:
    """The batch runner: planted trials must be refused before it is called."""

    def __init__(self) -> None:
        self.ran: list[int] = []

    def __call__(self, specs: list[TrialSpec]) -> list[TrialOutcome]:
        self.ran += [spec.number for spec in specs]
        return [TrialOutcome(s.number, "complete", 0.5, [{"epoch": 1, "val_accuracy": 0.5}]) for s in specs]


def _refused(fn: Any, capsys: pytest.CaptureFixture[str]) -> str:
    assert exit_code(fn) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("storage", ["journal", "rdb"])
def test_a_forged_complete_trial_is_neither_learnt_from_nor_applied(
    tmp_path: Path, storage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    params_file, cfg, url = _setup(tmp_path, storage, trials=1)
    forged = {
        **GOOD,
        "train.strategy": "ddp",
        "train.nnodes": 2,
        "train.rdzv_endpoint": "attacker.example:29500",
        "data.url": "https://attacker.example/x.tgz",
    }
    _plant(tmp_path, cfg, url, forged, TrialState.COMPLETE)
    before = params_file.read_bytes()
    study = open_study(cfg, url, tmp_path / "study", "fp")  # the fingerprint is the study's own

    # the study looks finished (1 of 1 trials): resuming it, then --apply
    err = _refused(lambda: run_study(study, cfg, "fp", NoTraining()), capsys)
    assert "trial 0: data.url reaches the network or other machines" in err, err
    err = _refused(lambda: _apply(str(params_file), summarise(study, cfg, 0.0), cfg.name), capsys)
    assert "trial 0: data.url" in err and "params.yaml untouched" in err, err
    assert params_file.read_bytes() == before


@pytest.mark.parametrize("storage", ["journal", "rdb"])
@pytest.mark.parametrize(
    ("planted", "fragment"),
    [
        (
            {**GOOD, "train.nproc_per_node": 64, "train.epochs": 10000},
            "train.nproc_per_node is not in sweep.space (and 1 more",
        ),
        ({**GOOD, "train.epochs": 10000}, "train.epochs 10000 is outside its declared range int [2, 6]"),
        ({**GOOD, "train.nproc_per_node": 64}, "train.nproc_per_node is not in sweep.space"),
        ({**GOOD, "train.pretrained_url": "https://attacker.example/w.pt"}, "train.pretrained_url reaches the network"),
        ({**GOOD, "train.lr": 50.0}, "train.lr 50.0 is outside its declared range float [0.001, 1.0]"),
        ({**GOOD, "train.batch_size": 4096}, "train.batch_size 4096 is outside its declared range [32, 64, 128]"),
        ({**GOOD, "train.batch_size": "64"}, "train.batch_size '64' is outside"),
        ({**GOOD, "train.epochs": True}, "train.epochs True is outside"),
        ({k: v for k, v in GOOD.items() if k != "train.epochs"}, "train.epochs is missing"),
    ],
)
def test_a_planted_unfinished_trial_is_not_run(
    tmp_path: Path, storage: str, planted: dict[str, Any], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An interrupted sweep re-runs its unfinished trials with the params they were given: a RUNNING
    trial planted in the storage is refused instead, and nothing trains."""
    params_file, cfg, url = _setup(tmp_path, storage)
    _plant(tmp_path, cfg, url, planted, TrialState.RUNNING)
    before = params_file.read_bytes()
    study = open_study(cfg, url, tmp_path / "study", "fp")
    trainer = NoTraining()
    err = _refused(lambda: run_study(study, cfg, "fp", trainer), capsys)
    assert f"study 'lockstep' trial 0: {fragment}" in err, err
    assert trainer.ran == [] and params_file.read_bytes() == before


def test_the_sweeps_own_trials_pass_and_apply(tmp_path: Path) -> None:
    """The check lets through what the sweep asked for, interrupted or not, and --apply still writes."""
    params_file, cfg, url = _setup(tmp_path, "journal", trials=3)
    study = open_study(cfg, url, tmp_path / "study", "fp")
    study.ask(fixed_distributions=distributions(cfg.space))  # a trial left RUNNING by a dead coordinator
    trainer = NoTraining()
    run_study(study, cfg, "fp", trainer)
    assert trainer.ran == [0, 1, 2]
    summary = summarise(study, cfg, 0.0)
    summary["best"]["run_id"] = RUN_ID
    _apply(str(params_file), summary, cfg.name)
    applied = load_params(params_file)
    assert applied.sweep.applied is not None and applied.sweep.applied.trial == summary["best"]["trial"]
    assert applied.train.seed == derived_seed(cfg.seed, summary["best"]["trial"], "train")


def test_a_study_resumes_after_its_winner_was_applied_even_without_tracking(tmp_path: Path) -> None:
    """`make tune` twice: the first writes the winner (its searched values and seed) into params.yaml,
    the second resumes the same study. With tracking off the winner has no MLflow run to name."""
    params_file = write_params(tmp_path / "params.yaml", {"sweep": {"trials": 2, "batch": 1, "space": SPACE}})
    before = load_params(params_file)
    cfg, digest = before.sweep, study_digest(before, "data")
    run_study(open_study(cfg, None, tmp_path / "study", digest), cfg, digest, NoTraining())
    study = open_study(cfg, None, tmp_path / "study", digest)
    summary = summarise(study, cfg, 0.0)
    assert summary["best"]["run_id"] is None  # (no trial logged a run)
    _apply(str(params_file), summary, cfg.name)
    applied = load_params(params_file)
    assert applied.sweep.applied is not None and applied.sweep.applied.run_id is None
    assert applied.train.lr == summary["best"]["params"]["train.lr"]
    assert study_digest(applied, "data") == study_digest(before, "data")
    open_study(applied.sweep, None, tmp_path / "study", study_digest(applied, "data"))  # resumes: no SweepError
    # a train key no trial overrides is an input of the study: another value is another study
    other = applied.model_copy(update={"train": applied.train.model_copy(update={"momentum": 0.5})})
    assert study_digest(other, "data") != study_digest(before, "data")
