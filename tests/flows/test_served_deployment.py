"""`make schedule`'s served deployment (`python -m flows.deployments serve`, its own Prefect server on a
free loopback port) with no tracking server: what its server refuses (strangers, other origins,
overrides that reach the network), the schedule it keeps, and runs that crash, reported once.

One served project for the module, a clone of the session's trained one, notifying through a Prefect
Custom Webhook block saved on that server, as an operator would set it up. Its data is sklearn's
digits as an image-folder archive on a loopback HTTP server, so that a test can hold the download
stage for as long as it needs: killed "while download runs" is then not a race with a stage that
takes a second. The served deployment with an MLflow server, through a user's week of runs, is
tests/flows/test_service.py's; stopping `serve` takes its server down with it in
tests/reliability/test_server_binds.py (`make schedule`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from benchmarks.fakedata.archives import pack
from benchmarks.httpserver import FileServer
from tests.conftest import client_for, clone_project, run, write_params
from tests.support.digits import write_digits
from tests.support.notify_token import HOOK_PATH, in_text
from tests.support.prefect_client import PrefectAPI, basic_auth, cron_far_from_now, status_of
from tests.support.served import DEPLOYMENT, deployment_run, serving, until
from tests.support.webhook import WebhookReceiver

pytestmark = pytest.mark.slow

BLOCK = "custom-webhook/oncall"
ARCHIVE = "/datasets/digits.tar.gz"
# How long the source holds a download a test kills: the kill comes within seconds; the hold ends
# sooner if the server stops.
HOLD_S = 600
CRON = cron_far_from_now()  # the nightly default would start a run of its own when a session spans 03:00 UTC
SCHEDULER_WAIT_S = 90  # Prefect's scheduler service loops every 60 s (its recent-deployments loop, 5 s)


@dataclass
class Served:
    repo: Path
    hook: WebhookReceiver
    serve: Any  # subprocess.Popen: the serve process
    prefect: PrefectAPI  # the API with serve's auth string, as a client uses it
    source: FileServer  # the data source (an image-folder archive): holds a download on request


@pytest.fixture(scope="module")
def served(dvc_repo: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("served")
    write_digits(base / "digits", range(1797))
    sha256 = pack(base / "digits", base / "digits.tar.gz", "tar.gz")
    with FileServer(hang_s=HOLD_S) as source, WebhookReceiver() as hook:
        source.add(ARCHIVE, (base / "digits.tar.gz").read_bytes())
        repo = clone_project(dvc_repo["repo"], base / "repo")
        data = {"source": "imagefolder", "url": source.url_for(ARCHIVE), "sha256": sha256, "channels": 1}
        orchestration = {"cron": CRON, "notify": {"block": BLOCK}}
        write_params(repo / "params.yaml", {"data": data, "orchestration": orchestration}, base=repo / "params.yaml")
        with serving(repo, base / "serve.log") as (serve, prefect):
            save_block = (
                "from prefect.blocks.notifications import CustomWebhookNotificationBlock as B; "
                f"B(name='oncall', url={hook.url(HOOK_PATH)!r}, "
                "json_data={'text': '{{body}}', 'subject': '{{subject}}'}).save('oncall')"
            )
            run([sys.executable, "-c", save_block], repo, **prefect.client_env)
            yield Served(repo, hook, serve, prefect, source)
    assert not in_text((base / "serve.log").read_text())  # the block's URL, which holds a token


def _told(stack: Served, flow_run_id: str, count: int = 1) -> list[dict[str, Any]]:
    """The block's messages about one flow run, once `count` arrived (and a moment for one more)."""

    def mine() -> list[dict[str, Any]]:
        return [m for m in stack.hook.messages if f"flow run id: {flow_run_id}" in m.get("text", "")]

    until(lambda: len(mine()) >= count, f"no message about flow run {flow_run_id}", time.monotonic() + 60)
    time.sleep(1)
    return mine()


# --------------------------------------------------------------------------- what the server refuses


