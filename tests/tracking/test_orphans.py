"""Runs left RUNNING by a killed process are marked KILLED, with the reason, by the next pipeline run,
`python -m tasks.tools.reproduce` or `python -m tasks.tracking.orphans`; runs whose process may still live are not.

Real processes (a stage process SIGKILLed, a fake `dvc` parent) and a real sqlite MLflow store in a
temporary directory (copied from one made per module: a new store's migrations take ~9 s).
"""

from __future__ import annotations

import logging
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from tasks.core.config.service import TrackingConfig
from tasks.core.processes import start_mark
from tasks.tracking import orphans
from tasks.tracking.orphans import KILLED_REASON, mark_orphans
from tasks.tracking.owners import OWNER_HOST, OWNER_MARK, OWNER_PID, OWNER_PIDNS, OWNER_STARTED, iso_time, session_key
from tasks.tracking.runs import PARENT_ENV, pipeline_run, stage_run
from tasks.tracking.store import tracking_uri
from tests.conftest import ROOT, subprocess_env

# A stage process: opens its stage run (and, outside a flow, its session's parent run), then waits.
STAGE = """
import os, time
from tasks.core.config.service import TrackingConfig
from tasks.tracking.runs import stage_run
with stage_run("train", TrackingConfig(), {"lr": 0.1}) as run:
    print(os.getpid(), run.run_id, flush=True)
    time.sleep(300)
"""
# Run as `python <tmp>/dvc repro <code>`: to tasks/tracking/runs.py, a dvc process running a stage.
FAKE_DVC = """
import subprocess, sys, time
subprocess.run([sys.executable, "-c", sys.argv[2]])
time.sleep(300)
"""


@dataclass
class Store:
    uri: str
    client: Any
    experiment_id: str
    dir: Path

    def status(self, run_id: str) -> str:
        return self.client.get_run(run_id).info.status

    def reason(self, run_id: str) -> str | None:
        return self.client.get_run(run_id).data.tags.get(KILLED_REASON)


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()  # creates the tables
    return path


