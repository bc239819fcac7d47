"""The no-op run's record written without MLflow's client (tasks/tracking/sqlite_record.py) is the record
MLflow's client writes, as MLflow's client reads both back; and it writes nothing where it cannot be sure."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from tasks.tracking.sqlite_record import SCHEMA_REVISION
from tests.conftest import client_for, clone_project, run

pytestmark = pytest.mark.slow

# In the project's own process, as flows/noop.py records a run: once directly, once through MLflow's
# client (the flow's code: pipeline_run + tag_run); the two run ids (or None) on the last line.
BOTH_WAYS = """
import json, os, sys
from tasks.core.layout import ROOT
from tasks.determinism.bootstrap import bootstrap
from tasks.tracking.runs import pipeline_run, tag_run
from tasks.tracking.sqlite_record import record_pipeline_run
from tasks.tracking.store import tracking_uri

os.chdir(ROOT)
params = bootstrap(ROOT / "params.yaml")
tags = {"lockstep.summary": "nothing ran", "lockstep.retrained": "false"}
direct = record_pipeline_run(tracking_uri(), params, "prefect", tags)
through = None
if sys.argv[1:] != ["direct"]:
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
    histories = {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)] for key in found.data.metrics}
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
        "tags": found.data.tags,
        "params": found.data.params,
        "metrics": found.data.metrics,
        "histories": histories,
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


def test_the_schema_it_writes_is_mlflows_current_one() -> None:
    """An MLflow upgrade that migrates the store fails here: check sqlite_record.py's writes against the
    new SqlAlchemyStore, then move SCHEMA_REVISION on."""
    from mlflow.store.db.utils import _get_latest_schema_revision

    assert _get_latest_schema_revision() == SCHEMA_REVISION
