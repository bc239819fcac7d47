"""A finished pipeline run written into the project's own sqlite MLflow store without MLflow's client.

Why: a `make run` with nothing stale does no work but leave its pipeline run in MLflow (flows/noop.py),
and MLflow's client costs ~2.9 s of CPU before its first write on 2 cores: `import mlflow` (~1.7 s:
pandas, FastAPI, its GenAI modules) and its SQLAlchemy store (~1.1 s: SQLAlchemy, Alembic, ~70 ORM
mappings), against ~0.05 s for the rows themselves. So this one record, of one shape, is written with
the standard library's sqlite3, in one transaction, as MLflow 3.17's SqlAlchemyStore writes it
(`create_run`, `log_batch`, `log_inputs`, `update_run_info`: the same columns, values and latest-metric
rule). Its content comes from the same functions MLflow's path uses (tasks/tracking/runs.py
`pipeline_tags`, dashboard.py `shown_params`, `recipe_params`, `headline_metrics`, `run_name`); tests/tracking/
test_sqlite_record.py compares the two runs as MLflow's client reads them back.

It writes only when it can be sure; otherwise it returns None and the caller uses MLflow's client:
the store's schema revision is the one checked here (`SCHEMA_REVISION`: an MLflow upgrade changes it,
and a test fails until this module is checked again), the experiment and its training view exist
(`ensure_training_view` would write nothing), no run of it is RUNNING (the orphan sweep would look
at it), the dataset is already recorded (MLflow builds its source and schema), every value is finite
and within MLflow's limits.
"""

from __future__ import annotations

import math
import sqlite3
import time
import urllib.parse
import uuid
from contextlib import closing
from pathlib import Path
from typing import Any

from tasks.core.config.params import Params
from tasks.core.hashing import data_md5
from tasks.core.redact import redact_mapping
from tasks.tracking.dashboard import (
    EXPERIMENT_KIND_TAG,
    VIEW_TAG,
    _view_state,
    dataset_name,
    headline,
    headline_metrics,
    recipe_params,
    run_name,
    shown_params,
)
from tasks.tracking.runs import pipeline_tags

# alembic_version of MLflow 3.17.2's sqlite store (`mlflow.store.db.utils._get_latest_schema_revision()`)
SCHEMA_REVISION = "dc11669786a5"
MAX_KEY, MAX_PARAM, MAX_TAG = 250, 6000, 8000  # MLflow's validation limits (mlflow/utils/validation.py)
RUN_NAME_TAG = "mlflow.runName"
DATASET_CONTEXT = ("mlflow.data.context", "training")  # the input tag log_dataset gives the data


