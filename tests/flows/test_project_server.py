"""The project's running Prefect server (`make schedule`'s), found by `make run` and `make sweep` instead
of starting one of their own (flows/project_server.py), and every record of one that must not be used.

The record is refused without a byte sent to the address it names unless the process table shows that
PID's `prefect server start` listening there: the auth string goes to that server or nowhere. The
refusals are checked in this process against real processes and sockets; the run against a real
`make schedule` server is the slow test at the end.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import psutil
import pytest

from flows import project_server
from flows.local_server import AUTH_FILE
from tests.conftest import ROOT, free_port, run, seed_prefect_home, stop_group, subprocess_env
from tests.support.prefect_client import PrefectAPI

AUTH = "lockstep:not-a-real-secret"

# A stand-in for `prefect server start --port PORT` (argv: address, port, status, body; its command line
# carries the words): answers every GET with that status and body and appends each Authorization header
# it is sent to the file named by $SEEN.
FAKE_SERVER = """
import http.server, os, socket, sys
address, port, status, body = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].encode()

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        with open(os.environ["SEEN"], "a") as seen:
            seen.write(self.headers.get("Authorization", "") + "\\n")
        self.send_response(status)
        if status == 302:
            self.send_header("Location", "http://127.0.0.1:9/elsewhere")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

class Server(http.server.HTTPServer):
    address_family = socket.AF_INET6 if ":" in address else socket.AF_INET

