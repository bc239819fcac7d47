"""Where MLflow runs go, and whether the store takes them: the tracking URI, opening a local sqlite
store safely, the locks a store's users share, and the check made before a run starts (a tracking
server that is down fails the pipeline in seconds, not after minutes of retries or after training).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.parse
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from filelock import FileLock

from tasks.core.config.service import TrackingConfig
from tasks.core.errors import ExpectedFailure
from tasks.core.layout import project_root
from tasks.core.redact import redact

CHECK_TIMEOUT_S = 4.0  # the store check's request: with start-up, a dead server fails a run in < 10 s


def tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI` if set, else an sqlite store at the absolute project root."""
    return os.environ.get("MLFLOW_TRACKING_URI") or default_uri()


def default_uri() -> str:
    """The project's own store: an sqlite database at the absolute project root (DVC experiments run
    stages from other directories)."""
    return f"sqlite:///{project_root() / 'mlflow.db'}"


def mlflow_module() -> Any:
    """MLflow, imported (lazily: a GPU box with torch alone trains with tracking off) and pointed at
    `tracking_uri()`, its sqlite store created under a lock the first time."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # heavy: mlflow (~4 s), only when a tracking server is used; the no-op path never loads it
    import mlflow

    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    _open_sqlite_store(mlflow, uri)
    return mlflow


_opened_stores: set[str] = set()  # sqlite URIs this process has opened (MLflow caches the store per URI)


def _open_sqlite_store(mlflow: Any, uri: str) -> None:
    """Open (and, the first time, create) an sqlite store while holding a lock on it.

    MLflow creates an empty store's tables and runs its ~70 schema migrations from whichever process
    opens it first, with no lock between processes. Two stages that start together (`dvc queue start
    -j 2` on a fresh clone) both did, and one failed with "table latest_metrics already exists"
    (tests/flows/test_dvc_experiments.py). Under the lock the second waits, then finds the tables made. The lock file
    lives in the temporary directory, keyed by the database's path, like the lock MLflow takes for this
    in its job and workspace stores (not in the tracking store): no file appears in the project.
    """
    if urllib.parse.urlparse(uri).scheme != "sqlite" or uri in _opened_stores:
        return
    with store_lock(uri, "store"):
        mlflow.MlflowClient(uri)  # builds the store: creates the tables if there are none
    _opened_stores.add(uri)


def store_lock(uri: str, purpose: str) -> AbstractContextManager[Any]:
    """A lock that this machine's processes take on a local sqlite store for `purpose` (creating it,
    a promotion decision), kept in the temporary directory and keyed by the database's path; for a
    tracking server, no lock (the caller then re-checks what it read)."""
    if urllib.parse.urlparse(uri).scheme != "sqlite":
        return nullcontext()

    database = Path(urllib.parse.urlparse(uri).path[1:]).resolve()  # sqlite:///<path>, absolute or not
    key = hashlib.sha256(str(database).encode()).hexdigest()[:16]
    return FileLock(Path(tempfile.gettempdir()) / f"lockstep-mlflow-{purpose}-{key}.lock")


class TrackingUnavailable(ExpectedFailure):
    """The MLflow store cannot take this run's records (server down or failing, store not writable)."""


def check_store(cfg: TrackingConfig) -> None:
    """Fail fast, before anything runs, if the tracking store cannot be written to.

    A server gets one real API request (MLflow's own client code, so its auth and TLS settings
    apply), no retries, CHECK_TIMEOUT_S at most: refused, timing out, 5xx or 401/403 is an error.
    MLflow's client would otherwise retry for minutes, and only once the first record is due.
    """
    if not cfg.enabled:
        return
    uri = tracking_uri()
    shown = redact(uri)
    fix = "start it, point MLFLOW_TRACKING_URI at one that runs, or set tracking.enabled: false in params.yaml"
    scheme = urllib.parse.urlparse(uri).scheme
    if scheme in ("http", "https"):
        # heavy: mlflow (~4 s), only when a tracking server is checked; the no-op path never loads it
        from mlflow.utils.credentials import get_default_host_creds
        from mlflow.utils.rest_utils import http_request

        try:
            response = http_request(
                get_default_host_creds(uri),
                "/api/2.0/mlflow/experiments/get-by-name",
                "GET",
                max_retries=0,
                timeout=CHECK_TIMEOUT_S,
                raise_on_status=False,
                params={"experiment_name": cfg.experiment},
            )
        except Exception as exc:  # noqa: BLE001 - requests/urllib3/MLflow raise many kinds; all mean "unreachable"
            text = str(exc).lower()
            reason = (
                f"no answer within {CHECK_TIMEOUT_S:g} s"
                if "timed out" in text or "timeout" in text
                else "connection refused"
                if "refused" in text
                else f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            )
            raise TrackingUnavailable(
                f"MLflow tracking server {shown} (MLFLOW_TRACKING_URI) is unreachable: {reason}; {fix}"
            ) from None
        if response.status_code in (401, 403):
            raise TrackingUnavailable(
                f"MLflow tracking server {shown} (MLFLOW_TRACKING_URI) refused the credentials "
                f"(HTTP {response.status_code}): check MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"
            ) from None
        if response.status_code >= 500:
            raise TrackingUnavailable(
                f"MLflow tracking server {shown} (MLFLOW_TRACKING_URI) answered HTTP {response.status_code}; {fix}"
            ) from None
        if response.status_code not in (200, 404):  # 404: no such experiment yet, created on first use
            raise TrackingUnavailable(
                f"{shown} (MLFLOW_TRACKING_URI) does not answer like an MLflow tracking "
                f"server (HTTP {response.status_code}); {fix}"
            )
    elif scheme == "sqlite":
        folder = Path(urllib.parse.urlparse(uri).path).parent
        if not os.access(folder, os.W_OK):
            raise TrackingUnavailable(f"MLflow store {shown}: {folder} is not a writable directory; {fix}")
