"""Prefect's settings for this project, and where the stages' log lines go: applied by an explicit call.

Importing a module of flows/ configures nothing. Each entry point of flows/ calls `configure` first
(`python -m flows.pipeline`, `flows.deployments`, `flows.sweep`, a sweep's Dask workers), before it
imports Prefect where it can, since Prefect reads its settings when it loads; where Prefect is loaded
already (flows/sweep.py imports it at its top), Prefect reads them again. Every default yields to what
the user has set: PREFECT_HOME / PREFECT_API_URL elsewhere, say. The pipeline flow itself calls
`send_logs` (a work pool's flow-run process starts in Prefect's engine, not at one of ours).
"""

from __future__ import annotations

import logging
import os
import sys

from tasks.core.cli import quiet_libraries
from tasks.core.layout import ROOT
from tasks.core.redact import install as install_redaction


def defaults() -> dict[str, str]:
    """The variables `configure` sets where the user has not."""
    return {
        # analytics off (else sqlite "database is locked" tracebacks from the local server)
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # a cold ephemeral-server start takes ~17 s on 2 cores; the default timeout is 20 s
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        # Prefect's state (its sqlite database) inside the project, like MLflow's and DVC's
        "PREFECT_HOME": str(ROOT / ".prefect"),
        # the stages' own log lines (download retries, epochs, gates, lock waits) in Prefect's run logs;
        # inherited by the processes that serve and run deployments
        "PREFECT_LOGGING_EXTRA_LOGGERS": "tasks",
    }


def configure() -> None:
    """This process's Prefect settings (inherited by the processes it starts), and `send_logs`."""
    unset = {name: value for name, value in defaults().items() if name not in os.environ}
    os.environ.update(unset)
    context = sys.modules.get("prefect.context")
    if unset and context is not None:  # Prefect loaded before this call: it reads its settings again
        context.refresh_global_settings_context()
    send_logs()


def send_logs() -> None:
    """Every log record masked (those Prefect sends to its server too), libraries quiet, and the stages'
    lines at INFO in Prefect's run logs. Idempotent."""
    install_redaction()
    quiet_libraries()  # before MLflow and torch load (tasks/core/cli.py)
    # At INFO: Prefect leaves an extra logger's level to the root's (WARNING), which would keep the
    # epoch lines out.
    logging.getLogger("tasks").setLevel(logging.INFO)
    _send_stage_logs_to_prefect()


def _send_stage_logs_to_prefect() -> None:
    """Where Prefect set its logging up before this call (a work pool's flow-run process, `python -m
    prefect.engine`, set it up with the worker's environment; flows/sweep.py imports Prefect at its
    top), give the `tasks` logger Prefect's handlers for extra loggers now."""
    configuration = sys.modules.get("prefect.logging.configuration")
    if configuration is None or not getattr(configuration, "PROCESS_LOGGING_CONFIG", None):
        return  # Prefect is not set up yet: it will read PREFECT_LOGGING_EXTRA_LOGGERS itself
    stages = logging.getLogger("tasks")
    for handler in logging.getLogger("prefect.extra").handlers:
        if handler not in stages.handlers:
            stages.addHandler(handler)
