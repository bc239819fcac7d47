"""The stack finds (`running`) and stops its own servers by the pid files it wrote, also after the
clock stepped: on a CI machine a 5 s step once made the stack take its MLflow server for a stranger,
so `stop` left it running and every later test of the object store failed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import pytest

from stack.servers import Daemon
from stack.state import Stack


class Sleeper(Daemon):
    """A server that answers as soon as it runs."""

    name = "sleeper"

    def command(self) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(120)"]

    def ready(self) -> bool:
        return True


def test_a_server_is_found_and_stopped_by_its_pid_file_after_the_clock_stepped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sleeper = Sleeper(Stack(tmp_path / ".stack", "127.0.0.1", {}))
    sleeper.start()
    try:
        saved = json.loads(sleeper.pidfile.read_text())
        pid = saved["pid"]
        pslinux = pytest.importorskip("psutil._pslinux")
        boot = pslinux.boot_time()
        monkeypatch.setattr(pslinux, "boot_time", lambda: boot + 5.0)  # every wall-clock start moves 5 s
        assert psutil.Process(pid).create_time() == pytest.approx(saved["started"] + 5)
        assert sleeper.running()
        sleeper.stop()
        assert not psutil.pid_exists(pid) and not sleeper.pidfile.exists()
    finally:
        monkeypatch.undo()
        sleeper.stop()


def test_a_pid_file_naming_another_process_is_not_the_server(tmp_path: Path) -> None:
    sleeper = Sleeper(Stack(tmp_path / ".stack", "127.0.0.1", {}))
    sleeper.stack.pids.mkdir(parents=True)
    me = psutil.Process()  # this pid runs, but it is not the server the file was written for
    sleeper.pidfile.write_text(json.dumps({"pid": me.pid, "started": me.create_time(), "mark": "another-boot/1"}))
    assert not sleeper.running()
    sleeper.stop()  # leaves this process alone, forgets the file
    assert me.is_running() and not sleeper.pidfile.exists()
