"""Prefect's settings for this project, applied before Prefect is imported (it reads them then).

Every default yields to what the user has set: PREFECT_HOME / PREFECT_API_URL elsewhere, say.
"""

from __future__ import annotations

import os

from tasks.layout import ROOT


def configure() -> None:
    # analytics off (else sqlite "database is locked" tracebacks from the local server)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # a cold ephemeral-server start takes ~17 s on 2 cores; the default timeout is 20 s
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    # Prefect's state (its sqlite database) inside the project, like MLflow's and DVC's
    os.environ.setdefault("PREFECT_HOME", str(ROOT / ".prefect"))
    # the stages' own log lines (download retries, epochs, gates, lock waits) in Prefect's run logs;
    # inherited by the processes that serve and run deployments
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "tasks")