Server((address, port), Handler).serve_forever()
"""


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "prefect"
    home.mkdir()
    (home / AUTH_FILE).write_text(AUTH + "\n")
    return home


@dataclass
class Fake:
    """A running FAKE_SERVER: its process and port, and the Authorization headers it was sent."""

    process: subprocess.Popen[bytes]
    port: int
    seen_file: Path

    @property
    def seen(self) -> list[str]:
        return self.seen_file.read_text().splitlines() if self.seen_file.exists() else []


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[Callable[..., Fake]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(address: str = "127.0.0.1", status: int = 200, body: str = "") -> Fake:
        port, seen = free_port(), tmp_path / f"seen-{len(started)}"
        body = body or json.dumps(version("prefect"))
        command = [sys.executable, "-c", FAKE_SERVER, address, str(port), str(status), body]
        process = subprocess.Popen(
            [*command, "prefect", "server", "start", "--port", str(port)], env={**os.environ, "SEEN": str(seen)}
        )
        started.append(process)
        deadline = time.monotonic() + 30
        while not [
            c for c in psutil.net_connections("inet") if c.pid == process.pid and c.status == psutil.CONN_LISTEN
        ]:
            assert process.poll() is None and time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.05)
        return Fake(process, port, seen)

    yield start
    for process in started:
        process.kill()
        process.wait()


def _write(home: Path, **entry: object) -> None:
    """A record for `entry`'s process (this test's by default), as `record` writes one."""
    pid = entry.get("pid", os.getpid())
    defaults = {"address": "127.0.0.1", "port": 4200, "prefect": version("prefect")}
    started = psutil.Process(pid).create_time() if psutil.pid_exists(pid) else 1.0
    (home / project_server.RECORD_FILE).write_text(json.dumps({**defaults, "pid": pid, "started": started, **entry}))


def _refused(home: Path, caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> str:
    with caplog.at_level(logging.INFO, logger="flows.project_server"):
        assert project_server.find(home) is None
    (record,) = [r for r in caplog.records if r.name == "flows.project_server"]
    assert record.levelno == level and str(home / project_server.RECORD_FILE) in record.getMessage(), record
    assert "starting a Prefect server for this run" in record.getMessage()
    return record.getMessage()


def test_no_record_is_no_server_and_says_nothing(home: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="flows.project_server"):
        assert project_server.find(home) is None
    assert not caplog.records


def test_the_recorded_prefect_server_gets_the_string_once_and_is_used(
    home: Path, fake: Callable[..., Fake], caplog: pytest.LogCaptureFixture
) -> None:
    for address in ("127.0.0.1", "::1"):
        server = fake(address)
        _write(home, address=address, port=server.port, pid=server.process.pid)
        host = f"[{address}]" if ":" in address else address
        assert project_server.find(home) == (f"http://{host}:{server.port}/api", AUTH)
        assert server.seen == [f"Basic {base64.b64encode(AUTH.encode()).decode()}"]
    assert not caplog.records


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{not json", "not readable as JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"address": "127.0.0.1", "port": 4200, "pid": "12", "started": 1.0}', "positive integers"),
        ('{"address": "127.0.0.1", "port": 4200, "pid": true, "started": 1.0}', "positive integers"),
        ('{"address": "127.0.0.1", "port": 99999, "pid": 12, "started": 1.0}', "positive integers"),
        ('{"address": "127.0.0.1", "port": "abc", "pid": 12, "started": 1.0}', "positive integers"),
        ("{" + " " * project_server.MAX_RECORD_BYTES + "}", f"larger than {project_server.MAX_RECORD_BYTES} bytes"),
    ],
)
def test_a_record_that_is_not_ours_is_refused_naming_the_file(
    home: Path, caplog: pytest.LogCaptureFixture, content: str, reason: str
) -> None:
    (home / project_server.RECORD_FILE).write_text(content)
    assert reason in _refused(home, caplog)


@pytest.mark.parametrize("kind", ["fifo", "link", "auth link"])
def test_a_record_that_is_not_a_regular_file_is_refused_without_blocking(
    home: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    path = home / project_server.RECORD_FILE
    if kind == "fifo":
        os.mkfifo(path)  # a read would wait for a writer forever
    elif kind == "link":
        path.symlink_to("/dev/zero")  # whose size is 0 and whose read never ends
    else:
        (home / AUTH_FILE).unlink()
        (home / AUTH_FILE).symlink_to("/dev/zero")
        _write(home)
    reason = _refused(home, caplog)
    assert {"fifo": "is not a regular file", "link": "symbolic links", "auth link": "symbolic links"}[kind] in reason


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("10.20.30.40", "is not 127.0.0.1 or ::1"),  # another machine: PREFECT_API_URL's job
        ("localhost", "is not 127.0.0.1 or ::1"),  # a name a resolver answers, not an address
        ("127.0.0.1@10.20.30.40", "is not 127.0.0.1 or ::1"),
        ("127.0.0.1\t", "is not 127.0.0.1 or ::1"),
    ],
)
def test_only_a_loopback_address_is_taken_and_nothing_is_sent_elsewhere(
    home: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, address: str, reason: str
) -> None:
    def no_connection(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a connection was made: {args}")

    monkeypatch.setattr(project_server.http.client, "HTTPConnection", no_connection)
    _write(home, address=address)
    assert reason in _refused(home, caplog)


def test_a_server_of_another_prefect_version_is_not_used(home: Path, caplog: pytest.LogCaptureFixture) -> None:
    _write(home, prefect="2.20.0")
    assert f"the server runs Prefect 2.20.0, this environment {version('prefect')}" in _refused(home, caplog)


def test_a_server_that_stopped_is_passed_over_quietly_even_if_its_pid_was_reused(
    home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    _write(home, pid=gone.pid)
    assert f"its server (process {gone.pid}) is gone" in _refused(home, caplog, level=logging.INFO)
    caplog.clear()
    _write(home, started=psutil.Process().create_time() - 60)  # this PID, but a process started earlier
    assert "the PID is another process's now" in _refused(home, caplog, level=logging.INFO)


def test_the_string_goes_to_no_process_but_a_prefect_server_listening_where_recorded(
    home: Path, caplog: pytest.LogCaptureFixture, fake: Callable[..., Fake]
) -> None:
    server = fake("127.0.0.1")
    cases = {  # record -> why it is refused
        "this test's process: alive, but no Prefect server": (
            {"port": server.port, "pid": os.getpid()},
            f"process {os.getpid()} is not `prefect server start --port {server.port}`",
        ),
        "the server, named on the other loopback address": (
            {"address": "::1", "port": server.port, "pid": server.process.pid},
            f"does not listen on ::1 port {server.port}",
        ),
        "the server, named with another port": (
            {"port": server.port + 1, "pid": server.process.pid},
            f"is not `prefect server start --port {server.port + 1}`",
        ),
    }
    for entry, reason in cases.values():
        caplog.clear()
        _write(home, **entry)
        assert reason in _refused(home, caplog)
    assert server.seen == []  # none of them was sent anything, the auth string least of all


@pytest.mark.parametrize(
    ("status", "body", "reason"),
    [
        (200, '"nope"', "not Prefect"),  # a process that answers, but not Prefect
        (302, "", "answered HTTP 302"),  # a redirect is not followed (urllib would carry the header along)
        (401, "", "refused the string in api-auth"),  # a string of the user's own
    ],
)
def test_a_server_that_does_not_answer_as_this_prefect_is_not_used(
    home: Path, caplog: pytest.LogCaptureFixture, fake: Callable[..., Fake], status: int, body: str, reason: str
) -> None:
    server = fake("127.0.0.1", status, body)
    _write(home, port=server.port, pid=server.process.pid)
    assert reason in _refused(home, caplog)
    assert len(server.seen) == 1  # asked once, at the recorded port, not at the redirect's


def test_with_a_proxy_set_the_string_is_not_sent(
    home: Path, caplog: pytest.LogCaptureFixture, fake: Callable[..., Fake], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = fake("127.0.0.1")
    _write(home, port=server.port, pid=server.process.pid)
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    assert "a proxy is set (http_proxy)" in _refused(home, caplog)
    assert server.seen == []


def test_without_the_projects_auth_string_nothing_is_asked(home: Path, caplog: pytest.LogCaptureFixture) -> None:
    _write(home)
    (home / AUTH_FILE).unlink()
    assert f"{home / AUTH_FILE}: No such file or directory" in _refused(home, caplog)


def test_the_record_names_the_loopback_address_and_is_removed_only_by_its_server(home: Path) -> None:
    pid = os.getpid()
    project_server.record(home, "0.0.0.0", 4321, pid, AUTH)  # a server bound to every address: reached on loopback
    path = home / project_server.RECORD_FILE
    assert json.loads(path.read_text()) == {
        "address": "127.0.0.1",
        "port": 4321,
        "pid": pid,
        "started": psutil.Process().create_time(),
        "prefect": version("prefect"),
    }
    project_server.forget(home, pid + 1)  # another server's stop leaves this one's record
    assert path.exists()
    project_server.forget(home, pid)
    assert not path.exists()
    project_server.record(home, "192.0.2.7", 4321, pid, AUTH)  # a non-loopback address only: not recorded
    project_server.record(home, "127.0.0.1", 4321, pid, "me:my-own")  # a string the commands do not know
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
from prefect.settings import PREFECT_API_URL, get_current_settings
from flows import prefect_env

@flow
def probe():
    return str(flow_run.id), get_current_settings().flows.heartbeat_frequency

with prefect_env.local_api() as own_server:
    run_id, heartbeat = probe()
    print("RAN", run_id, PREFECT_API_URL.value(), "OWN", own_server, "HEARTBEAT", heartbeat)
"""


