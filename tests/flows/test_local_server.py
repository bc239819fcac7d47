"""The Prefect server a command starts for itself (flows/prefect_env.py `local_api`), which ends with
the process: its flow runs send no heartbeats, and the process waits for it to record their task runs.

- No automation watches such a server, and Prefect's heartbeat thread, which sleeps in whole seconds,
  held each run's end for up to a second. Where the user or the stack sets
  PREFECT_FLOWS_HEARTBEAT_FREQUENCY (the stack's zombie automation needs it), it is kept.
- Prefect records task runs from events, a moment after they happen: the command waits until its
  server holds them all before that server stops (flows/local_records.py). Without the wait, a CI run
  of 2026-12-05 lost the final state of a `make run`'s last task.

A real local server and real flows in a process of their own, as `python -m flows.pipeline` runs them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run, seed_prefect_home

pytestmark = pytest.mark.slow

# What a flow run sees of Prefect's settings, and how `wait_recorded` waits on a task run the server has
# not finished: it is set Completed 0.6 s after the wait begins (through the API, as the recorder would);
# then one that never comes, and a server that does not answer.
PROBE = """
import threading, time
from flows import prefect_settings
prefect_settings.configure()
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings
from prefect.states import Completed, Running
from flows import local_server, prefect_env
from flows.local_records import wait_recorded

@task
def step():
    return 1

@flow
def probe():
    step()
    return get_current_settings().flows.heartbeat_frequency

with prefect_env.local_api() as own_server:
    state = probe(return_state=True)
    print("HEARTBEAT", state.result(), "OWN", own_server)
    print("RECORDED", wait_recorded(state.state_details.flow_run_id, task_runs=1))
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(probe)
        unfinished = client.create_task_run(step, flow_run.id, dynamic_key="0", state=Running())
        finish = threading.Timer(0.6, client.set_task_run_state, (unfinished.id, Completed()), {"force": True})
        began = time.monotonic()
        finish.start()
        print("WAITED", wait_recorded(flow_run.id, task_runs=1), round(time.monotonic() - began, 2))
        finish.join()
        began = time.monotonic()
        print("MISSING", wait_recorded(flow_run.id, task_runs=2, timeout_s=0.5), round(time.monotonic() - began, 2))
    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{local_server.free_port()}/api"}):
        print("GONE", wait_recorded(flow_run.id, task_runs=1))
"""


def _probe(tmp_path: Path, database: Path, **env: str) -> dict[str, list[str]]:
    home = seed_prefect_home(tmp_path / "prefect", database)  # migrated: the migrations are not the subject
    done = run([sys.executable, "-c", PROBE], ROOT, PREFECT_HOME=str(home), **env)
    seen = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines() if line.split()}
    seen["log"] = [done.stdout + done.stderr]
    return seen


def test_a_local_run_sends_no_heartbeats_unless_the_user_asks_and_waits_for_its_records(
    tmp_path: Path, prefect_database: Path
) -> None:
    seen = _probe(tmp_path, prefect_database)
    assert seen["HEARTBEAT"] == ["None", "OWN", "True"], seen["log"]
    # the flow's one task run was recorded Completed before its server stopped
    assert seen["RECORDED"] == ["True"], seen["log"]
    # a task run still Running holds the wait until it is finished ...
    recorded, waited = seen["WAITED"]
    assert recorded == "True" and 0.6 <= float(waited) < 5, seen["log"]
    # ... and one that never comes ends it after its timeout, with a warning naming what is missing
    recorded, waited = seen["MISSING"]
    assert recorded == "False" and 0.5 <= float(waited) < 3, seen["log"]
    assert "holds 1 of 2 task runs" in seen["log"][0], seen["log"]
    # a server that no longer answers leaves the run as it is, with a warning
    assert seen["GONE"] == ["False"] and "could not be checked" in seen["log"][0], seen["log"]


def test_heartbeats_the_user_sets_are_kept(tmp_path: Path, prefect_database: Path) -> None:
    assert _probe(tmp_path, prefect_database, PREFECT_FLOWS_HEARTBEAT_FREQUENCY="45")["HEARTBEAT"][0] == "45"
