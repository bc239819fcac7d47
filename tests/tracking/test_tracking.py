"""Where tracking data goes, decided without a running pipeline."""

from __future__ import annotations

import logging
from importlib.metadata import version
from pathlib import Path

import pytest

from tasks.core.config.service import TrackingConfig
from tasks.core.layout import ROOT, project_root
from tasks.tracking.runs import PARENT_ENV, stage_run
from tasks.tracking.store import tracking_uri
from tasks.tracking.writers import StageRun


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


@pytest.mark.parametrize("writer", ["ClientWriter", "SqliteStore"])
def test_metrics_are_batched_and_a_failed_stage_still_writes_its_curve(
    writer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through MLflow's client (a new store: its experiment is made) and written directly (the next runs)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv(PARENT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)  # lineage tags read dvc.lock / data.dvc relative to here: absent
    if writer == "SqliteStore":
        with stage_run("stats", TrackingConfig(), {}):
            pass
    with pytest.raises(FloatingPointError), stage_run("train", TrackingConfig(), {"lr": 0.1}) as run:
        assert type(run.writer).__name__ == writer
        for epoch in range(1, 4):
            run.log_metrics({"train_loss": 1.0 / epoch}, step=epoch)
        # the first epoch is written at once, the next ones wait for the batch (1 s)
        history = run.mlflow.MlflowClient().get_metric_history(run.run_id, "train_loss")
        assert [m.step for m in history] == [1]
        raise FloatingPointError("loss is nan at epoch 4")
    client = run.mlflow.MlflowClient()
    assert [m.step for m in client.get_metric_history(run.run_id, "train_loss")] == [1, 2, 3]
    failed = client.get_run(run.run_id)
    assert failed.info.status == "FAILED" and failed.data.params == {"lr": "0.1"}
    # its session's pipeline run ended with it, and the machine's load was sampled into its run
    assert client.get_run(failed.data.tags["mlflow.parentRunId"]).info.status == "FAILED"
    assert any(key.startswith("system/") for key in failed.data.metrics)


def test_redaction_masks_secret_env_values_url_credentials_and_secret_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks.core.redact import redact, redact_mapping

    monkeypatch.setenv("SOME_API_TOKEN", "tok-123456789")
    monkeypatch.setenv("NOT_SENSITIVE", "plain-value-123")
    text = "a tok-123456789 b https://u:p@h.example/x?sig=abc&page=2 plain-value-123"
    assert redact(text) == "a *** b https://***@h.example/x?sig=***&page=2 plain-value-123"
    assert redact_mapping({"db_password": "x", "train.lr": 0.1}) == {"db_password": "***", "train.lr": "0.1"}


def test_a_store_failing_again_while_the_run_closes_keeps_the_first_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tracking server whose artifact store is down answers the upload with HTTP 500 and may drop the
    connection for MLflow's closing requests too: the one line still names the 500, not the reset."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from tasks.tracking import sqlite_record
    from tasks.tracking.store import TrackingUnavailable

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv(PARENT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    # the server's part is played by an sqlite store written through MLflow's client, as a server's is
    monkeypatch.setattr(sqlite_record, "start_stage_run", lambda *args: None)
    upload = MlflowException("API request to http://127.0.0.1:1/api/2.0/mlflow-artifacts failed with error code 500")
    reset = MlflowException("API request to http://127.0.0.1:1/api/2.0/mlflow/runs/get failed: Connection reset")

    def closing_fails(*args: object, **kwargs: object) -> None:
        raise reset

    with stage_run("evaluate", TrackingConfig(), {}) as run:  # a healthy store first: the runs exist
        run_id = run.run_id
    monkeypatch.setattr(MlflowClient, "set_terminated", closing_fails)  # the fault: the server goes away
    with pytest.raises(TrackingUnavailable) as failed, stage_run("evaluate", TrackingConfig(), {}):
        raise upload
    assert "HTTP 500" in str(failed.value) and "evaluate stage's records" in str(failed.value)
    assert failed.value.__cause__ is upload
    with pytest.raises(TrackingUnavailable, match="Connection reset"), stage_run("evaluate", TrackingConfig(), {}):
        pass  # a stage that succeeded but whose run could not be closed is not reported as recorded
    monkeypatch.undo()
    assert MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id).info.status == "FINISHED"


def test_only_a_run_that_computes_with_torch_records_its_cuda_versions_whatever_is_loaded() -> None:
    import torch  # loaded here, as the flow's process loads it in a thread while its server starts

    from tasks.tracking.lineage import lineage_tags

    without, computing = lineage_tags(), lineage_tags(torch=True)
    assert not {"version.cuda", "version.cudnn"} & set(without)  # a data stage's or a parent's: the same always
    assert computing["version.cuda"] == str(torch.version.cuda) and "version.cudnn" in computing
    # the installed distribution's version, and the loaded module's (which names its build: "+cu130")
    assert without["version.torch"] == version("torch") and computing["version.torch"] == torch.__version__


def test_mlflows_requirement_check_is_skipped_only_while_the_models_are_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tasks/tracking/registry.py `requirements_taken_as_given`: inside, MLflow saves a model's requirements
    without checking them against this environment (the check maps every installed distribution first);
    outside, MLflow's own check is back and names a requirement this environment does not meet."""
    import mlflow.pyfunc
    import mlflow.utils.environment as environment
    from mlflow.utils import requirements_utils

    from tasks.tracking.registry import requirements_taken_as_given

    unmet = ["numpy==0.0.1"]
    # MLflow's loggers do not propagate to the root logger (its own handler writes to stderr)
    monkeypatch.setattr(logging.getLogger("mlflow"), "handlers", [caplog.handler])
    caplog.set_level(logging.WARNING, logger="mlflow")
    with requirements_taken_as_given():
        _, saved, _ = environment._process_pip_requirements(unmet)
    assert "numpy==0.0.1" in saved  # what the model records is unchanged
    assert "mismatches" not in caplog.text
    environment._process_pip_requirements(unmet)
    assert "numpy (current: " in caplog.text and "required: numpy==0.0.1" in caplog.text
    mlflows = requirements_utils.warn_dependency_requirement_mismatches
    for module in (environment, mlflow.pyfunc):  # MLflow's function again in both modules that call it
        assert module.warn_dependency_requirement_mismatches is mlflows