def test_the_server_refuses_strangers_and_other_origins(served: Served) -> None:
    """`make schedule`'s server, as a web page or a DNS-rebound host name reaches it: no credentials,
    another origin, no CSRF token. Prefect 3.8's defaults answered all of these."""
    auth_file = served.repo / ".prefect" / "api-auth"
    assert stat.S_IMODE(auth_file.stat().st_mode) == 0o600
    auth_string, api = served.prefect.auth_string, served.prefect.url
    assert auth_string.startswith("lockstep:") and len(auth_string) > 30
    deployment = f"{api}/deployments/name/{DEPLOYMENT}"
    assert status_of(deployment)[0] == 401
    assert status_of(deployment, Authorization=basic_auth("lockstep:guess"))[0] == 401
    assert status_of(deployment, Host="evil.example:4200")[0] == 401  # DNS rebinding: still no credentials
    authorized = {"Authorization": basic_auth(auth_string), "Content-Type": "application/json"}
    start = f"{api}/deployments/{served.prefect(f'/deployments/name/{DEPLOYMENT}')['id']}/create_flow_run"
    assert status_of(start, "POST", Origin="http://evil.example", **authorized)[0] == 403  # no CSRF token
    preflight = {"Access-Control-Request-Method": "POST"}
    _, foreign = status_of(start, "OPTIONS", Origin="http://evil.example", **preflight)
    _, own = status_of(start, "OPTIONS", Origin=api.removesuffix("/api"), **preflight)
    assert "access-control-allow-origin" not in {key.lower() for key in foreign}, foreign
    assert {key.lower(): value for key, value in own.items()}["access-control-allow-origin"] == api.removesuffix("/api")
    serve_log = (served.repo.parent / "serve.log").read_text()
    assert auth_string.split(":", 1)[1] not in serve_log  # printed: where it is, not what
    assert "Starting temporary server" not in serve_log  # serve talks to its own server, the locked one


def test_the_prefect_ui_calls_the_api_on_the_port_the_server_runs_on(served: Served) -> None:
    """`make schedule PREFECT_PORT=...`: the UI's pages must call that port, not Prefect's default 4200."""
    with urllib.request.urlopen(served.prefect.url.removesuffix("/api") + "/ui-settings", timeout=10) as response:
        settings = json.loads(response.read())
    assert settings["api_url"] == served.prefect.url, settings


def test_a_run_cannot_point_the_pipeline_at_another_machine(served: Served) -> None:
    """Overrides through the API of keys that reach the network are refused before anything is written
    (this server was started without --allow-override); the "attacker's" rendezvous hears nothing, and
    the people on call hear of the refusal, through the block."""
    with socket.socket() as attacker:
        attacker.bind(("127.0.0.1", 0))
        attacker.listen()
        attacker.setblocking(False)
        endpoint = f"127.0.0.1:{attacker.getsockname()[1]}"
        before = _files(served.repo, "params.yaml", "dvc.lock")
        overrides = {"overrides": {"train.strategy": "ddp", "train.nnodes": 2, "train.rdzv_endpoint": endpoint}}
        flow_run_id, done = deployment_run(served.prefect, served.repo, "--params", json.dumps(overrides), check=False)
        assert done.returncode != 0
        state = served.prefect(f"/flow_runs/{flow_run_id}")["state"]
        assert state["type"] == "FAILED", state
        assert "train.nnodes, train.rdzv_endpoint reach the network or other machines" in state["message"], state
        with pytest.raises(BlockingIOError):
            attacker.accept()
    assert _files(served.repo, *before) == before
    (message,) = _told(served, flow_run_id)  # waited for: a later test counts messages of its own
    assert "Failed" in message["subject"] and "reach the network" in message["text"], message


def _files(folder: Path, *names: str) -> dict[str, str | None]:
    return {name: (folder / name).read_text() if (folder / name).exists() else None for name in names}


def test_the_schedule_created_upcoming_runs(served: Served) -> None:
    deployment = served.prefect(f"/deployments/name/{DEPLOYMENT}")
    assert [s["schedule"]["cron"] for s in deployment["schedules"]] == [CRON]
    assert deployment["parameters"] == {"reingest": True}
    upcoming = {"deployment_id": {"any_": [deployment["id"]]}, "state": {"type": {"any_": ["SCHEDULED"]}}}
    # The server's scheduler service creates the runs on its own loop, some seconds after the
    # deployment appears: when this test runs first, it must wait for that loop.
    deadline = time.monotonic() + SCHEDULER_WAIT_S
    while len(scheduled := served.prefect("/flow_runs/filter", {"flow_runs": upcoming})) < 3:
        if time.monotonic() > deadline:
            break
        time.sleep(1)
    starts = sorted(datetime.fromisoformat(r["expected_start_time"].replace("Z", "+00:00")) for r in scheduled)
    assert len(starts) >= 3, scheduled
    assert all((t.hour, t.minute, t.utcoffset().total_seconds()) == (int(CRON.split()[1]), 0, 0) for t in starts)
    assert starts[0] > datetime.now(starts[0].tzinfo)


# --------------------------------------------------------------------------- crashed runs


@dataclass(frozen=True)
class Crash:
    flow_run_id: str
    messages: list[dict[str, Any]]  # what the block sent from the kill on
    state: dict[str, Any]  # the flow run's final state
    orphans: list[Any]  # the MLflow runs it left RUNNING, as found right after it died


