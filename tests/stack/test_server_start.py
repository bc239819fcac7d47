"""A stack server that will not start says why where the user reads it: the error names the server and
its log, and carries the log's last lines (secrets masked), since a test's or a container's folder may
be gone before anyone opens the log."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stack import servers
from stack.servers import Daemon
from stack.state import Stack, StackError

LAST_WORDS = "bind: address already in use (port 18333)"


class Failing(Daemon):
    """A server that writes its last words (and a URL with a password) to its log, then exits."""

    name = "failing"

    def command(self) -> list[str]:
        script = f"print('starting'); print('postgresql://lockstep:hunter2@db/mlflow'); print({LAST_WORDS!r}); exit(1)"
        return [sys.executable, "-c", script]

    def ready(self) -> bool:
        return False


class Silent(Failing):
    """A server that logs and then runs without ever answering."""

    name = "silent"

    def command(self) -> list[str]:
        return [sys.executable, "-c", f"print({LAST_WORDS!r}, flush=True); import time; time.sleep(60)"]


def _stack(tmp_path: Path) -> Stack:
    return Stack(tmp_path / ".stack", "127.0.0.1", {})


def test_a_server_that_exits_is_reported_with_its_logs_last_lines_secrets_masked(tmp_path: Path) -> None:
    with pytest.raises(StackError) as raised:
        Failing(_stack(tmp_path)).start()
    message = str(raised.value)
    assert message.startswith("failing: the server exited before it answered")
    assert f"log: {tmp_path / '.stack' / 'logs' / 'failing.log'}" in message
    assert message.rstrip().endswith(LAST_WORDS) and "postgresql://***@db/mlflow" in message
    assert "hunter2" not in message


def test_a_server_that_never_answers_is_stopped_waiting_for_with_its_logs_last_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(servers, "START_TIMEOUT_S", 2)
    silent = Silent(_stack(tmp_path))
    try:
        with pytest.raises(StackError, match="silent: the server did not answer within 2 s") as raised:
            silent.start()
        assert str(raised.value).rstrip().endswith(LAST_WORDS)
    finally:
        silent.stop()
    assert not silent.running()
