"""Where tracking data goes, decided without a running pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.layout import ROOT, project_root
from tasks.tracking import StageRun, tracking_uri


def test_default_store_is_absolute_and_project_rooted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri() == f"sqlite:///{ROOT / 'mlflow.db'}"
    assert Path(tracking_uri().removeprefix("sqlite:///")).is_absolute()


def test_environment_overrides_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5555")
    assert tracking_uri() == "http://127.0.0.1:5555"


def test_dvc_temporary_experiments_track_into_the_real_project() -> None:
    assert project_root(Path("/home/u/proj/.dvc/tmp/exps/tmpab12")) == Path("/home/u/proj")
    assert project_root(Path("/home/u/proj")) == Path("/home/u/proj")


def test_disabled_tracking_logs_nothing_and_says_so() -> None:
    run = StageRun()
    run.log_metrics({"x": 1.0})  # accepted and dropped: the user turned tracking off
    assert not run.enabled
    with pytest.raises(RuntimeError, match="tracking.enabled: false"):
        _ = run.mlflow
