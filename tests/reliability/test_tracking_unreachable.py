"""An MLflow tracking server that is down, failing or hanging: the pipeline fails seconds after its one
request to it, before training, with a one-line message naming the URI."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tasks.tracking.store import CHECK_TIMEOUT_S
from tests.conftest import free_port, run, write_params
from tests.reliability.conftest import Trained, clone, digests
from tests.support.cli_errors import one_line_error

pytestmark = pytest.mark.slow


class _Failing(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.reached.append(time.monotonic())  # type: ignore[attr-defined]
        self.send_response(500)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _server(kind: str) -> Iterator[tuple[str, list[float]]]:
    """The URI of a tracking "server" (nothing listening, one answering 500, or one that never answers)
    and when the command first reached it (`time.monotonic()`; stays empty where nothing listens)."""
    reached: list[float] = []
    if kind == "refused":
        yield f"http://127.0.0.1:{free_port()}", reached
        return
    if kind == "500":
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
        server.reached = reached  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}", reached
        finally:
            server.shutdown()
        return
    with socket.socket() as sock:  # connections are accepted and held open; nobody ever answers
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        sock.settimeout(0.2)
        held: list[socket.socket] = []
        done = threading.Event()

        def hold() -> None:
            while not done.is_set():
                try:
                    held.append(sock.accept()[0])
                except TimeoutError:
                    continue
                reached.append(time.monotonic())

        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}", reached
        finally:
            done.set()
            holder.join()
            for conn in held:
                conn.close()


@pytest.fixture(scope="module")
def project(trained: Trained, tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = clone(trained, tmp_path_factory.mktemp("tracking") / "repo")
    write_params(repo / "params.yaml", {"tracking": {"enabled": True}}, base=repo / "params.yaml")
    return repo


@pytest.mark.parametrize("entry", [["flows.pipeline"], ["tasks", "train"]], ids=["make-run", "dvc-stage"])
@pytest.mark.parametrize("kind", ["refused", "500", "hanging"])
def test_the_pipeline_fails_fast_naming_the_uri(project: Path, trained: Trained, kind: str, entry: list[str]) -> None:
    with _server(kind) as (uri, reached):
        started = time.monotonic()
        done = run(
            [sys.executable, "-m", *entry, "--force"]
            if entry == ["flows.pipeline"]
            else [sys.executable, "-m", *entry],
            project,
            check=False,
            MLFLOW_TRACKING_URI=uri,
        )
        ended = time.monotonic()
    error = one_line_error(done)
    # From its first request to the store, the command gives up within the check's timeout (and its
    # exit), where MLflow's own retries took minutes (249 s). Before that request comes the command's
    # start-up: imports, which on a loaded 2-core machine take tens of seconds (31 s once, beside the
    # full tier's other workers), so the whole run only gets a loose bound.
    if kind != "refused":  # (nothing listens there to see the request)
        assert len(reached) == 1, reached  # one request: no retries
        assert ended - reached[0] < CHECK_TIMEOUT_S + 10, f"{ended - reached[0]:.1f} s after its request"
    assert ended - started < 90, f"{ended - started:.1f} s"
    assert f"MLflow tracking server {uri} (MLFLOW_TRACKING_URI)" in error, error
    assert {"refused": "connection refused", "500": "answered HTTP 500", "hanging": "no answer within"}[kind] in error
    assert digests(project) == trained.digests  # nothing ran: no stage, no training


def test_credentials_in_the_uri_are_not_shown(project: Path) -> None:
    uri = f"http://lockstep:hunter2-secret@127.0.0.1:{free_port()}"
    error = one_line_error(run([sys.executable, "-m", "tasks", "train"], project, check=False, MLFLOW_TRACKING_URI=uri))
    assert "hunter2-secret" not in error and "http://***@127.0.0.1" in error, error
