"""What a stage logs to (`StageRun`), and the two ways its records reach the store: MLflow's client
(`ClientWriter`: any store, a tracking server included) or, for the project's own sqlite store, the
rows written directly (tasks/tracking/sqlite_store.py `SqliteStore`, which says why). tasks/tracking/
runs.py picks one when the run starts; a stage's code never knows which.

Everything logged goes through tasks/core/redact.py: no secret reaches params, tags or artifacts.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tasks.core.config.params import Params
from tasks.core.redact import redact, redact_mapping
from tasks.tracking.dashboard import log_dataset
from tasks.tracking.sqlite_record import link_dataset
from tasks.tracking.sqlite_store import SqliteStore
from tasks.tracking.store import mlflow_module
from tasks.tracking.system import SystemMetrics

METRICS_WRITE_EVERY_S = 1.0  # how stale a stage's metrics in the store may get (StageRun.log_metrics)
MAX_METRICS_PER_WRITE = 1000  # MLflow's limit per log_batch


class ClientWriter:
    """A run's records through MLflow's client (`mlflow`, the module tasks/tracking/store.py set up)."""

    def __init__(self, mlflow: Any) -> None:
        self._client = mlflow.MlflowClient()

    def log_batch(
        self,
        run_id: str,
        params: Mapping[str, str] | None = None,
        tags: Mapping[str, str] | None = None,
        metrics: Iterable[tuple[str, float, int, int]] = (),
    ) -> None:
        # heavy: mlflow (~4 s), loaded by now (a client exists); at the top every stage would load it
        from mlflow.entities import Metric, Param, RunTag

        self._client.log_batch(  # (MLflow splits a batch over its limits itself)
            run_id,
            metrics=[Metric(*point) for point in metrics],
            params=[Param(k, v) for k, v in (params or {}).items()],
            tags=[RunTag(k, v) for k, v in (tags or {}).items()],
        )

    def log_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        self._client.log_artifact(run_id, str(path), artifact_path=artifact_path)


RunWriter = SqliteStore | ClientWriter  # each write raises if the store cannot take it


class StageRun:
    """What a stage logs to. With tracking disabled (no writer) every method does nothing (by request)."""

    def __init__(self, writer: RunWriter | None = None, run_id: str | None = None) -> None:
        self._writer = writer
        self.run_id = run_id
        self._pending: list[tuple[str, float, int, int]] = []  # metric points not yet written
        self._written_at = float("-inf")  # time.monotonic() of the last write
        self._system: SystemMetrics | None = None  # the machine's load, sampled while the run trains
        self._writing = threading.Lock()  # the system metrics' thread writes too, when the run is silent

    def sample_system(self) -> None:
        """Record the machine's load (MLflow's system metrics) until the run ends (tasks/tracking/system.py)."""
        if self._writer and self._system is None and self.run_id:
            self._system = SystemMetrics(self.flush, lambda: self._written_at)

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    @property
    def writer(self) -> RunWriter | None:
        """Where this run's records go (None: tracking disabled)."""
        return self._writer

    def log_params(self, params: dict[str, Any]) -> None:
        self.record(params=params)

    def record(self, params: dict[str, Any] | None = None, tags: dict[str, Any] | None = None) -> None:
        """Params and tags in one write: each write to the sqlite store through MLflow's client costs ~9 ms
        of its own work (the train stage's tags and params took six writes, now two:
        benchmarks/results/b4-tracking.json)."""
        if not self._writer or not self.run_id:
            return
        new_params = {key: str(value) for key, value in redact_mapping(params or {}).items()}
        new_tags = {key: str(value) for key, value in redact_mapping(tags or {}).items()}
        if new_params or new_tags:
            self._writer.log_batch(self.run_id, params=new_params, tags=new_tags)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Metrics stamped now, written at most every METRICS_WRITE_EVERY_S (and by `flush`).

        One write to the sqlite store through MLflow's client takes ~11 ms: once per epoch it cost 6% of
        training digits (B4 in benchmarks/). Batched by time instead, a short epoch's curve reaches the
        UI a second late and a long one's at once. (MLflow's own `synchronous=False` queue was slower
        still: its logging thread competes with training for the 2 cores, 1.25x.)
        """
        if not self._writer:
            return
        stamp = int(time.time() * 1000)
        with self._writing:
            self._pending += [(key, float(value), stamp, step or 0) for key, value in metrics.items()]
        if time.monotonic() - self._written_at >= METRICS_WRITE_EVERY_S:
            self.flush()

    def log_history(self, rows: Iterable[dict[str, float]], prefix: str = "") -> None:
        """Per-epoch rows (each with its `epoch`) as metric series stepped by epoch: the one way a
        curve is logged (training, its resumed part, DDP's history.json, fine-tuning in compress)."""
        for row in rows:
            self.log_metrics({f"{prefix}{k}": v for k, v in row.items() if k != "epoch"}, step=int(row["epoch"]))

    def flush(self) -> None:
        """Write the metrics logged (and the system metrics sampled) so far; raises if the store cannot,
        keeping them for the next write."""
        with self._writing:
            if self._writer and self._system is not None:
                self._pending += self._system.take()
            if self._writer and self.run_id:
                while self._pending:
                    self._writer.log_batch(self.run_id, metrics=self._pending[:MAX_METRICS_PER_WRITE])
                    del self._pending[:MAX_METRICS_PER_WRITE]
            self._written_at = time.monotonic()

    def close(self) -> None:
        """Stop sampling the machine and write what is left; raises if the store cannot."""
        if self._system is not None:
            self._system.stop()
        self.flush()

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.record(tags=tags)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Log a file; a text file that holds a secret (a resolved params.yaml, dvc.lock) is logged as a
        copy with the secret masked, under the same name."""
        if not self._writer or not self.run_id:
            return
        path = Path(path)
        text = _text_of(path)
        if text is None or redact(text) == text:
            self._writer.log_artifact(self.run_id, path, artifact_path)
            return
        with tempfile.TemporaryDirectory(prefix="lockstep-redacted-") as tmp:
            copy = Path(tmp) / path.name
            copy.write_text(redact(text))
            shutil.copymode(path, copy)
            self._writer.log_artifact(self.run_id, copy, artifact_path)

    def log_dataset(self, params: Params) -> None:
        """The data the run trains on, as its MLflow dataset input (tasks/tracking/dashboard.py)."""
        if isinstance(self._writer, SqliteStore) and self.run_id:
            link_dataset(self._writer, self.run_id, params)
        elif self._writer and self.run_id:
            log_dataset(mlflow_module().MlflowClient(), self.run_id, params)

    @property
    def mlflow(self) -> Any:
        """The mlflow module, for flavour-specific calls (log_model; ~3 s to load where the run's records
        are written without it); only when enabled."""
        if self._writer is None:
            raise RuntimeError("tracking is disabled (tracking.enabled: false)")
        return mlflow_module()


def _text_of(path: Path, limit: int = 16 * 2**20) -> str | None:
    """The file's text if it is a modest UTF-8 text file (what could carry a secret), else None."""
    if path.stat().st_size > limit:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None
