"""Runs written into the project's own sqlite MLflow store without MLflow's client (tasks/tracking/
sqlite_store.py says why, and which rows): a stage's run, nested in the flow's pipeline run or in its
DVC session's (found, resumed or made here), that session run's record when the stage ends, the flow's
pipeline run, and the finished pipeline run of a flow that found nothing stale (flows/noop.py).

The content comes from the functions MLflow's path uses (tasks/tracking/lineage.py's tags,
dashboard.py's `pipeline_record` and `shown_params`); tests/tracking/test_sqlite_record.py compares the
runs written both ways as MLflow's client reads them back.

Each function writes only where it can be sure, and otherwise returns None having written nothing, and
the caller uses MLflow's client (tasks/tracking/runs.py): where `SqliteStore.open` refuses (not a local
sqlite store, another schema revision, no experiment or training view yet), where MLflow's own context
providers may add tags (`context_tags`), for a run that owns its pipeline run while another run of the
experiment is RUNNING (the orphan sweep judges it: tasks/tracking/orphans.py), for a stage that logs
models in its own process (export, unless the flow's helper logs them: tasks/tracking/registrar.py), and
for a no-op run whose dataset MLflow has not recorded.
"""

from __future__ import annotations

import logging
import time
from contextlib import closing
from dataclasses import dataclass

from tasks.core.config.params import Params
from tasks.core.hashing import data_md5
from tasks.core.redact import redact_mapping
from tasks.tracking.dashboard import dataset_name, log_dataset, pipeline_record, shown_params
from tasks.tracking.lineage import context_tags, pipeline_tags, session_tags
from tasks.tracking.owners import session_owner
from tasks.tracking.sqlite_store import PARENT_TAG, SqliteStore
from tasks.tracking.store import mlflow_module

log = logging.getLogger(__name__)

CLIENT_STAGES = frozenset({"export"})  # stages that log models: MLflow's flavours write through its client


@dataclass
class DirectRun:
    """A stage's run being written directly: its store, id, and the session's pipeline run it owns (if any)."""

    store: SqliteStore
    run_id: str
    owned_parent: str | None


def start_stage_run(
    uri: str,
    experiment: str,
    stage: str,
    parent_id: str | None,
    started_by: tuple[str, dict[str, str]],
    pipeline: Params | None,
    models_elsewhere: bool = False,
) -> DirectRun | None:
    """A RUNNING run for `stage` with MLflow's context tags and `started_by`'s (entry point, tags),
    nested in `parent_id` or (None) in its DVC session's pipeline run, found and resumed or made here, as
    tasks/tracking/runs.py `stage_run` makes them with MLflow's client; None if this is not a run this
    module may write (nothing was written). `models_elsewhere`: another process logs the models of a
    stage that logs models (tasks/tracking/registrar.py)."""
    entry_point, tags = started_by
    if stage in CLIENT_STAGES and not models_elsewhere:
        return None
    context = context_tags()
    store = SqliteStore.open(uri, experiment) if context is not None else None
    if store is None or context is None:
        return None
    run_id = owned = None
    try:
        with store.transaction():
            if parent_id is None and not store.running():
                parent_id = owned = _session_parent(store, entry_point, pipeline)
            if parent_id is not None:
                run_id = store.create_run(stage, {**context, **tags, PARENT_TAG: parent_id})
    finally:
        if run_id is None:
            store.close()
    return DirectRun(store, run_id, owned) if run_id is not None else None


def _session_parent(store: SqliteStore, entry_point: str, pipeline: Params | None) -> str:
    owner = session_owner()
    tags = session_tags(entry_point, owner)
    session = tags["lockstep.session"]
    found = store.find_run("lockstep.session", session)
    if found:
        store.update_run(found, status="RUNNING")
        return found
    run_id = store.create_run(f"{entry_point} {time.strftime('%Y-%m-%d %H:%M:%S')}", tags)
    if pipeline is not None:
        store.log_batch(run_id, params=shown_params(pipeline))
    return run_id


