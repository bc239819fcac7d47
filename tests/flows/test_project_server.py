"""The project's running Prefect server (`make schedule`'s), found by `make run` and `make sweep` instead
of starting one of their own (flows/project_server.py), and every record of one that must not be used.

The record is refused without a byte sent to the address it names unless the process table shows that
PID's `prefect server start` listening there: the auth string goes to that server or nowhere. The
refusals are checked in this process against real processes and sockets; the run against a real
`make schedule` server is the slow test at the end.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import psutil
import pytest

from flows import project_server
from flows.prefect_env import AUTH_FILE
from tests.conftest import ROOT, free_port, run, seed_prefect_home, stop_group, subprocess_env
from tests.support.prefect_client import PrefectAPI

AUTH = "lockstep:not-a-real-secret"


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "prefect"
    home.mkdir()
    (home / AUTH_FILE).write_text(AUTH + "\n")
    return home


@pytest.fixture
def listener() -> Iterator[tuple[int, list[str]]]:
    """An HTTP server on a loopback port in this process (this test's PID, not a Prefect server's):
    (its port, the Authorization headers it was sent)."""
    seen: list[str] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization", ""))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


def _write(home: Path, **state: object) -> None:
    record = {"api_url": "http://127.0.0.1:4200/api", "pid": os.getpid(), "prefect": version("prefect"), **state}
    (home / project_server.STATE_FILE).write_text(json.dumps(record))


def _refused(home: Path, caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> str:
    with caplog.at_level(logging.INFO, logger="flows.project_server"):
        assert project_server.find(home, home / AUTH_FILE) is None
    (record,) = [r for r in caplog.records if r.name == "flows.project_server"]
    assert record.levelno == level and str(home / project_server.STATE_FILE) in record.getMessage(), record
    assert "starting a Prefect server for this run" in record.getMessage()
    return record.getMessage()


def test_no_record_is_no_server_and_says_nothing(home: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="flows.project_server"):
        assert project_server.find(home, home / AUTH_FILE) is None
    assert not caplog.records


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{not json", "not readable as JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"api_url": "http://127.0.0.1:4200/api", "pid": "12"}), "pid (a positive integer)"),
        (json.dumps({"api_url": "http://127.0.0.1:4200/api", "pid": True}), "pid (a positive integer)"),
        ("{" + " " * project_server.MAX_STATE_BYTES + "}", f"larger than {project_server.MAX_STATE_BYTES} bytes"),
    ],
)
def test_a_record_that_is_not_ours_is_refused_naming_the_file(
    home: Path, caplog: pytest.LogCaptureFixture, content: str, reason: str
) -> None:
    (home / project_server.STATE_FILE).write_text(content)
    assert reason in _refused(home, caplog)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://10.20.30.40:4200/api", "is not http://127.0.0.1:PORT/api"),  # another machine: PREFECT_API_URL's job
        ("https://127.0.0.1:4200/api", "is not http://127.0.0.1:PORT/api"),
        ("http://127.0.0.1/api", "is not http://127.0.0.1:PORT/api"),
        ("http://127.0.0.1:4200/elsewhere", "is not http://127.0.0.1:PORT/api"),
    ],
)
def test_only_a_loopback_api_url_is_taken_and_nothing_is_sent_elsewhere(
    home: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, url: str, reason: str
) -> None:
    def no_request(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a request was sent: {args}")

    monkeypatch.setattr(project_server.urllib.request, "urlopen", no_request)
    _write(home, api_url=url)
    assert reason in _refused(home, caplog)


def test_a_server_of_another_prefect_version_is_not_used(home: Path, caplog: pytest.LogCaptureFixture) -> None:
    _write(home, prefect="2.20.0")
    assert f"the server runs Prefect 2.20.0, this environment {version('prefect')}" in _refused(home, caplog)


def test_a_server_that_stopped_is_passed_over_quietly(home: Path, caplog: pytest.LogCaptureFixture) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    _write(home, pid=gone.pid)
    assert f"its server (process {gone.pid}) is gone" in _refused(home, caplog, level=logging.INFO)


def test_the_auth_string_goes_to_no_process_but_the_recorded_prefect_server(
    home: Path, caplog: pytest.LogCaptureFixture, listener: tuple[int, list[str]]
) -> None:
    port, seen = listener
    # this test's own process answers on the port: alive, listening, but not a Prefect server
    _write(home, api_url=f"http://127.0.0.1:{port}/api", pid=os.getpid())
    assert f"process {os.getpid()} is not a Prefect server" in _refused(home, caplog)
    caplog.clear()
    # a `prefect server start` that is not the one listening there
    impostor = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "prefect", "server", "start", "--port", str(port)]
    )
    try:
        while "prefect" not in psutil.Process(impostor.pid).cmdline():  # (exec'd: its own command line, not ours)
            time.sleep(0.01)
        _write(home, api_url=f"http://127.0.0.1:{port}/api", pid=impostor.pid)
        assert f"process {impostor.pid} does not listen on port {port}" in _refused(home, caplog)
    finally:
        impostor.kill()
        impostor.wait()
    assert seen == []  # neither was sent anything, the auth string least of all


def test_without_the_projects_auth_string_nothing_is_asked(home: Path, caplog: pytest.LogCaptureFixture) -> None:
    _write(home)
    (home / AUTH_FILE).unlink()
    assert "no auth string to send it" in _refused(home, caplog)


def test_the_record_names_the_loopback_url_and_is_removed_only_by_its_server(home: Path) -> None:
    project_server.record(home, "0.0.0.0", 4321, 1234)  # a server bound to every address: reached on loopback
    path = home / project_server.STATE_FILE
    assert json.loads(path.read_text()) == {
        "api_url": "http://127.0.0.1:4321/api",
        "pid": 1234,
        "prefect": version("prefect"),
    }
    project_server.forget(home, 999)  # another server's stop leaves this one's record
    assert path.exists()
    project_server.forget(home, 1234)
    assert not path.exists()
    project_server.record(home, "192.0.2.7", 4321, 1234)  # only another machine's address: not recorded
    assert not path.exists()


# `make schedule`'s server without its deployment: flows/deployments.py `local_server`, which records it.
# SIGTERM ends the block as it ends Prefect's `serve` there (which then returns).
SERVE = """
import signal, sys, time
from flows import prefect_settings
prefect_settings.configure()
from flows.deployments import local_server
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
with local_server("127.0.0.1", int(sys.argv[1])) as server:
    print("UP", server.api_url, flush=True)
    time.sleep(600)
