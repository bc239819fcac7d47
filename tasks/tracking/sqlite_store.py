"""The project's own sqlite MLflow store, written with the standard library's sqlite3.

Why not MLflow's client: a stage process spends ~3 s of CPU on it before its first record on 2 cores
(`import mlflow` ~2 s: pandas, FastAPI, its GenAI modules; its SqlAlchemyStore ~1 s: SQLAlchemy,
Alembic, ~70 ORM mappings), as much as stats, preprocess or evaluate themselves, against a few
milliseconds for the rows (benchmarks/results/tracking-per-stage.json). `dvc repro` pays it in every
stage. So the few record shapes lockstep's runs make are written here as MLflow 3.17's SqlAlchemyStore
writes them: `create_run`, `log_batch` (params never change, tags are replaced, metrics deduplicated,
NaN and infinity stored its way, the latest-metric rule), `update_run_info`, `log_inputs` of a
recorded dataset, and a run's artifacts copied where its LocalArtifactRepository puts them.
tests/tracking/test_sqlite_store.py compares runs written both ways as MLflow's client reads them.

`open` answers None wherever it cannot be sure, and the caller then uses MLflow's client: a store that
is not a local sqlite file, another schema revision (an MLflow upgrade: a test fails until this module
is checked against it), an experiment that does not exist yet or lacks its training view (MLflow's
path makes them), artifacts that are not on a local path.
"""

from __future__ import annotations

import math
import os
import posixpath
import re
import shutil
import sqlite3
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tasks.tracking.dashboard import EXPERIMENT_KIND_TAG, VIEW_TAG, _view_state

# alembic_version of MLflow 3.17.2's sqlite store (`mlflow.store.db.utils._get_latest_schema_revision()`)
SCHEMA_REVISION = "dc11669786a5"
MAX_KEY, MAX_PARAM, MAX_TAG = 250, 6000, 8000  # MLflow's validation limits (mlflow/utils/validation.py)
_NAME = re.compile(r"[/\w.\- :]*")  # MLflow's characters for a param, metric or tag key (not on Windows)
RUN_NAME_TAG = "mlflow.runName"
PARENT_TAG = "mlflow.parentRunId"
DATASET_CONTEXT = ("mlflow.data.context", "training")  # the input tag log_dataset gives the data
LIMIT_S = 30.0  # how long a write waits for another process's transaction (MLflow's client: sqlite's 5 s)

Metric = tuple[str, float, int, int]  # key, value, timestamp (ms), step: as MLflow's Metric entity