def start_pipeline_run(uri: str, experiment: str, entry_point: str, params: Params | None) -> DirectRun | None:
    """A RUNNING pipeline run for `entry_point` with the pipeline's key params (`params`), as tasks/tracking/
    runs.py `pipeline_run` makes it with MLflow's client; None (nothing written) where this module may not
    write it: the store `SqliteStore.open` refuses, another RUNNING run of the experiment (the orphan sweep
    judges it: MLflow's path), a tag or param over MLflow's limits (MLflow's client says which)."""
    store = SqliteStore.open(uri, experiment)
    if store is None:
        return None
    run_id = None
    try:
        with store.transaction():
            if not store.running():
                run_id = store.create_run(
                    f"{entry_point} {time.strftime('%Y-%m-%d %H:%M:%S')}", pipeline_tags(entry_point)
                )
                if params is not None:
                    store.log_batch(run_id, params=shown_params(params))
    except ValueError as exc:  # rolled back: nothing written
        log.info("the pipeline run is left to MLflow's client: %s", exc)
        run_id = None
    finally:
        if run_id is None:
            store.close()
    return DirectRun(store, run_id, None) if run_id is not None else None


def end_stage_run(run: DirectRun, status: str, entry_point: str, pipeline: Params | None) -> None:
    """End the stage's run as `status`, and the session's pipeline run it owns, with that run's record."""
    try:
        run.store.update_run(run.run_id, status, end=True)
        if run.owned_parent is not None:
            if pipeline is not None:
                record_pipeline(run.store, run.owned_parent, entry_point, pipeline, finished=status == "FINISHED")
            run.store.update_run(run.owned_parent, status, end=True)
    finally:
        run.store.close()


def record_pipeline(store: SqliteStore, run_id: str, entry_point: str, params: Params, finished: bool) -> None:
    """dashboard.py `record_pipeline`, written directly: the pipeline run's name, and once it finished
    its headline numbers, tags, recipe params and training data."""
    by_stage = {tags.get("lockstep.stage"): tags for tags in store.children(run_id)}
    record = pipeline_record(entry_point, by_stage, (store.metrics(run_id), store.params(run_id)), finished)
    store.update_run(run_id, name=record.name)
    if finished:
        store.log_batch(run_id, params=record.params, tags=record.tags, metrics=record.metrics)
        link_dataset(store, run_id, params)


def link_dataset(store: SqliteStore, run_id: str, params: Params) -> None:
    """dashboard.py `log_dataset`: the data as the run's training input; through MLflow's client where
    this store has not recorded it yet (MLflow builds its source and schema: once per data version)."""
    md5 = data_md5()
    if md5 != "none" and not store.link_dataset(run_id, dataset_name(params), md5.removesuffix(".dir")):
        log_dataset(mlflow_module().MlflowClient(), run_id, params)


def record_pipeline_run(uri: str, params: Params, entry_point: str, extra_tags: dict[str, str]) -> str | None:
    """A finished pipeline run in which no stage ran, as `pipeline_run` + `tag_run` leave it, in one
    transaction; its run id, or None if this store is not one this module may write (nothing written)."""
    store = SqliteStore.open(uri, params.tracking.experiment)
    if store is None:
        return None
    md5 = data_md5()
    dataset = (dataset_name(params), md5.removesuffix(".dir")) if md5 != "none" else None
    record = pipeline_record(entry_point, {}, ({}, {}), finished=True)
    tags = {**pipeline_tags(entry_point), **redact_mapping(extra_tags), **record.tags}
    with closing(store):
        try:
            with store.transaction():
                if store.running() or (dataset is not None and store.dataset(*dataset) is None):
                    return None
                run_id = store.create_run(record.name, tags)
                store.log_batch(run_id, params=shown_params(params) | record.params, metrics=record.metrics)
                if dataset is not None:
                    store.link_dataset(run_id, *dataset)
                store.update_run(run_id, "FINISHED", end=True)
        except ValueError as exc:  # over MLflow's limits: rolled back, and MLflow's client says what
            log.info("the no-op run is left to MLflow's client: %s", exc)
            return None
    return run_id


def experiment_id(uri: str, name: str) -> str | None:
    """The id of the experiment `name` in the sqlite store at `uri`, read without MLflow's client;
    None if this module does not know the store (its kind, schema, or the experiment's view)."""
    store = SqliteStore.open(uri, name)
    if store is None:
        return None
    with closing(store):
        return store.experiment_id