@pytest.fixture
def store(empty_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    from mlflow import MlflowClient

    shutil.copy(empty_store, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv(PARENT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)  # lineage tags read dvc.lock / data.dvc relative to here: absent
    client = MlflowClient(tracking_uri=uri)
    experiment_id = client.create_experiment("lockstep", artifact_location=(tmp_path / "artifacts").as_uri())
    return Store(uri, client, experiment_id, tmp_path)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts, each in its own process group: killed with their children at the end."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _start(cmd: list[str], store: Store, processes: list[subprocess.Popen[str]]) -> tuple[int, str]:
    """Start `cmd` (it prints "<pid> <run id>" once its run is open): that pid and run id."""
    log = open(store.dir / "child.log", "w")  # noqa: SIM115 - the child writes it; closed below
    proc = subprocess.Popen(
        cmd,
        cwd=store.dir,
        env=subprocess_env(MLFLOW_TRACKING_URI=store.uri, PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    log.close()
    processes.append(proc)
    ready, _, _ = select.select([proc.stdout], [], [], 90)
    line = proc.stdout.readline() if ready else ""
    assert line, f"the child opened no run:\n{(store.dir / 'child.log').read_text()[-3000:]}"
    pid, run_id = line.split()
    return int(pid), run_id


def _owned_by(store: Store, pid: int, started: float, **tags: str) -> str:
    """A RUNNING run whose owner tags name process `pid`, started at `started` (epoch seconds)."""
    owner = {
        OWNER_HOST: platform.node(),
        OWNER_PIDNS: os.readlink("/proc/self/ns/pid"),
        OWNER_PID: str(pid),
        OWNER_STARTED: iso_time(started),
    }
    return store.client.create_run(store.experiment_id, run_name=f"owned by {pid}", tags={**owner, **tags}).info.run_id


def _gone_process() -> tuple[int, float]:
    """The pid and start time of a real process that has exited."""
    proc = subprocess.Popen(["sleep", "60"])
    started = psutil.Process(proc.pid).create_time()
    proc.kill()
    proc.wait()
    return proc.pid, started


def test_a_killed_stage_leaves_its_runs_running_until_the_next_pipeline_run_marks_them_killed(
    store: Store, processes: list[subprocess.Popen[str]]
) -> None:
    pid, stage_id = _start([sys.executable, "-c", STAGE], store, processes)
    parent_id = store.client.get_run(stage_id).data.tags["mlflow.parentRunId"]
    os.kill(pid, signal.SIGKILL)
    processes[0].wait()
    assert store.status(stage_id) == store.status(parent_id) == "RUNNING"  # what the issue saw: forever
    assert store.client.get_run(stage_id).data.tags[OWNER_PID] == str(pid)

    with pipeline_run(TrackingConfig(), entry_point="test") as own_id:
        assert store.status(stage_id) == store.status(parent_id) == "KILLED"  # before this run's stages start
        assert store.status(own_id) == "RUNNING"
        assert store.client.get_run(own_id).data.tags[OWNER_PID] == str(os.getpid())
    for run_id in (stage_id, parent_id):  # outside a DVC session a stage process owns its parent run too
        reason = store.reason(run_id)
        assert reason.startswith(f"process {pid} on host {platform.node()} (started ")
        assert f"is gone; marked KILLED by the test pipeline run (pid {os.getpid()}" in reason
    assert store.status(own_id) == "FINISHED"


def test_under_dvc_the_session_parent_belongs_to_the_dvc_process_and_each_run_is_judged_by_its_owner(
    store: Store, processes: list[subprocess.Popen[str]]
) -> None:
    (store.dir / "dvc").write_text(FAKE_DVC)
    stage_pid, stage_id = _start([sys.executable, str(store.dir / "dvc"), "repro", STAGE], store, processes)
    dvc = processes[0]
    parent = store.client.get_run(store.client.get_run(stage_id).data.tags["mlflow.parentRunId"])
    assert parent.data.tags[OWNER_PID] == str(dvc.pid) != str(stage_pid)
    assert parent.data.tags["lockstep.session"].startswith(f"dvc:{dvc.pid}:")

    stage = psutil.Process(stage_pid)
    stage.kill()  # the stage dies, dvc lives on (it may run the next stage)
    stage.wait(timeout=30)  # dvc reaps it
    marked = mark_orphans(store.client, [store.experiment_id], marked_by="test")
    assert [m.run_id for m in marked] == [stage_id]
    assert store.status(parent.info.run_id) == "RUNNING"

    dvc.kill()
    dvc.wait()
    marked = mark_orphans(store.client, [store.experiment_id], marked_by="test")
    assert [m.run_id for m in marked] == [parent.info.run_id]
    assert store.reason(parent.info.run_id).startswith(f"process {dvc.pid} on host ")


def test_runs_whose_process_is_alive_are_left_alone(store: Store, processes: list[subprocess.Popen[str]]) -> None:
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True, text=True)
    processes.append(sleeper)
    other_id = _owned_by(store, sleeper.pid, psutil.Process(sleeper.pid).create_time())
    with (
        pipeline_run(TrackingConfig(), entry_point="test") as parent_id,
        stage_run("train", TrackingConfig(), {}) as stage,
    ):
        judged = {run.run_id: run.verdict for run in orphans.survey(store.client, [store.experiment_id])}
        assert mark_orphans(store.client, [store.experiment_id]) == []
        statuses = {run_id: store.status(run_id) for run_id in (parent_id, stage.run_id, other_id)}
    assert judged == {parent_id: "alive", stage.run_id: "alive", other_id: "alive"}
    assert set(statuses.values()) == {"RUNNING"}
    assert store.status(other_id) == "RUNNING" and store.reason(other_id) is None


def test_a_reused_pid_is_told_apart_by_its_start_time(store: Store) -> None:
    me = psutil.Process()  # alive, and not the process the first run names
    reused = _owned_by(store, me.pid, me.create_time() - 3600)
    mine = _owned_by(store, me.pid, me.create_time() + 0.4)  # within the clock's jitter: the same process
    marked = mark_orphans(store.client, [store.experiment_id], marked_by="test")
    assert [m.run_id for m in marked] == [reused]
    assert f"is gone (pid {me.pid} is now another process, started " in store.reason(reused)
    assert store.status(reused) == "KILLED" and store.status(mine) == "RUNNING"


def test_an_owner_is_told_by_its_start_mark_whatever_the_clock_did(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    me = psutil.Process()
    key = session_key(("process", me))
    # a clock step of 5 s since the run began moves this process's wall-clock start: still its owner
    mine = _owned_by(store, me.pid, me.create_time() - 5, **{OWNER_MARK: start_mark(me)})
    # the wall-clock start matches, but the mark names another process that had this pid
    reused = _owned_by(store, me.pid, me.create_time(), **{OWNER_MARK: "another-boot/1"})
    marked = mark_orphans(store.client, [store.experiment_id], marked_by="test")
    assert [m.run_id for m in marked] == [reused]
    assert store.status(mine) == "RUNNING"
    # a `dvc repro`'s stages share one parent run by this key: a step between two stages keeps it
    pslinux = pytest.importorskip("psutil._pslinux")
    boot = pslinux.boot_time()
    monkeypatch.setattr(pslinux, "boot_time", lambda: boot + 5.0)
    assert session_key(("process", psutil.Process())) == key


def test_runs_it_cannot_check_are_left_alone_unless_older_than_asked(store: Store) -> None:
    pid, started = _gone_process()
    elsewhere = _owned_by(store, pid, started, **{OWNER_HOST: "gpu-07.invalid"})
    other_container = _owned_by(store, pid, started, **{OWNER_PIDNS: "pid:[1]"})
    unowned = store.client.create_run(store.experiment_id, run_name="an older lockstep's").info.run_id
    assert mark_orphans(store.client, [store.experiment_id], older_than_s=3600) == []
    assert {store.status(r) for r in (elsewhere, other_container, unowned)} == {"RUNNING"}

    time.sleep(0.01)
    marked = {m.run_id: m.reason for m in mark_orphans(store.client, [store.experiment_id], older_than_s=0.001)}
    assert set(marked) == {elsewhere, other_container, unowned}
    assert marked[elsewhere].startswith(f"process {pid} on host gpu-07.invalid (started ")
    assert "is on another host: not checked from here; it started " in marked[elsewhere]
    assert "another pid namespace (pid:[1])" in marked[other_container]
    assert marked[unowned].startswith("no owner recorded")
    assert {store.status(r) for r in marked} == {"KILLED"}


def test_a_planted_owner_time_out_of_range_stops_nothing(store: Store) -> None:
    """Anyone who can write runs to a shared store can tag one: a start time that parses but cannot be
    written back in UTC (year 9999 at UTC-14) made the whole sweep fail, leaving every real orphan RUNNING."""
    pid, started = _gone_process()
    orphan = _owned_by(store, pid, started)
    planted = _owned_by(store, pid, started, **{OWNER_HOST: "elsewhere.invalid"})
    store.client.set_tag(planted, OWNER_STARTED, "9999-12-31T23:59:59-14:00")
    assert [m.run_id for m in mark_orphans(store.client, [store.experiment_id], marked_by="test")] == [orphan]
    assert store.status(planted) == "RUNNING"  # another host's, not checked from here
    marked = mark_orphans(store.client, [store.experiment_id], older_than_s=0.001, marked_by="test")
    assert [m.run_id for m in marked] == [planted]
    assert "(started 253402351199 s after 1970 (out of range))" in marked[0].reason, marked[0].reason


def test_the_command_prints_each_run_it_marks_and_a_count(
    store: Store, capsys: pytest.CaptureFixture[str], processes: list[subprocess.Popen[str]]
) -> None:
    pid, started = _gone_process()
    orphan = _owned_by(store, pid, started)
    store.client.create_run(store.experiment_id, run_name="unowned")
    me = psutil.Process()
    _owned_by(store, me.pid, me.create_time())

    assert orphans.main(["--dry-run"]) == 0
    dry = capsys.readouterr().out.splitlines()
    assert dry[0].startswith(f"would mark KILLED {orphan} (owned by {pid}): process {pid} on host ")
    assert dry[1:] == [
        "1 orphaned run(s) would be marked KILLED",
        "left RUNNING: 1 with a live owner, 1 without owner tags (see --older-than)",
    ]
    assert store.status(orphan) == "RUNNING"

    done = subprocess.run(
        [sys.executable, "-m", "tasks.tracking.orphans", "--experiment", "lockstep"],
        cwd=store.dir,
        env=subprocess_env(MLFLOW_TRACKING_URI=store.uri, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"KILLED {orphan} (owned by {pid}): process {pid} on host {platform.node()} (started ")
    assert "is gone; marked KILLED by python -m tasks.tracking.orphans (pid " in lines[0]
    assert lines[1] == "1 orphaned run(s) marked KILLED"
    assert store.status(orphan) == "KILLED" and store.reason(orphan) in lines[0]
    tags = store.client.get_run(orphan).data.tags  # what the MLflow UI shows: the reason as tag and description
    assert tags["mlflow.note.content"] == f"Marked KILLED: {store.reason(orphan)}"

    assert orphans.main([]) == 0  # nothing left to mark
    assert capsys.readouterr().out.splitlines()[0] == "0 orphaned run(s) marked KILLED"


def test_a_run_deleted_meanwhile_or_a_failing_store_is_a_warning_not_a_failed_pipeline(
    store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pid, started = _gone_process()
    deleted, ended, kept = (_owned_by(store, pid, started) for _ in range(3))
    client = store.client
    searched = client.search_runs

    def search_then_change(*args: Any, **kwargs: Any) -> Any:
        page = searched(*args, **kwargs)
        client.delete_run(deleted)  # another user deletes it while the sweep runs
        client.set_terminated(ended, "FINISHED")  # (say, a run that a later stage resumed and ended)
        return page

    monkeypatch.setattr(client, "search_runs", search_then_change)
    with caplog.at_level(logging.WARNING, logger="tasks"):
        marked = mark_orphans(client, [store.experiment_id])
    assert [m.run_id for m in marked] == [kept]
    assert f"orphaned run {deleted} (owned by {pid}) not marked KILLED: " in caplog.text
    assert store.status(ended) == "FINISHED" and store.reason(ended) is None

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("database is locked")

    monkeypatch.setattr(orphans, "mark_orphans", broken)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tasks"), pipeline_run(TrackingConfig(), "test") as run_id:
        pass
    assert store.status(run_id) == "FINISHED"
    assert "orphaned runs not checked: database is locked" in caplog.text


def test_reproduce_marks_orphans_before_it_starts(store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    from tasks.tools import reproduce

    pid, started = _gone_process()
    orphan = _owned_by(store, pid, started)
    assert reproduce.main(["0" * 32]) == 3  # no such run: refused, after the sweep
    assert "marked KILLED by python -m tasks.tools.reproduce (pid " in store.reason(orphan)


def test_the_command_reads_the_store_lockstep_tracks_into(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert orphans.default_store() == tracking_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5555")
    assert orphans.default_store() == tracking_uri()
    assert orphans.parse_age("7d") == 7 * 86400 and orphans.parse_age("90m") == 5400


def test_a_killed_process_not_yet_reaped_counts_as_gone(store: Store, processes: list[subprocess.Popen[str]]) -> None:
    zombie = subprocess.Popen(["sleep", "60"], start_new_session=True, text=True)
    processes.append(zombie)  # reaped at the end
    orphan = _owned_by(store, zombie.pid, psutil.Process(zombie.pid).create_time())
    os.kill(zombie.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [m.run_id for m in mark_orphans(store.client, [store.experiment_id])] == [orphan]
    assert f"process {zombie.pid} on host " in store.reason(orphan) and "has exited (a zombie)" in store.reason(orphan)


def test_runs_of_another_host_whose_prefect_flow_run_is_over_are_marked_killed(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer that lost its link: its runs (the pipeline's parent, tagged with its flow run, and a
    stage run under it) are marked once the Prefect server holds that flow run as Crashed; another
    host's run whose flow run is still Running, or that Prefect does not know, is left alone."""
    import json
    import threading
    import uuid
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    crashed, running, unknown = (str(uuid.uuid4()) for _ in range(3))
    states = {crashed: ("CRASHED", "Crashed", "no heartbeat for 90 s"), running: ("RUNNING", "Running", "")}
    asked: list[tuple[str, str | None]] = []

    class Prefect(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            flow_run = self.path.rsplit("/", 1)[-1]
            asked.append((flow_run, self.headers.get("Authorization")))
            if flow_run not in states:
                self.send_response(404)
                self.end_headers()
                return
            kind, name, message = states[flow_run]
            body = json.dumps({"id": flow_run, "state": {"type": kind, "name": name, "message": message}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Prefect)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{server.server_address[1]}/api")
        monkeypatch.setenv("PREFECT_API_AUTH_STRING", "lockstep:secret")
        far = {OWNER_HOST: "trainer-a.invalid"}
        pid, started = _gone_process()
        parent = _owned_by(store, pid, started, **far, **{orphans.FLOW_RUN_TAG: crashed})
        child = _owned_by(store, pid, started, **far, **{orphans.PARENT_TAG: parent})
        alive = _owned_by(store, pid, started, **far, **{orphans.FLOW_RUN_TAG: running})
        forgotten = _owned_by(store, pid, started, **far, **{orphans.FLOW_RUN_TAG: unknown})
        marked = {m.run_id: m.reason for m in mark_orphans(store.client, [store.experiment_id])}
    finally:
        server.shutdown()
    assert set(marked) == {parent, child}
    assert marked[parent].startswith(f"process {pid} on host trainer-a.invalid (started ")
    assert f"ran Prefect flow run {crashed}, which is Crashed on the server (no heartbeat for 90 s)" in marked[child]
    assert {store.status(r) for r in (parent, child)} == {"KILLED"}
    assert {store.status(r) for r in (alive, forgotten)} == {"RUNNING"}
    assert sorted(flow_run for flow_run, _ in asked) == sorted([crashed, running, unknown])  # once each
    assert {auth for _, auth in asked} == {"Basic bG9ja3N0ZXA6c2VjcmV0"}
