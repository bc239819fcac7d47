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
`tracking.enabled: false`.

Everything logged goes through tasks/core/redact.py (no secret reaches params, tags or artifacts). Where
the runs go, and the check that the store takes them before a run starts, is tasks/tracking/store.py.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tasks.core.config.params import NUMPY_STAGES, Params
from tasks.core.config.service import TrackingConfig
from tasks.core.layout import project_root
from tasks.core.redact import redact, redact_mapping
from tasks.tracking.dashboard import ensure_training_view, record_pipeline, start_pipeline
from tasks.tracking.lineage import lineage_tags, redacted_context_tags
from tasks.tracking.orphans import mark_orphans_or_warn
from tasks.tracking.owners import owner_tags, session_key, session_owner
from tasks.tracking.store import TrackingUnavailable, check_store, default_uri, mlflow_module, tracking_uri
from tasks.tracking.system import SystemMetrics

log = logging.getLogger(__name__)

PARENT_ENV = "LOCKSTEP_PARENT_RUN_ID"
SESSION_TAG = "lockstep.session"
METRICS_WRITE_EVERY_S = 1.0  # how stale a stage's metrics in the store may get (StageRun.log_metrics)


# --------------------------------------------------------------------------- stage runs


class StageRun:
    """What a stage logs to. With tracking disabled every method does nothing (by request)."""

    def __init__(self, mlflow_module: Any | None = None, run_id: str | None = None) -> None:
        self._mlflow = mlflow_module
        self.run_id = run_id
        self._pending: list[Any] = []  # mlflow Metric entities not yet written
        self._written_at = float("-inf")  # time.monotonic() of the last write
        self._system: SystemMetrics | None = None  # the machine's load, sampled while the run trains
        self._writing = threading.Lock()  # the system metrics' thread writes too, when the run is silent

    def sample_system(self) -> None:
        """Record the machine's load (MLflow's system metrics) until the run ends (tasks/tracking/system.py)."""
        if self._mlflow and self._system is None:
            self._system = SystemMetrics(self.run_id, self.flush, lambda: self._written_at)

    @property
    def enabled(self) -> bool:
        return self._mlflow is not None

    def log_params(self, params: dict[str, Any]) -> None:
        self.record(params=params)

    def record(self, params: dict[str, Any] | None = None, tags: dict[str, Any] | None = None) -> None:
        """Params and tags in one write: each write to the sqlite store costs ~9 ms of MLflow's own work
        (the train stage's tags and params took six writes, now two: benchmarks/results/b4-tracking.json)."""
        if not self._mlflow:
            return
        # heavy: mlflow (~4 s), only when a run is logged; the no-op path never loads it
        from mlflow.entities import Param, RunTag

        new_params = [Param(key, str(value)) for key, value in redact_mapping(params or {}).items()]
        new_tags = [RunTag(key, str(value)) for key, value in redact_mapping(tags or {}).items()]
        if new_params or new_tags:  # (MLflow splits a batch over its limits itself)
            self._mlflow.MlflowClient().log_batch(self.run_id, params=new_params, tags=new_tags)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Metrics stamped now, written at most every METRICS_WRITE_EVERY_S (and by `flush`).

        One write to the sqlite store takes ~11 ms: once per epoch it cost 6% of training digits
        (B4 in benchmarks/). Batched by time instead, a short epoch's curve reaches the UI a second
        late and a long one's at once. (MLflow's own `synchronous=False` queue was slower still:
        its logging thread competes with training for the 2 cores, 1.25x.)
        """
        if not self._mlflow:
            return
        # heavy: mlflow (~4 s), only when a run is logged; the no-op path never loads it
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        with self._writing:
            self._pending += [Metric(key, float(value), stamp, step or 0) for key, value in metrics.items()]
        if time.monotonic() - self._written_at >= METRICS_WRITE_EVERY_S:
            self.flush()

    def log_history(self, rows: Iterable[dict[str, float]], prefix: str = "") -> None:
        """Per-epoch rows (each with its `epoch`) as metric series stepped by epoch: the one way a
        curve is logged (training, its resumed part, DDP's history.json, fine-tuning in compress)."""
        for row in rows:
            self.log_metrics({f"{prefix}{k}": v for k, v in row.items() if k != "epoch"}, step=int(row["epoch"]))

    def flush(self) -> None:
        """Write the metrics logged (and the system metrics sampled) so far; raises if MLflow cannot,
        keeping them for the next write."""
        with self._writing:
            if self._mlflow and self._system is not None:
                # heavy: mlflow (~4 s), loaded by now (the run is open); at the top every stage would load it
                from mlflow.entities import Metric

                self._pending += [Metric(*point) for point in self._system.take()]
            if self._mlflow and self._pending:
                client = self._mlflow.MlflowClient()
                while self._pending:  # MLflow's limit per batch: 1000 metrics
                    client.log_batch(self.run_id, metrics=self._pending[:1000])
                    del self._pending[:1000]
            self._written_at = time.monotonic()

    def close(self) -> None:
        """Stop sampling the machine and write what is left; raises if MLflow cannot."""
        if self._system is not None:
            self._system.stop()
        self.flush()

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.record(tags=tags)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Log a file; a text file that holds a secret (a resolved params.yaml, dvc.lock) is logged as a
        copy with the secret masked, under the same name."""
        if not self._mlflow:
            return
        path = Path(path)
        text = _text_of(path)
        if text is None or redact(text) == text:
            self._mlflow.log_artifact(str(path), artifact_path=artifact_path)
            return
        with tempfile.TemporaryDirectory(prefix="lockstep-redacted-") as tmp:
            copy = Path(tmp) / path.name
            copy.write_text(redact(text))
            shutil.copymode(path, copy)
            self._mlflow.log_artifact(str(copy), artifact_path=artifact_path)

    @property
    def mlflow(self) -> Any:
        """The mlflow module, for flavour-specific calls (log_model); only when enabled."""
        if self._mlflow is None:
            raise RuntimeError("tracking is disabled (tracking.enabled: false)")
        return self._mlflow


def _text_of(path: Path, limit: int = 16 * 2**20) -> str | None:
    """The file's text if it is a modest UTF-8 text file (what could carry a secret), else None."""
    if path.stat().st_size > limit:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


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
    owner = session_owner()
    key = session_key(owner)
    found = client.search_runs([experiment_id], filter_string=f"tags.`{SESSION_TAG}` = '{key}'", max_results=1)
    if found:
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        return run_id
    run = client.create_run(
        experiment_id,
        run_name=f"{entry_point} {time.strftime('%Y-%m-%d %H:%M:%S')}",
        tags=redact_mapping(
            {SESSION_TAG: key, "lockstep.entry_point": entry_point, **lineage_tags(), **owner_tags(owner[1])}
        ),
    )
    if params is not None:
        start_pipeline(client, run.info.run_id, params)
    return run.info.run_id


@contextmanager
def pipeline_run(cfg: TrackingConfig, entry_point: str, params: Params | None = None) -> Iterator[str | None]:
    """The parent run of one pipeline execution, for an orchestrator (the Prefect flow).

    Stages started inside the block, in this process or in subprocesses, nest under it. With the
    pipeline's `params`, the run is the pipeline's dashboard row (tasks/tracking/dashboard.py): key params and
    dataset now, a name and the headline numbers at the end. (A sweep's run has trials, not stages.)
    """
    if not cfg.enabled:
        yield None
        return
    check_store(cfg)
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
    previous = os.environ.get(PARENT_ENV)
    os.environ[PARENT_ENV] = run_id
    status = "FAILED"
    try:
        yield run_id
        status = "FINISHED"
    finally:
        if params is not None:
            _record_pipeline(client, run_id, entry_point, params, status)
        client.set_terminated(run_id, status)
        if previous is None:
            os.environ.pop(PARENT_ENV, None)
        else:
            os.environ[PARENT_ENV] = previous


def pipeline_tags(entry_point: str) -> dict[str, str]:
    """What a pipeline run is tagged with when it starts: its entry point, lineage and owner (this process)."""
    return redact_mapping({"lockstep.entry_point": entry_point, **lineage_tags(), **owner_tags()})


def _record_pipeline(client: Any, run_id: str, entry_point: str, params: Params, status: str) -> None:
    """The pipeline run's name and headline numbers (tasks/tracking/dashboard.py). After a failure, a store
    that cannot take them is logged, not raised: the failure itself is what the caller must see."""
    try:
        record_pipeline(client, run_id, entry_point, params, finished=status == "FINISHED")
    except Exception as exc:
        if status == "FINISHED":
            raise
        log.warning("MLflow run %s: its summary was not recorded: %s", run_id, redact(" ".join(str(exc).split()))[:300])


def _store_failed(exc: BaseException) -> bool:
    """Whether MLflow's client gave up on a request to a tracking server (after its own retries)."""
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
    """
    if not cfg.enabled:
        yield StageRun()
        return
    parent_id = os.environ.get(PARENT_ENV)
    owns_parent = parent_id is None
    if owns_parent:  # under the flow, the flow has checked the store already
        check_store(cfg)
    mlflow = mlflow_module()
    experiment_id = _experiment_id(mlflow, cfg.experiment)
    entry_point = "dvc" if os.environ.get("DVC_STAGE") else "cli"
    if owns_parent:
        parent_id = _find_or_create_session_parent(mlflow, experiment_id, entry_point, pipeline)
    status = "FAILED"
    try:
        active = mlflow.start_run(
            run_name=stage,
            experiment_id=experiment_id,
            parent_run_id=parent_id,
            tags={**redacted_context_tags(), **redact_mapping(owner_tags())},
            log_system_metrics=False,  # the train run samples them itself (tasks/tracking/system.py)
        )
        try:
            run = StageRun(mlflow, active.info.run_id)
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
            _end_runs(mlflow, status, parent_id if owns_parent else None, entry_point, pipeline)
    except TrackingUnavailable:
        raise
    except Exception as exc:
        if _store_failed(exc):
            raise TrackingUnavailable(_records_lost(stage, exc)) from exc
        raise


def _end_runs(mlflow: Any, status: str, parent_id: str | None, entry_point: str, pipeline: Params | None) -> None:
    """End the stage's run, and the parent run it owns, as `status`.

    After a failure (status FAILED, its exception on its way up) a store that fails here too is
    logged, not raised: the first failure is the one that says what went wrong (an artifact store
    down, say), and MLflow's own cleanup request would otherwise replace it with a traceback.
    """
    steps: list[Callable[[], Any]] = [lambda: mlflow.end_run(status)]
    if parent_id is not None:
        client = mlflow.MlflowClient()
        if pipeline is not None:
            steps.append(lambda: _record_pipeline(client, parent_id, entry_point, pipeline, status))
        steps.append(lambda: client.set_terminated(parent_id, status))
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