class SqliteStore:
    """One experiment of a local sqlite MLflow store; each method is one transaction."""

    def __init__(self, db: sqlite3.Connection, experiment_id: str, location: str) -> None:
        self._db = db
        self.experiment_id = experiment_id
        self._location = location.rstrip("/")  # the experiment's artifact location, on this machine's disk
        self._depth = 0  # transactions open: the methods called inside `transaction` join it
        # one thread at a time on the connection: the train run's system metrics thread writes too
        self._lock = threading.RLock()

    @classmethod
    def open(cls, uri: str, experiment: str) -> SqliteStore | None:
        """The store at tracking URI `uri`, for `experiment`; None where this module may not write."""
        path = database(uri)
        if path is None:
            return None
        db = sqlite3.connect(path, timeout=LIMIT_S, isolation_level=None, check_same_thread=False)
        try:
            found = _experiment(db, experiment)
        except BaseException:
            db.close()
            raise
        if found is None or _local_path(found[1]) is None:
            db.close()
            return None
        return cls(db, str(found[0]), found[1])

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One transaction for the calls made inside (nested: the outer one's); rolled back if one raises."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield self._db
                finally:
                    self._depth -= 1
                return
            self._db.execute("BEGIN IMMEDIATE")  # a writer's lock from the start: what is read stays true
            self._depth = 1
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            else:
                self._db.execute("COMMIT")
            finally:
                self._depth = 0

    # ----------------------------------------------------------------------- reading

    def _query(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def running(self) -> bool:
        """Whether any of the experiment's runs is RUNNING (the orphan sweep's business: MLflow's path)."""
        query = "select 1 from runs where experiment_id = ? and status = 'RUNNING' and lifecycle_stage = 'active'"
        return bool(self._query(query, (self.experiment_id,)))

    def find_run(self, key: str, value: str) -> str | None:
        """The newest active run of the experiment tagged `key` = `value` (as MLflow's search_runs orders)."""
        found = self._query(
            "select runs.run_uuid from runs join tags on tags.run_uuid = runs.run_uuid "
            "where runs.experiment_id = ? and runs.lifecycle_stage = 'active' and tags.key = ? and tags.value = ? "
            "order by runs.start_time desc, runs.run_uuid limit 1",
            (self.experiment_id, key, value),
        )
        return found[0][0] if found else None

    def tags(self, run_id: str) -> dict[str, str]:
        return dict(self._query("select key, value from tags where run_uuid = ?", (run_id,)))

    def params(self, run_id: str) -> dict[str, str]:
        return dict(self._query("select key, value from params where run_uuid = ?", (run_id,)))

    def metrics(self, run_id: str) -> dict[str, float]:
        """The run's latest value of each metric, as `run.data.metrics` has them."""
        rows = self._query("select key, value, is_nan from latest_metrics where run_uuid = ?", (run_id,))
        return {key: math.nan if is_nan else value for key, value, is_nan in rows}

    def dataset(self, name: str, digest: str) -> str | None:
        """The id of the experiment's recorded dataset `name` with `digest`, if MLflow recorded it."""
        found = self._query(
            "select dataset_uuid from datasets where experiment_id = ? and name = ? and digest = ?",
            (self.experiment_id, name, digest),
        )
        return found[0][0] if found else None

    def children(self, run_id: str) -> list[dict[str, str]]:
        """The tags of the active runs nested in `run_id`."""
        rows = self._query(
            "select runs.run_uuid from runs join tags on tags.run_uuid = runs.run_uuid "
            "where runs.lifecycle_stage = 'active' and tags.key = ? and tags.value = ?",
            (PARENT_TAG, run_id),
        )
        return [self.tags(child) for (child,) in rows]

    # ----------------------------------------------------------------------- writing

    def create_run(self, name: str, tags: Mapping[str, str]) -> str:
        """A RUNNING run named `name` with `tags` (`mlflow.runName` added), as `MlflowClient.create_run`
        (whose user is the `mlflow.user` tag that `start_run` gives)."""
        tags = {**tags, RUN_NAME_TAG: name}
        user = tags.get("mlflow.user", "unknown")
        _check(tags=tags)
        run_id = uuid.uuid4().hex
        with self.transaction() as db:
            db.execute(
                "insert into runs (run_uuid, name, source_type, source_name, entry_point_name, user_id, status, "
                "start_time, end_time, deleted_time, source_version, lifecycle_stage, artifact_uri, experiment_id) "
                "values (?, ?, 'UNKNOWN', '', '', ?, 'RUNNING', ?, NULL, NULL, '', 'active', ?, ?)",
                (run_id, name, user, now(), f"{self._location}/{run_id}/artifacts", self.experiment_id),
            )
            db.executemany("insert into tags (key, value, run_uuid) values (?, ?, ?)", _rows(tags, run_id))
        return run_id

    def update_run(self, run_id: str, status: str | None = None, name: str | None = None, end: bool = False) -> None:
        """`update_run_info`: a new status, its end time now (`end`: `set_terminated`), a new name."""
        with self.transaction() as db:
            if status is not None:
                db.execute("update runs set status = ? where run_uuid = ?", (status, run_id))
            if end:
                db.execute("update runs set end_time = ? where run_uuid = ?", (now(), run_id))
            if name:
                db.execute("update runs set name = ? where run_uuid = ?", (name, run_id))
                _set_tags(db, run_id, {RUN_NAME_TAG: name})

    def log_batch(
        self,
        run_id: str,
        params: Mapping[str, str] | None = None,
        tags: Mapping[str, str] | None = None,
        metrics: Iterable[Metric] = (),
    ) -> None:
        """`MlflowClient.log_batch`: a param is never changed (ValueError), a tag is replaced, a metric
        point logged twice is kept once, and each metric's latest point is the greatest (step, time, value)."""
        params, tags, metrics = dict(params or {}), dict(tags or {}), list(dict.fromkeys(metrics))
        _check(params, tags, metrics)
        with self.transaction() as db:
            logged = dict(db.execute("select key, value from params where run_uuid = ?", (run_id,)))
            changed = {key: (logged[key], value) for key, value in params.items() if logged.get(key, value) != value}
            if changed:
                raise ValueError(f"MLflow run {run_id}: a logged param never changes: {changed} (old, new)")
            new = {key: value for key, value in params.items() if key not in logged}
            db.executemany("insert into params (key, value, run_uuid) values (?, ?, ?)", _rows(new, run_id))
            if RUN_NAME_TAG in tags:
                db.execute("update runs set name = ? where run_uuid = ?", (tags[RUN_NAME_TAG], run_id))
            _set_tags(db, run_id, tags)
            _log_metrics(db, run_id, metrics)

    def link_dataset(self, run_id: str, name: str, digest: str) -> bool:
        """Give `run_id` the experiment's recorded dataset `name`/`digest` as its training input; False
        (nothing written) if it was never recorded: MLflow's `log_inputs` builds its source and schema."""
        with self.transaction() as db:
            dataset = self.dataset(name, digest)
            if dataset is None:
                return False
            linked = db.execute(
                "select 1 from inputs where source_type = 'DATASET' and source_id = ? and destination_id = ?",
                (dataset, run_id),
            ).fetchone()
            if linked is None:  # (MLflow's log_inputs links a dataset to a run once)
                input_id = uuid.uuid4().hex
                db.execute(
                    "insert into inputs (input_uuid, source_type, source_id, destination_type, destination_id, step) "
                    "values (?, 'DATASET', ?, 'RUN', ?, 0)",
                    (input_id, dataset, run_id),
                )
                db.execute(
                    "insert into input_tags (input_uuid, name, value) values (?, ?, ?)", (input_id, *DATASET_CONTEXT)
                )
        return True

    def log_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        """Copy `path` into the run's artifacts (under `artifact_path`), through a temporary file, as
        MLflow's LocalArtifactRepository does."""
        if artifact_path and (posixpath.isabs(artifact_path) or ".." in artifact_path.split("/")):
            raise ValueError(f"artifact path {artifact_path!r} must stay inside the run's artifacts")
        root = _local_path(f"{self._location}/{run_id}/artifacts")
        if root is None:  # (`open` takes only a store whose artifacts are on a local path)
            raise ValueError(f"MLflow run {run_id}: its artifact location {self._location} is not a local path")
        folder = root / artifact_path if artifact_path else root
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as out, path.open("rb") as source:
                shutil.copyfileobj(source, out)
            shutil.copystat(path, tmp)
            os.replace(tmp, folder / path.name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def database(uri: str) -> Path | None:
    """The sqlite file behind a `sqlite:///` tracking URI, if it exists; None for any other store."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme != "sqlite" or parsed.netloc or parsed.query:
        return None
    path = Path(parsed.path[1:])  # sqlite:///<path>, absolute (sqlite:////...) or not, as store.py reads it
    return path if path.is_file() else None


def now() -> int:
    """MLflow's timestamps: milliseconds since the epoch."""
    return int(time.time() * 1000)


def _experiment(db: sqlite3.Connection, name: str) -> tuple[Any, str] | None:
    """(id, artifact location) of the active experiment `name`, if the schema is the one known here and
    the experiment carries the training view that MLflow's path gives it (`ensure_training_view`)."""
    if db.execute("select version_num from alembic_version").fetchall() != [(SCHEMA_REVISION,)]:
        return None
    found = db.execute(
        "select experiment_id, artifact_location from experiments "
        "where name = ? and lifecycle_stage = 'active' and workspace = 'default'",
        (name,),
    ).fetchone()
    if found is None:
        return None
    tags = dict(db.execute("select key, value from experiment_tags where experiment_id = ?", found[:1]))
    if EXPERIMENT_KIND_TAG not in tags or tags.get(VIEW_TAG) != _view_state():
        return None
    return found


def _local_path(location: str) -> Path | None:
    """The folder behind an artifact location on this machine's disk (a file: URI or an absolute path,
    as MLflow makes it for a store without an artifact root); None for any other (s3:, a server's)."""
    parsed = urllib.parse.urlparse(location)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost"):
        return Path(urllib.parse.unquote(parsed.path))
    return Path(location) if not parsed.scheme and Path(location).is_absolute() else None


def _rows(values: Mapping[str, str], run_id: str) -> list[tuple[str, str, str]]:
    return [(key, value, run_id) for key, value in values.items()]


def _check(params: Mapping[str, str] = {}, tags: Mapping[str, str] = {}, metrics: Iterable[Metric] = ()) -> None:  # noqa: B006 - read only
    """MLflow's validation of what is logged: key characters and lengths, value lengths."""
    for kind, values, limit in (("param", params, MAX_PARAM), ("tag", tags, MAX_TAG)):
        for key, value in values.items():
            _check_key(kind, key)
            if not isinstance(value, str) or len(value) > limit:
                raise ValueError(f"MLflow {kind} {key!r}: expected a string of at most {limit} characters")
    for key, value, _stamp, _step in metrics:
        _check_key("metric", key)
        if not isinstance(value, int | float):
            raise ValueError(f"MLflow metric {key!r}: expected a number, got {value!r}")


def _check_key(kind: str, key: str) -> None:
    tag = kind == "tag"  # a tag key may hold any character; params and metrics are names in a path
    if not key or len(key) > MAX_KEY or not (tag or (_NAME.fullmatch(key) and posixpath.normpath(key) == key)):
        raise ValueError(
            f"MLflow {kind} key {key!r}: expected 1-{MAX_KEY} characters"
            + ("" if tag else " of letters, digits, _ - . / : and spaces, naming no other path")
        )


def _set_tags(db: sqlite3.Connection, run_id: str, tags: Mapping[str, str]) -> None:
    db.executemany(
        "insert into tags (key, value, run_uuid) values (?, ?, ?) "
        "on conflict (key, run_uuid) do update set value = excluded.value",
        _rows(tags, run_id),
    )


def _stored(value: float) -> tuple[float, int]:
    """(value, is_nan) as MLflow's SqlAlchemyStore stores a metric (sanitize_metric_value)."""
    if math.isnan(value):
        return 0.0, 1
    if math.isinf(value):
        return math.copysign(1.7976931348623157e308, value), 0
    return float(value), 0


def _log_metrics(db: sqlite3.Connection, run_id: str, metrics: list[Metric]) -> None:
    rows = [(key, *_stored(value), stamp, step) for key, value, stamp, step in metrics]
    db.executemany(
        "insert or ignore into metrics (key, value, is_nan, timestamp, step, run_uuid) values (?, ?, ?, ?, ?, ?)",
        [(*row, run_id) for row in rows],
    )
    latest: dict[str, tuple[int, int, float, int]] = {}  # MLflow's rule: the greatest (step, timestamp, value)
    for key, value, is_nan, stamp, step in rows:
        latest[key] = max(latest.get(key, (step, stamp, value, is_nan)), (step, stamp, value, is_nan))
    for key, point in latest.items():
        old = db.execute(
            "select step, timestamp, value, is_nan from latest_metrics where run_uuid = ? and key = ?", (run_id, key)
        ).fetchone()
        if old is None or point[:3] > tuple(old[:3]):
            db.execute(
                "insert or replace into latest_metrics (key, value, timestamp, step, is_nan, run_uuid) "
                "values (?, ?, ?, ?, ?, ?)",
                (key, point[2], point[1], point[0], point[3], run_id),
            )