def database(uri: str) -> Path | None:
    """The sqlite file behind a `sqlite:///` tracking URI, if it exists; None for any other store."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme != "sqlite" or parsed.netloc or parsed.query:
        return None
    path = Path(parsed.path[1:])  # sqlite:///<path>, absolute (sqlite:////...) or not, as store.py reads it
    return path if path.is_file() else None


def record_pipeline_run(uri: str, params: Params, entry_point: str, extra_tags: dict[str, str]) -> str | None:
    """A finished pipeline run in which no stage ran, as `pipeline_run` + `tag_run` leave it; its run id,
    or None if this store is not one this module may write (then nothing was written)."""
    path = database(uri)
    if path is None:
        return None
    md5 = data_md5()
    start = _now()
    tags = {**pipeline_tags(entry_point), **redact_mapping(extra_tags)}
    result = headline()
    tags["export.shipped_variant"] = result.shipped_variant or "none"
    tags[RUN_NAME_TAG] = run_name(entry_point, [], md5)
    content = {
        "tags": tags,
        "params": shown_params(params) | recipe_params(result),
        "metrics": headline_metrics(result, {}, _now()),
        "dataset": (dataset_name(params), md5.removesuffix(".dir")) if md5 != "none" else None,
    }
    if not _fits(content):
        return None
    with closing(sqlite3.connect(path, timeout=30, isolation_level=None)) as db:
        db.execute("BEGIN IMMEDIATE")  # the checks and the writes see one state of the store
        try:
            run_id = _write(db, params.tracking.experiment, start, content)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("ROLLBACK" if run_id is None else "COMMIT")
    return run_id


def experiment_id(uri: str, name: str) -> str | None:
    """The id of the active experiment `name` in the sqlite store at `uri`, read without MLflow's client;
    None if this module does not know the store (its kind or its schema)."""
    path = database(uri)
    if path is None:
        return None
    with closing(sqlite3.connect(path, timeout=30)) as db:
        if db.execute("select version_num from alembic_version").fetchall() != [(SCHEMA_REVISION,)]:
            return None
        found = db.execute(_EXPERIMENT, (name,)).fetchone()
    return str(found[0]) if found else None


_EXPERIMENT = (
    "select experiment_id, artifact_location from experiments "
    "where name = ? and lifecycle_stage = 'active' and workspace = 'default'"
)


def _now() -> int:
    return int(time.time() * 1000)


def _fits(content: dict[str, Any]) -> bool:
    keys = [*content["tags"], *content["params"], *(m[0] for m in content["metrics"])]
    return (
        all(len(key) <= MAX_KEY for key in keys)
        and all(len(value) <= MAX_TAG for value in content["tags"].values())
        and all(len(value) <= MAX_PARAM for value in content["params"].values())
        and all(math.isfinite(m[1]) for m in content["metrics"])
    )


def _write(db: sqlite3.Connection, experiment: str, start: int, content: dict[str, Any]) -> str | None:
    if db.execute("select version_num from alembic_version").fetchall() != [(SCHEMA_REVISION,)]:
        return None
    found = db.execute(_EXPERIMENT, (experiment,)).fetchone()
    if found is None:
        return None
    experiment_id, location = found
    experiment_tags = dict(db.execute("select key, value from experiment_tags where experiment_id = ?", found[:1]))
    if EXPERIMENT_KIND_TAG not in experiment_tags or experiment_tags.get(VIEW_TAG) != _view_state():
        return None
    if db.execute("select 1 from runs where experiment_id = ? and status = 'RUNNING'", found[:1]).fetchone():
        return None
    dataset = None
    if content["dataset"] is not None:
        dataset = db.execute(
            "select dataset_uuid from datasets where experiment_id = ? and name = ? and digest = ?",
            (experiment_id, *content["dataset"]),
        ).fetchone()
        if dataset is None:
            return None
    run_id = uuid.uuid4().hex
    tags = content["tags"]
    db.execute(
        "insert into runs (run_uuid, name, source_type, source_name, entry_point_name, user_id, status, "
        "start_time, end_time, deleted_time, source_version, lifecycle_stage, artifact_uri, experiment_id) "
        "values (?, ?, 'UNKNOWN', '', '', 'unknown', 'FINISHED', ?, ?, NULL, '', 'active', ?, ?)",
        (run_id, tags[RUN_NAME_TAG], start, _now(), f"{location.rstrip('/')}/{run_id}/artifacts", experiment_id),
    )
    db.executemany("insert into tags (key, value, run_uuid) values (?, ?, ?)", [(*t, run_id) for t in tags.items()])
    params = [(*p, run_id) for p in content["params"].items()]
    db.executemany("insert into params (key, value, run_uuid) values (?, ?, ?)", params)
    metrics = content["metrics"]
    db.executemany(
        "insert into metrics (key, value, timestamp, run_uuid, step, is_nan) values (?, ?, ?, ?, ?, 0)",
        [(key, value, stamp, run_id, step) for key, value, stamp, step in metrics],
    )
    latest: dict[str, tuple[int, int, float]] = {}  # MLflow's rule: the greatest (step, timestamp, value)
    for key, value, stamp, step in metrics:
        latest[key] = max(latest.get(key, (step, stamp, value)), (step, stamp, value))
    db.executemany(
        "insert into latest_metrics (key, value, timestamp, step, is_nan, run_uuid) values (?, ?, ?, ?, 0, ?)",
        [(key, value, stamp, step, run_id) for key, (step, stamp, value) in latest.items()],
    )
    if dataset is not None:
        input_id = uuid.uuid4().hex
        db.execute(
            "insert into inputs (input_uuid, source_type, source_id, destination_type, destination_id, step) "
            "values (?, 'DATASET', ?, 'RUN', ?, 0)",
            (input_id, dataset[0], run_id),
        )
        db.execute("insert into input_tags (input_uuid, name, value) values (?, ?, ?)", (input_id, *DATASET_CONTEXT))
    return run_id
