"""A flow run against the process's own Prefect server sends no heartbeats (flows/prefect_env.py
`local_api`): no automation watches a server that ends with the process, and Prefect's heartbeat
thread, which sleeps in whole seconds, held each run's end for up to a second. Where the user or the
stack sets PREFECT_FLOWS_HEARTBEAT_FREQUENCY (the stack's zombie automation needs it), it is kept.

A real local server and a real flow in a process of their own, as `python -m flows.pipeline` runs them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run

pytestmark = pytest.mark.slow

# What a flow run sees of Prefect's settings.
PROBE = """
from flows import prefect_settings
prefect_settings.configure()
from prefect import flow
from prefect.settings import get_current_settings
from flows import prefect_env

@flow
def probe():
    return get_current_settings().flows.heartbeat_frequency

with prefect_env.local_api():
    print("HEARTBEAT", probe())
"""


def _heartbeat_seen(tmp_path: Path, **env: str) -> str:
    done = run([sys.executable, "-c", PROBE], ROOT, PREFECT_HOME=str(tmp_path / "prefect"), **env)
    return next(line for line in done.stdout.splitlines() if line.startswith("HEARTBEAT ")).split()[1]


def test_a_local_run_sends_no_heartbeats_unless_the_user_asks(tmp_path: Path) -> None:
    assert _heartbeat_seen(tmp_path) == "None"
    assert _heartbeat_seen(tmp_path, PREFECT_FLOWS_HEARTBEAT_FREQUENCY="45") == "45"