"""

# A flow run as `make run` starts one (flows/prefect_env.py `local_api`): which server it reported to.
PROBE = """
from flows import prefect_settings
prefect_settings.configure()
from prefect import flow
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL
from flows import prefect_env

@flow
def probe():
    return str(flow_run.id)

with prefect_env.local_api() as own_server:
    print("RAN", probe(), PREFECT_API_URL.value(), "OWN", own_server)
"""


@pytest.mark.slow
def test_make_run_reports_to_the_running_make_schedule_server_which_takes_its_record_when_stopped(
    tmp_path: Path, prefect_database: Path
) -> None:
    home = seed_prefect_home(tmp_path / "prefect", prefect_database)
    port = free_port()
    serving = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(port)],
        cwd=ROOT,
        env=subprocess_env(PREFECT_HOME=str(home)),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert serving.stdout is not None
        line = ""
        while not line.startswith("UP"):  # after the server's own banner
            line = serving.stdout.readline()
            assert line, "the serving process ended before its server answered"
        assert line.split() == ["UP", f"http://127.0.0.1:{port}/api"]
        assert json.loads((home / project_server.STATE_FILE).read_text())["api_url"] == f"http://127.0.0.1:{port}/api"
        began = time.monotonic()
        ran = run([sys.executable, "-c", PROBE], ROOT, PREFECT_HOME=str(home)).stdout.split()
        probe_s = time.monotonic() - began
        assert ran[2:] == [f"http://127.0.0.1:{port}/api", "OWN", "False"], ran  # no server of its own
        api = PrefectAPI(f"http://127.0.0.1:{port}/api", (home / AUTH_FILE).read_text().strip())
        assert api(f"/flow_runs/{ran[1]}")["state_type"] == "COMPLETED"  # the run is on the schedule's server
        print(f"a flow run against the running server: {probe_s:.1f} s")
    finally:
        stop_group(serving)  # as Ctrl-C reaches `make schedule`
    # the stopped server took its record with it (a run without one starts its own: the tests above)
    assert not (home / project_server.STATE_FILE).exists()