def _flow_run_process(flow_run_id: str, parent: int) -> int:
    """The process serve started for the flow run (its child with PREFECT__FLOW_RUN_ID set)."""
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no process of serve (pid {parent}) runs flow run {flow_run_id}")


def _kill_in_download(stack: Served, sig: signal.Signals) -> Crash:
    """Start a deployment run, kill its process with `sig` while the download stage waits on the data
    source (which holds the request); the messages that arrive, and the flow run's final state."""
    before = len(stack.hook.messages)
    # the archive must be fetched again, not taken from the download cache a completed run left
    shutil.rmtree(stack.repo / ".cache" / "downloads", ignore_errors=True)
    requests = stack.source.count(ARCHIVE)
    stack.source.fail(ARCHIVE, "hang")
    flow_run_id, _ = deployment_run(stack.prefect, stack.repo, watch=False)
    asked = time.monotonic() + 300
    until(lambda: stack.source.count(ARCHIVE) > requests, "the download stage never asked the source", asked)
    os.kill(_flow_run_process(flow_run_id, stack.serve.pid), sig)
    state: dict[str, Any] = {}

    def crashed_and_told() -> bool:
        state.clear()
        state.update(stack.prefect(f"/flow_runs/{flow_run_id}")["state"])
        return state["type"] == "CRASHED" and len(stack.hook.messages) > before

    # its own time from the kill (a loaded machine can take most of the above to reach the download)
    until(crashed_and_told, "the killed run was not reported Crashed with a message", time.monotonic() + 180, state)
    time.sleep(5)  # time for a second message, if anything sent one
    client = client_for(stack.repo)
    experiment = client.get_experiment_by_name("lockstep").experiment_id
    orphans = client.search_runs([experiment], "attributes.status = 'RUNNING'")
    return Crash(flow_run_id, stack.hook.messages[before:], state, orphans)


@pytest.fixture(scope="module")
def sigkilled(served: Served) -> Crash:
    return _kill_in_download(served, signal.SIGKILL)


@pytest.fixture(scope="module")
def terminated(served: Served, sigkilled: Crash) -> Crash:
    """Killed with SIGTERM, after the SIGKILLed run: it is also the next run, which marks the MLflow runs
    the SIGKILLed one left RUNNING as KILLED (its sweep comes first, before the download stage), one flow
    run doing the work of two."""
    return _kill_in_download(served, signal.SIGTERM)


def _assert_one_crash_message(stack: Served, crash: Crash) -> None:
    assert crash.state["type"] == "CRASHED", crash.state
    assert len(crash.messages) == 1, crash.messages
    flow_run = stack.prefect(f"/flow_runs/{crash.flow_run_id}")
    text = crash.messages[0]["text"]
    assert crash.messages[0]["subject"] == f"lockstep-pipeline: flow run '{flow_run['name']}' Crashed (crashed)"
    assert f"deployment: {DEPLOYMENT}" in text and f"flow run id: {crash.flow_run_id}" in text
    assert "stage: download" in text
    assert f"error: {crash.state['message']}" in text, (text, crash.state)


def test_a_served_run_killed_with_sigkill_is_reported_crashed_once(
    served: Served, sigkilled: Crash, terminated: Crash
) -> None:
    """Nothing runs in a SIGKILLed process: serve's Runner sees the exit, reports Crashed and runs
    the flow's on_crashed hook in its own process, which finds the stage in the API. The next run
    (`terminated`) marks the MLflow runs the killed one left RUNNING as KILLED."""
    _assert_one_crash_message(served, sigkilled)
    assert "SIGKILL" in sigkilled.messages[0]["text"]
    # Its MLflow runs (the pipeline's parent, and the download stage's if it had opened one) died
    # RUNNING with it; the next deployment run marked them KILLED, saying why (tasks/tracking/orphans.py).
    assert "parent" in {r.data.tags.get("lockstep.stage", "parent") for r in sigkilled.orphans}, sigkilled.orphans
    client = client_for(served.repo)
    for orphan in sigkilled.orphans:
        after = client.get_run(orphan.info.run_id)
        assert after.info.status == "KILLED", after.info
        reason = after.data.tags["lockstep.killed_reason"]
        assert f"process {orphan.data.tags['lockstep.owner.pid']} on host" in reason and "is gone" in reason, reason


def test_a_served_run_terminated_is_reported_crashed_once(served: Served, terminated: Crash) -> None:
    """SIGTERM: the engine reports the crash and runs on_crashed in the flow's process; the Runner
    must not report it a second time."""
    _assert_one_crash_message(served, terminated)
    print(json.dumps(terminated.messages[0]))
