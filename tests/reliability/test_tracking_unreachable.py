"""An MLflow tracking server that is down, failing or hanging: the pipeline fails within 10 s, before
training, with a one-line message naming the URI."""

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

from tests.conftest import free_port, run, write_params
from tests.reliability.conftest import Trained, clone, digests, one_line_error

pytestmark = pytest.mark.slow


class _Failing(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(500)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _server(kind: str) -> Iterator[str]:
    """The URI of a tracking "server": nothing listening, one answering 500, or one that never answers."""
    if kind == "refused":
        yield f"http://127.0.0.1:{free_port()}"
        return
    if kind == "500":
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
        return
    with socket.socket() as sock:  # the kernel completes connections in the backlog; nobody ever answers
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def project(trained: Trained, tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = clone(trained, tmp_path_factory.mktemp("tracking") / "repo")
    write_params(repo / "params.yaml", {"tracking": {"enabled": True}}, base=repo / "params.yaml")
    return repo


@pytest.mark.parametrize("entry", [["flows.pipeline"], ["tasks", "train"]], ids=["make-run", "dvc-stage"])
@pytest.mark.parametrize("kind", ["refused", "500", "hanging"])
def test_the_pipeline_fails_fast_naming_the_uri(project: Path, trained: Trained, kind: str, entry: list[str]) -> None:
    with _server(kind) as uri:
        started = time.monotonic()
        done = run(
            [sys.executable, "-m", *entry, "--force"]
            if entry == ["flows.pipeline"]
            else [sys.executable, "-m", *entry],
            project,
            check=False,
            MLFLOW_TRACKING_URI=uri,
        )
        elapsed = time.monotonic() - started
    error = one_line_error(done)
    # Seconds, where MLflow's own retries took minutes (249 s): the bound leaves room for the
    # command's start-up on a loaded 2-core machine (the tests run two at a time).
    assert elapsed < 30, f"{elapsed:.1f} s"
    assert f"MLflow tracking server {uri} (MLFLOW_TRACKING_URI)" in error, error
    assert {"refused": "connection refused", "500": "answered HTTP 500", "hanging": "no answer within"}[kind] in error
    assert digests(project) == trained.digests  # nothing ran: no stage, no training


def test_credentials_in_the_uri_are_not_shown(project: Path) -> None:
    uri = f"http://lockstep:hunter2-secret@127.0.0.1:{free_port()}"
    error = one_line_error(run([sys.executable, "-m", "tasks", "train"], project, check=False, MLFLOW_TRACKING_URI=uri))
    assert "hunter2-secret" not in error and "http://***@127.0.0.1" in error, error
