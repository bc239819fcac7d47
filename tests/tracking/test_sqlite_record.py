"""Runs written without MLflow's client (tasks/tracking/sqlite_record.py, sqlite_store.py) are the runs
MLflow's client writes, as MLflow's client reads both back: a stage's, its session's pipeline run, the
flow's pipeline run, the no-op pipeline run, each rule of `log_batch`; and nothing is written directly where
it cannot be sure."""

from __future__ import annotations

import json
import math
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from tasks.tracking.sqlite_store import SCHEMA_REVISION
from tests.conftest import client_for, clone_project, run

pytestmark = pytest.mark.slow

# In the project's own process, as flows/noop.py records a run: once directly, once through MLflow's
# client (the flow's code, pipeline_run + tag_run, its direct path declined); the two run ids (or None)
# on the last line.
BOTH_WAYS = """
import json, os, sys
from tasks.core.layout import ROOT
from tasks.determinism.bootstrap import bootstrap
from tasks.tracking import sqlite_record
from tasks.tracking.runs import pipeline_run, tag_run
from tasks.tracking.sqlite_record import record_pipeline_run
from tasks.tracking.store import tracking_uri

os.chdir(ROOT)
params = bootstrap(ROOT / "params.yaml")
tags = {"lockstep.summary": "nothing ran", "lockstep.retrained": "false"}
direct = record_pipeline_run(tracking_uri(), params, "prefect", tags)
through = None
if sys.argv[1:] != ["direct"]:
    sqlite_record.start_pipeline_run = lambda *args: None
    with pipeline_run(params.tracking, entry_point="prefect", params=params) as through:
        tag_run(through, tags)
print(json.dumps([direct, through]))
"""


def _ids(repo: Path, *args: str) -> tuple[str | None, str | None]:
    done = run(["python", "-c", BOTH_WAYS, *args], repo)
    direct, through = json.loads(done.stdout.strip().splitlines()[-1])
    return direct, through


def _as_read(client: Any, run_id: str) -> dict[str, Any]:
    """A run as MLflow's client reads it, less what differs between two runs made a moment apart."""
    found = client.get_run(run_id)
    info = found.info
    histories = {  # (as stored: NaN never equals itself, so each value as printed)
        key: sorted((m.step, repr(m.value)) for m in client.get_metric_history(run_id, key))
        for key in found.data.metrics
    }
    return {
        "info": (
            info.run_name,
            info.status,
            info.user_id,
            info.lifecycle_stage,
            info.experiment_id,
            info.artifact_uri.replace(run_id, "<id>"),
            info.end_time >= info.start_time,
        ),
        "tags": dict(sorted(found.data.tags.items())),
        "params": dict(sorted(found.data.params.items())),
        "metrics": dict(sorted(found.data.metrics.items())),
        "histories": dict(sorted(histories.items())),
        "datasets": [
            (d.dataset.name, d.dataset.digest, d.dataset.source_type, d.dataset.source, d.dataset.schema)
            + tuple((t.key, t.value) for t in d.tags)
            for d in found.inputs.dataset_inputs
        ],
    }


def test_a_run_written_directly_reads_back_as_mlflows_own(dvc_repo: dict[str, Any], tmp_path: Path) -> None:
    repo = clone_project(dvc_repo["repo"], tmp_path / "repo")
    direct, through = _ids(repo)
    assert direct is not None, "the trained project's store was not written directly"
    client = client_for(repo)
    written, reference = _as_read(client, direct), _as_read(client, through)
    assert written == reference
    assert written["info"][0].startswith("prefect: nothing stale · data ")
    assert written["metrics"]["test_accuracy"] > 0 and written["histories"]["val_accuracy"]
    assert written["datasets"] and written["tags"]["lockstep.summary"] == "nothing ran"
    # and MLflow's own search finds it among the pipeline runs, as the UI's runs table does
    experiment = client.get_experiment_by_name("lockstep").experiment_id
    found = client.search_runs([experiment], filter_string="tags.`lockstep.entry_point` = 'prefect'")
    assert {direct, through} <= {r.info.run_id for r in found}


def test_a_store_it_does_not_know_is_left_to_mlflow(dvc_repo: dict[str, Any], tmp_path: Path) -> None:
    """Another schema revision (an MLflow upgrade), or a run still RUNNING (the orphan sweep's business):
    nothing is written directly, and MLflow's client records the run."""
    for case, change in {
        "schema": "update alembic_version set version_num = 'ffffffffffff'",
        "running": "update runs set status = 'RUNNING' where run_uuid = (select min(run_uuid) from runs)",
    }.items():
        repo = clone_project(dvc_repo["repo"], tmp_path / case)
        with closing(sqlite3.connect(repo / "mlflow.db")) as db, db:
            db.execute(change)
            before = db.execute("select count(*) from runs").fetchone()[0]
        # (MLflow's client refuses a schema it does not know itself: the direct writer is tried alone there)
        direct, through = _ids(repo, *(["direct"] if case == "schema" else []))
        assert direct is None and (through is None) == (case == "schema"), case
        with closing(sqlite3.connect(repo / "mlflow.db")) as db:
            after = db.execute("select count(*) from runs").fetchone()[0]
        assert after == before + (0 if case == "schema" else 1), case