@pytest.mark.slow
def test_make_run_reports_to_the_running_make_schedule_server_which_takes_its_record_when_stopped(
    tmp_path: Path, prefect_database: Path
) -> None:
    home = seed_prefect_home(tmp_path / "prefect", prefect_database)
    port, output = free_port(), tmp_path / "serve.log"
    with open(output, "wb") as log:  # a file, not a pipe that a chatty server could fill
        serving = subprocess.Popen(
            [sys.executable, "-c", SERVE, str(port)],
            cwd=ROOT,
            env=subprocess_env(PREFECT_HOME=str(home)),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while "UP " not in output.read_text():
            assert serving.poll() is None and time.monotonic() < deadline, output.read_text()[-3000:]
            time.sleep(0.2)
        entry = json.loads((home / project_server.RECORD_FILE).read_text())
        assert (entry["address"], entry["port"]) == ("127.0.0.1", port), entry
        began = time.monotonic()
        ran = run([sys.executable, "-c", PROBE], ROOT, PREFECT_HOME=str(home)).stdout.split()
        probe_s = time.monotonic() - began
        # no server of its own, and no heartbeats, which no automation on this server watches
        assert ran[2:] == [f"http://127.0.0.1:{port}/api", "OWN", "False", "HEARTBEAT", "None"], ran
        api = PrefectAPI(f"http://127.0.0.1:{port}/api", (home / AUTH_FILE).read_text().strip())
        assert api(f"/flow_runs/{ran[1]}")["state_type"] == "COMPLETED"  # the run is on the schedule's server
        print(f"a flow run against the running server: {probe_s:.1f} s")
    finally:
        stop_group(serving)  # as Ctrl-C reaches `make schedule`
    # the stopped server took its record with it (a run without one starts its own: the tests above)
    assert not (home / project_server.RECORD_FILE).exists()
