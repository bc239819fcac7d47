"""A Prefect server kept for the project's next runs (flows/kept_server.py): the first run without a server
starts a keeper, the next reports to its server, `python -m flows.kept_server stop` waits for the runs using
it, and unused it stops by itself. Real runs in processes of their own, as `make run` starts them, and a real
keeper and server."""

from __future__ import annotations

import fcntl
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import psutil
import pytest

from flows.kept_server import IDLE_ENV, IN_USE, KEEPER_LOCK, idle_s
from flows.project_server import RECORD_FILE
from tests.conftest import ROOT, run, seed_prefect_home, subprocess_env

# A flow run as `make run` starts one (flows/prefect_env.py `local_api`): which server it reported to.
RUN = """
from flows import prefect_settings
prefect_settings.configure()
from prefect import flow
from prefect.settings import get_current_settings
from flows import prefect_env

@flow
def probe():
    return 1

with prefect_env.local_api() as own_server:
    state = probe(return_state=True)
    print("OWN", own_server, "URL", get_current_settings().api.url, "STATE", state.type.value)
"""
SECRET = "tok-kept-server-test-0123456789"


def _run(home: Path, keep_s: float) -> tuple[dict[str, str], str, float]:
    began = time.monotonic()
    env = {"PREFECT_HOME": str(home), IDLE_ENV: str(keep_s), "LOCKSTEP_DATA_TOKEN": SECRET}
    done = run([sys.executable, "-c", RUN], ROOT, **env)
    took = time.monotonic() - began  # returned: the keeper, which outlives the run, holds none of its pipes
    words = next(line for line in done.stdout.splitlines() if line.startswith("OWN")).split()
    return dict(zip(words[::2], words[1::2], strict=True)), done.stderr, took


def _keeper_and_server(home: Path) -> tuple[psutil.Process, psutil.Process]:
    keeper = psutil.Process(int((home / KEEPER_LOCK).read_text()))
    return keeper, keeper.children()[0]


def _gone(*processes: psutil.Process, within_s: float) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=within_s)
    return not alive


@pytest.mark.slow
def test_a_kept_server_serves_the_next_run_waits_for_runs_to_stop_and_stops_unused(
    tmp_path: Path, prefect_database: Path
) -> None:
    home = seed_prefect_home(tmp_path / "prefect", prefect_database)
    first, said, _ = _run(home, 300)
    assert first["OWN"] == "False" and first["STATE"] == "COMPLETED", said
    assert "a server kept for this project's next runs" in said
    keeper, server = _keeper_and_server(home)
    try:
        assert server.cmdline()[2:5] == ["prefect", "server", "start"]
        # the run's secrets stay with the run: neither the keeper nor its server has them
        assert all(SECRET not in value for p in (keeper, server) for value in p.environ().values())
        second, said, took = _run(home, 300)
        assert second["URL"] == first["URL"] and "a server kept" not in said, said  # no server of its own
        assert second["STATE"] == "COMPLETED" and took < 60, took
        # `stop` waits while a run uses the server (a shared lock, as local_api holds one)
        with open(home / IN_USE, "a") as in_use:
            fcntl.flock(in_use, fcntl.LOCK_SH)
            stopping = subprocess.Popen(
                [sys.executable, "-m", "flows.kept_server", "stop"],
                cwd=ROOT,
                env=subprocess_env(PREFECT_HOME=str(home)),
                stdout=subprocess.PIPE,
                text=True,
            )
            time.sleep(2)
            assert stopping.poll() is None and server.is_running()
        assert stopping.communicate(timeout=60)[0].strip() == "stopped the kept Prefect server"
        assert _gone(keeper, server, within_s=30) and not (home / RECORD_FILE).exists()
    finally:
        for process in (keeper, server):
            if process.is_running():
                process.kill()
    # kept for 3 s: stopped by itself once unused that long, and forgotten
    third, _, _ = _run(home, 3)
    assert third["URL"] != first["URL"]
    keeper, server = _keeper_and_server(home)
    assert _gone(keeper, server, within_s=40) and not (home / RECORD_FILE).exists()
    with closing(sqlite3.connect(home / "prefect.db")) as db:  # every run recorded, to its end, in one database
        states = db.execute("SELECT state_type FROM flow_run WHERE name IS NOT NULL").fetchall()
    assert [s for (s,) in states].count("COMPLETED") == 3, states


def test_the_idle_time_is_read_from_its_variable_and_a_wrong_one_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(IDLE_ENV, raising=False)
    assert idle_s() == 600
    for text, seconds in (("0", 0.0), ("90", 90.0), (" 2.5 ", 2.5)):
        monkeypatch.setenv(IDLE_ENV, text)
        assert idle_s() == seconds
    for wrong in ("ten", "-1", "nan"):
        monkeypatch.setenv(IDLE_ENV, wrong)
        with pytest.raises(ValueError, match=f"{IDLE_ENV}={wrong!r}: expected seconds"):
            idle_s()