# Two stages of one session in the project's own process, as `python -m tasks <stage>` runs each: their
# runs written directly, or ("client") by MLflow's client alone. Last line: the session's key, and
# whether MLflow was loaded at all.
STAGES = """
import json, os, sys
from tasks.core.layout import ROOT
from tasks.determinism.bootstrap import bootstrap

os.chdir(ROOT)
params = bootstrap(ROOT / "params.yaml")
from tasks.runner import run_stage
from tasks.tracking import sqlite_record
from tasks.tracking.owners import session_key

if sys.argv[1] == "client":
    sqlite_record.start_stage_run = lambda *args: None
for stage in ("stats", "evaluate"):
    run_stage(stage, params)
print(json.dumps([session_key(), "mlflow" in sys.modules]))
"""
VOLATILE = {  # what differs between two processes' runs: who owned them, which session, which parent
    "lockstep.owner.pid",
    "lockstep.owner.started",
    "lockstep.owner.start_mark",
    "lockstep.session",
    "mlflow.parentRunId",
}


def _session(client: Any, key: str) -> dict[str, Any]:
    """The session's pipeline run and its stage runs, as read, with the volatile tags' values left out."""
    experiment = client.get_experiment_by_name("lockstep").experiment_id
    parent = client.search_runs([experiment], filter_string=f"tags.`lockstep.session` = '{key}'")[0].info.run_id
    children = client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    runs = {"pipeline": parent} | {c.data.tags["lockstep.stage"]: c.info.run_id for c in children}
    read = {}
    for name, run_id in runs.items():
        seen = _as_read(client, run_id)
        assert {"lockstep.owner.pid", "lockstep.owner.start_mark"} <= set(seen["tags"]), name
        seen["tags"] = {k: "<volatile>" if k in VOLATILE else v for k, v in seen["tags"].items()}
        seen["artifacts"] = sorted(_artifacts(client, run_id))
        read[name] = seen
    return read


def _artifacts(client: Any, run_id: str, path: str | None = None) -> list[tuple[str, int | None]]:
    found = []
    for item in client.list_artifacts(run_id, path):
        found += _artifacts(client, run_id, item.path) if item.is_dir else [(item.path, item.file_size)]
    return found


def test_a_sessions_stage_runs_written_directly_read_back_as_mlflows_own(
    dvc_repo: dict[str, Any], tmp_path: Path
) -> None:
    """What `dvc repro` leaves: the stage runs, and the session's pipeline run made by the first stage,
    resumed by the next, named and given its headline numbers at each end; with MLflow never loaded."""
    repo = clone_project(dvc_repo["repo"], tmp_path / "repo")
    keys = {}
    for mode in ("direct", "client"):
        done = run(["python", "-c", STAGES, mode], repo)
        keys[mode], loaded = json.loads(done.stdout.strip().splitlines()[-1])
        assert loaded == (mode == "client"), f"{mode}: MLflow loaded: {loaded}"
    client = client_for(repo)
    direct, reference = _session(client, keys["direct"]), _session(client, keys["client"])
    assert set(direct) == {"pipeline", "stats", "evaluate"}
    assert direct == reference
    pipeline = direct["pipeline"]
    assert pipeline["info"][:2] == ("cli: stats, evaluate · data 0c18b2fd", "FINISHED")
    assert pipeline["metrics"]["test_accuracy"] > 0.9 and pipeline["datasets"]
    shipped = {"metrics.json", "per_class.json", "predictions.csv", "confusion_matrix.png"}
    assert {path for path, _size in direct["evaluate"]["artifacts"]} == shipped
    assert direct["evaluate"]["info"][2] == direct["evaluate"]["tags"]["mlflow.user"]  # the run's user


# A flow run's pipeline run with a stage in it, as flows/pipeline_flow.py makes it (pipeline_run, tag_run,
# a stage run nested in it): written directly, then through MLflow's client (the direct path declined).
# Last line: both run ids, and whether MLflow was loaded by the first.
FLOW_RUNS = """
import json, os, sys
from tasks.core.layout import ROOT
from tasks.determinism.bootstrap import bootstrap

os.chdir(ROOT)
params = bootstrap(ROOT / "params.yaml")
from tasks.runner import run_stage
from tasks.tracking import sqlite_record
from tasks.tracking.orphans import FLOW_RUN_TAG
from tasks.tracking.runs import pipeline_run, tag_run


def flow_run(flow_run_id):
    with pipeline_run(params.tracking, entry_point="prefect", params=params) as run_id:
        tag_run(run_id, {FLOW_RUN_TAG: flow_run_id})
        run_stage("stats", params)
        tag_run(run_id, {"lockstep.summary": "stats ran", "lockstep.retrained": "false", FLOW_RUN_TAG: flow_run_id})
    return run_id


direct = flow_run("flow-run")
loaded = "mlflow" in sys.modules
sqlite_record.start_pipeline_run = lambda *args: None
print(json.dumps([direct, flow_run("flow-run"), loaded]))
"""


