"""MLflow tracking: one parent run per pipeline execution, one nested run per stage that ran.

How a stage finds its parent run, whichever entry point started it:

1. `LOCKSTEP_PARENT_RUN_ID` is set (the Prefect flow sets it for the stages it runs, and it is
   inherited by subprocesses such as torchrun ranks): use that run; its owner ends it.
2. Otherwise the stage runs under `dvc repro` / `dvc exp run` (or by hand): every stage process of
   one DVC invocation shares that DVC process as an ancestor, so the parent run is tagged with it
   (`lockstep.session`). The first stage creates it, later ones resume it, and each stage marks it
   finished when it is done, so it is never left "running".

Every run records its owner (tasks/tracking/owners.py `owner_tags`): the process that ends it, which
for a DVC session's parent run is the dvc process. A run whose owner was killed stays RUNNING; the
next pipeline execution marks it KILLED, with the reason (tasks/tracking/orphans.py
`mark_orphans_or_warn`, at the start of `pipeline_run` and of a stage that creates or resumes a
session's parent run).

MLflow is imported lazily: a GPU box with torch alone can still run the train stage with
`tracking.enabled: false`. In the project's own sqlite store a stage's runs are written without it
where that is safe (tasks/tracking/sqlite_record.py), else through its client (`_start`); the stage
logs to a `StageRun` either way (tasks/tracking/writers.py).

Everything logged goes through tasks/core/redact.py (no secret reaches params, tags or artifacts). Where
the runs go, and the check that the store takes them before a run starts, is tasks/tracking/store.py.
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tasks.core.config.params import NUMPY_STAGES, Params
from tasks.core.config.service import TrackingConfig
from tasks.core.layout import project_root
from tasks.core.redact import redact, redact_mapping
from tasks.tracking import registrar, sqlite_record
from tasks.tracking.dashboard import ensure_training_view, record_pipeline, start_pipeline
from tasks.tracking.lineage import SESSION_TAG, lineage_tags, pipeline_tags, redacted_context_tags, session_tags
from tasks.tracking.orphans import mark_orphans_or_warn
from tasks.tracking.owners import owner_tags, session_owner
from tasks.tracking.sqlite_store import SqliteStore
from tasks.tracking.store import TrackingUnavailable, check_store, default_uri, mlflow_module, tracking_uri
from tasks.tracking.writers import ClientWriter, RunWriter, StageRun

log = logging.getLogger(__name__)

PARENT_ENV = "LOCKSTEP_PARENT_RUN_ID"


def _experiment_id(mlflow: Any, name: str) -> str:
    experiment = mlflow.get_experiment_by_name(name)
    if experiment:
        ensure_training_view(mlflow.MlflowClient(), experiment)  # made by an older lockstep, or by hand
        return experiment.experiment_id
    # With the default sqlite store, keep artifacts beside it (absolute, project-rooted) rather
    # than in whatever directory the first stage happened to run from. A server decides itself.
    location = None
    # (Not "is MLFLOW_TRACKING_URI unset": mlflow.set_tracking_uri sets it, for subprocesses.)
    if tracking_uri() == default_uri():
        location = (project_root() / "mlartifacts").as_uri()
    # heavy: mlflow (~4 s), only when a run is logged; the no-op path never loads it
    from mlflow.exceptions import MlflowException

    try:
        created = mlflow.create_experiment(name, artifact_location=location)
    except MlflowException as exc:
        # Another process (a parallel DVC experiment, a sweep trial) created it since we looked.
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return mlflow.get_experiment_by_name(name).experiment_id
    ensure_training_view(mlflow.MlflowClient(), mlflow.get_experiment(created))
    return created


def _find_or_create_session_parent(mlflow: Any, experiment_id: str, entry_point: str, params: Params | None) -> str:
    client = mlflow.MlflowClient()
    mark_orphans_or_warn(client, [experiment_id], f"a {entry_point} stage")
    tags = session_tags(entry_point, session_owner())
    found = client.search_runs(
        [experiment_id], filter_string=f"tags.`{SESSION_TAG}` = '{tags[SESSION_TAG]}'", max_results=1
    )
    if found:
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        return run_id
    run = client.create_run(experiment_id, run_name=f"{entry_point} {time.strftime('%Y-%m-%d %H:%M:%S')}", tags=tags)
    if params is not None:
        start_pipeline(client, run.info.run_id, params)
    return run.info.run_id


@contextmanager
def pipeline_run(cfg: TrackingConfig, entry_point: str, params: Params | None = None) -> Iterator[str | None]:
    """The parent run of one pipeline execution, for an orchestrator (the Prefect flow).

    Stages started inside the block, in this process or in subprocesses, nest under it. With the
    pipeline's `params`, the run is the pipeline's dashboard row (tasks/tracking/dashboard.py): key params and
    dataset now, a name and the headline numbers at the end. (A sweep's run has trials, not stages.) In the
    project's own sqlite store it is written without MLflow's client where that is safe
    (tasks/tracking/sqlite_record.py): a flow run then loads MLflow only to log its models, if at all.
    """
    if not cfg.enabled:
        yield None
        return
    check_store(cfg)
    direct = sqlite_record.start_pipeline_run(tracking_uri(), cfg.experiment, entry_point, params)
    if direct is not None:
        run_id, end = direct.run_id, _ending_direct(direct, entry_point, params)
        _direct_runs[run_id] = direct.store
    else:
        run_id, end = _start_with_client(cfg, entry_point, params)
    previous = os.environ.get(PARENT_ENV)
    os.environ[PARENT_ENV] = run_id
    status = "FAILED"
    try:
        yield run_id
        status = "FINISHED"
    finally:
        _direct_runs.pop(run_id, None)
        end(status)
        if previous is None:
            os.environ.pop(PARENT_ENV, None)
        else:
            os.environ[PARENT_ENV] = previous


# The pipeline runs this process writes directly, open: `tag_run` writes theirs the same way.
_direct_runs: dict[str, SqliteStore] = {}


def _ending_direct(run: sqlite_record.DirectRun, entry_point: str, params: Params | None) -> Callable[[str], None]:
    """The end of a pipeline run written directly: its record (with `params`), its status, its store closed."""

    def end(status: str) -> None:
        try:
            if params is not None:
                _record_pipeline(
                    lambda: sqlite_record.record_pipeline(
                        run.store, run.run_id, entry_point, params, finished=status == "FINISHED"
                    ),
                    run.run_id,
                    status,
                )
            run.store.update_run(run.run_id, status, end=True)
        finally:
            run.store.close()

    return end


def _start_with_client(
    cfg: TrackingConfig, entry_point: str, params: Params | None
) -> tuple[str, Callable[[str], None]]:
    """The pipeline run made with MLflow's client (any store), after the orphan sweep: its id and its end."""
    mlflow = mlflow_module()
    client = mlflow.MlflowClient()
    experiment_id = _experiment_id(mlflow, cfg.experiment)
    mark_orphans_or_warn(client, [experiment_id], f"the {entry_point} pipeline run")
    run = client.create_run(
        experiment_id, run_name=f"{entry_point} {time.strftime('%Y-%m-%d %H:%M:%S')}", tags=pipeline_tags(entry_point)
    )
    run_id = run.info.run_id
    if params is not None:
        start_pipeline(client, run_id, params)

    def end(status: str) -> None:
        if params is not None:
            _record_pipeline(
                lambda: record_pipeline(client, run_id, entry_point, params, finished=status == "FINISHED"),
                run_id,
                status,
            )
        client.set_terminated(run_id, status)

    return run_id, end


def _record_pipeline(record: Callable[[], None], run_id: str, status: str) -> None:
    """The pipeline run's name and headline numbers (tasks/tracking/dashboard.py), by `record`. After a
    failure, a store that cannot take them is logged, not raised: the failure itself is what the caller
    must see."""
    try:
        record()
    except Exception as exc:
        if status == "FINISHED":
            raise
        log.warning("MLflow run %s: its summary was not recorded: %s", run_id, redact(" ".join(str(exc).split()))[:300])


def _store_failed(exc: BaseException) -> bool:
    """Whether MLflow's client gave up on a request to a tracking server (after its own retries), or the
    sqlite store written directly failed (locked past its timeout, its disk full)."""
    if isinstance(exc, sqlite3.Error):
        return True
    if "mlflow" not in sys.modules:  # its exceptions come from a loaded MLflow only; loading it costs ~2 s
        return False
    # heavy: mlflow (~4 s, with requests), only when a run is logged; the no-op path never loads it
    from mlflow.exceptions import MlflowException, RestException
    from requests.exceptions import RequestException

    if isinstance(exc, RestException | RequestException):
        return True
    return isinstance(exc, MlflowException) and "API request to" in str(exc)


def _records_lost(stage: str, exc: BaseException) -> str:
    """One line for a store that failed mid-stage (its database or artifact store down, say): which
    store, what it answered, and that the stage's outputs stay (DVC has not recorded the stage: the
    next run does it again)."""
    text = " ".join(str(exc).split())
    status = re.search(r"too many (\d{3}) error responses|error code (\d{3})", text)
    if status:
        code = status.group(1) or status.group(2)
        reason = f"it answered HTTP {code} (its log says why: its database or artifact store down?)"
    else:
        reason = "connection refused" if "refused" in text.lower() else text[:300]
    return (
        f"MLflow tracking store {redact(tracking_uri())} failed the {stage} stage's records: {reason}; "
        "the stage's outputs stay on disk, and the next run does the stage again"
    )


def tag_run(run_id: str, tags: dict[str, str]) -> None:
    """Add tags to a run that is not this process's active one (the flow's parent run), in one write."""
    if run_id in _direct_runs:  # written directly (pipeline_run)
        _direct_runs[run_id].log_batch(run_id, tags=redact_mapping(tags))
        return
    # heavy: mlflow (~4 s), only when a run is logged; the no-op path never loads it
    from mlflow.entities import RunTag

    client = mlflow_module().MlflowClient()
    client.log_batch(run_id, tags=[RunTag(key, value) for key, value in redact_mapping(tags).items()])


@contextmanager
def stage_run(
    stage: str,
    cfg: TrackingConfig,
    params: dict[str, Any],
    pipeline: Params | None = None,
    tags: dict[str, Any] | None = None,
) -> Iterator[StageRun]:
    """A nested MLflow run for one stage, with its params, lineage tags and `tags` already logged.

    Outside an orchestrator the stage makes or resumes its session's parent run, which becomes the
    pipeline's dashboard row when the stage is given the `pipeline`'s params (tasks/tracking/dashboard.py).
    The train stage's run records the machine's CPU, memory (and GPU) use: MLflow's system metrics.
    In the project's own sqlite store the runs are written without MLflow's client where that is safe
    (tasks/tracking/sqlite_record.py), ~3 s of CPU less per stage process.
    """
    if not cfg.enabled:
        yield StageRun()
        return
    parent_id = os.environ.get(PARENT_ENV)
    owns_parent = parent_id is None
    if owns_parent:  # under the flow, the flow has checked the store already
        check_store(cfg)
    entry_point = "dvc" if os.environ.get("DVC_STAGE") else "cli"
    status = "FAILED"
    try:
        writer, run_id, end = _start(stage, cfg, parent_id, entry_point, pipeline)
        try:
            run = StageRun(writer, run_id)
            if stage == "train":
                run.sample_system()
            torch = stage not in NUMPY_STAGES
            run.record(params, {"lockstep.stage": stage, "device": "cpu", **lineage_tags(torch=torch), **(tags or {})})
            try:
                yield run
            finally:  # a failed stage's curve up to the failure is what its user needs to see
                run.close()
            status = "FINISHED"
        finally:
            _end_runs(end(status), status)
    except TrackingUnavailable:
        raise
    except Exception as exc:
        if _store_failed(exc):
            raise TrackingUnavailable(_records_lost(stage, exc)) from exc
        raise


Ending = Callable[[str], list[Callable[[], Any]]]  # a run's status -> the writes that end its runs


def _start(
    stage: str, cfg: TrackingConfig, parent_id: str | None, entry_point: str, pipeline: Params | None
) -> tuple[RunWriter, str, Ending]:
    """The stage's run, started directly in the sqlite store where that is safe, else with MLflow's
    client: where its records go, its id, and the writes that end it (and the parent run it owns)."""
    owner = redact_mapping(owner_tags())
    direct = sqlite_record.start_stage_run(
        tracking_uri(), cfg.experiment, stage, parent_id, (entry_point, owner), pipeline, registrar.helped()
    )
    if direct is not None:
        return (
            direct.store,
            direct.run_id,
            lambda status: [lambda: sqlite_record.end_stage_run(direct, status, entry_point, pipeline)],
        )
    mlflow = mlflow_module()
    experiment_id = _experiment_id(mlflow, cfg.experiment)
    owned = None
    if parent_id is None:
        parent_id = owned = _find_or_create_session_parent(mlflow, experiment_id, entry_point, pipeline)
    active = mlflow.start_run(  # the active run: export's model flavours log into it (tasks/tracking/registry.py)
        run_name=stage,
        experiment_id=experiment_id,
        parent_run_id=parent_id,
        tags={**redacted_context_tags(), **owner},
        log_system_metrics=False,  # the train run samples them itself (tasks/tracking/system.py)
    )

    def end(status: str) -> list[Callable[[], Any]]:
        steps: list[Callable[[], Any]] = [lambda: mlflow.end_run(status)]
        if owned is not None:
            client = mlflow.MlflowClient()
            if pipeline is not None:
                finished = status == "FINISHED"
                steps.append(
                    lambda: _record_pipeline(
                        lambda: record_pipeline(client, owned, entry_point, pipeline, finished), owned, status
                    )
                )
            steps.append(lambda: client.set_terminated(owned, status))
        return steps

    return ClientWriter(mlflow), active.info.run_id, end


def _end_runs(steps: list[Callable[[], Any]], status: str) -> None:
    """End the stage's run, and the parent run it owns, as `status`.

    After a failure (status FAILED, its exception on its way up) a store that fails here too is
    logged, not raised: the first failure is the one that says what went wrong (an artifact store
    down, say), and MLflow's own cleanup request would otherwise replace it with a traceback.
    """
    failed: list[Exception] = []
    for step in steps:
        try:
            step()
        except Exception as exc:
            if not _store_failed(exc):
                raise
            failed.append(exc)
    if failed and status == "FINISHED":
        raise failed[0]
    if failed:
        reason = redact(" ".join(str(failed[0]).split()))[:300]
        log.warning("MLflow could not record the runs as %s either: %s", status, reason)