def test_a_flows_pipeline_run_written_directly_reads_back_as_mlflows_own(
    dvc_repo: dict[str, Any], tmp_path: Path
) -> None:
    """The flow's pipeline run, its tags, the stage run nested in it and its record at the end, written
    without MLflow's client (which a flow run then loads only to log its models) and through it."""
    repo = clone_project(dvc_repo["repo"], tmp_path / "repo")
    direct, through, loaded = json.loads(run(["python", "-c", FLOW_RUNS], repo).stdout.strip().splitlines()[-1])
    assert not loaded, "the pipeline run written directly loaded MLflow"
    client = client_for(repo)
    written, reference = _as_read(client, direct), _as_read(client, through)
    assert written == reference
    assert written["info"][:2] == ("prefect: stats · data 0c18b2fd", "FINISHED"), written["info"]
    assert written["tags"]["lockstep.summary"] == "stats ran" and written["tags"]["lockstep.flow_run"] == "flow-run"
    assert written["params"] and written["metrics"]["test_accuracy"] > 0.9 and written["datasets"]
    experiment = client.get_experiment_by_name("lockstep").experiment_id
    for run_id in (direct, through):
        (child,) = client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{run_id}'")
        assert child.data.tags["lockstep.stage"] == "stats" and child.info.status == "FINISHED"


def test_the_direct_writer_keeps_mlflows_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same calls through MLflow's client and written directly: a param logged again (the same value
    passes, another raises), tags replaced, the run renamed by its tag, metrics with NaN, infinities,
    a point logged twice and an older step logged later (the latest-metric rule), an artifact."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from tasks.tracking.dashboard import ensure_training_view
    from tasks.tracking.sqlite_store import SqliteStore
    from tasks.tracking.writers import ClientWriter

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("lockstep", artifact_location=(tmp_path / "artifacts").as_uri())
    ensure_training_view(client, client.get_experiment(experiment))
    store = SqliteStore.open(uri, "lockstep")
    assert store is not None
    tags = {"mlflow.user": "someone", "lockstep.stage": "train"}
    runs = {
        "client": client.create_run(experiment, run_name="r", tags=tags).info.run_id,
        "direct": store.create_run("r", tags),
    }
    writers = {"client": ClientWriter(mlflow), "direct": store}
    inf = math.inf
    batches = [
        {
            "params": {"lr": "0.1"},
            "tags": {"t": "x"},
            "metrics": [("m", 1.0, 5, 0), ("m", 1.0, 5, 0), ("n", -inf, 1, 0)],
        },
        {"params": {"lr": "0.1", "seed": "1"}, "tags": {"t": "y", "mlflow.runName": "renamed"}},
        {"metrics": [("m", math.nan, 6, 2), ("m", inf, 4, 2), ("m", 3.0, 9, 1), ("k", 2.0, 3, 0)]},
    ]
    artifact = tmp_path / "history.json"
    artifact.write_text('{"epoch": 1}')
    for way, writer in writers.items():
        for batch in batches:
            writer.log_batch(runs[way], **batch)
        with pytest.raises(MlflowException if way == "client" else ValueError, match="lr"):
            writer.log_batch(runs[way], params={"lr": "0.2"})
        writer.log_artifact(runs[way], artifact, "curves")
    client.set_terminated(runs["client"], "FAILED")
    store.update_run(runs["direct"], "FAILED", end=True)
    store.close()

    direct, reference = _as_read(client, runs["direct"]), _as_read(client, runs["client"])
    assert repr(direct) == repr(reference)  # (NaN never equals itself: the latest values as printed)
    stamps = {
        way: sorted((m.step, m.timestamp) for m in client.get_metric_history(run_id, "m"))
        for way, run_id in runs.items()
    }
    assert stamps["direct"] == stamps["client"] == [(0, 5), (1, 9), (2, 4), (2, 6)]
    assert direct["info"][:3] == ("renamed", "FAILED", "someone") and math.isnan(direct["metrics"]["m"])
    assert _artifacts(client, runs["direct"]) == _artifacts(client, runs["client"]) == [("curves/history.json", 12)]


def test_the_schema_it_writes_is_mlflows_current_one() -> None:
    """An MLflow upgrade that migrates the store fails here: check sqlite_record.py's writes against the
    new SqlAlchemyStore, then move SCHEMA_REVISION on."""
    from mlflow.store.db.utils import _get_latest_schema_revision

    assert _get_latest_schema_revision() == SCHEMA_REVISION
