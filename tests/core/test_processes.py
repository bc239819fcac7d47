"""A saved pid is known to be the same process by a mark no clock step moves (tasks/core/processes.py).

A clock step is made the way the kernel makes it: Linux derives every process's wall-clock start from
the boot time, which it derives from the current clock, so psutil's boot time is moved here by 5 s (the
step a CI machine took on 2026-12-05) and a fresh psutil.Process then reports a start 5 s later.
Also: a process group stopped whole, and a process's imports and teardown spared the collector's walks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from tasks.core.processes import FULL_COLLECTION_EVERY, start_mark, started_as, stop_group
from tests.conftest import ROOT

STEP_S = 5.0


@pytest.fixture
def clock_step(monkeypatch: pytest.MonkeyPatch) -> None:
    pslinux = pytest.importorskip("psutil._pslinux")  # the wall-clock start is the boot time's sum on Linux
    boot = pslinux.boot_time()
    monkeypatch.setattr(pslinux, "boot_time", lambda: boot + STEP_S)


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_the_mark_is_the_same_after_a_clock_step_while_the_wall_clock_start_moves(clock_step: None) -> None:
    before = psutil.Process()
    mark, wall = start_mark(before), before.create_time()  # psutil caches both per Process object
    # the step is in place from here on: a new lookup sees the moved boot time
    after = psutil.Process()
    assert after.create_time() == pytest.approx(wall + STEP_S)
    assert start_mark(after) == mark and started_as(after, mark, wall)


def test_a_record_from_before_marks_is_judged_by_its_wall_clock_start_within_a_second() -> None:
    me = psutil.Process()
    assert started_as(me, None, me.create_time() + 0.4)
    assert not started_as(me, None, me.create_time() - 3600)
    assert not started_as(me, None, None)


def test_another_process_or_a_reused_pid_does_not_match(child: subprocess.Popen[bytes]) -> None:
    me, other = psutil.Process(), psutil.Process(child.pid)
    assert start_mark(other) != start_mark(me)
    assert not started_as(me, start_mark(other), me.create_time())  # the mark decides, not the wall clock
    mark = start_mark(other)
    child.kill()
    child.wait()
    with pytest.raises(psutil.NoSuchProcess):
        start_mark(other)
    assert mark.count("/") == 1  # "<boot id>/<ticks>" on Linux, "wall/<start>" elsewhere


# A leader that ignores SIGTERM, with a child of its own in its group: the grandchild prints its pid.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def test_stop_group_ends_the_whole_group_and_kills_what_ignores_sigterm() -> None:
    leader = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, start_new_session=True)
    try:
        member = psutil.Process(int(leader.stdout.readline()))
        stop_group(leader, timeout_s=1)
        assert leader.returncode == -9  # SIGTERM ignored: SIGKILL after the timeout
        member.wait(timeout=5)  # the group's other process got SIGTERM (and would have got SIGKILL)
    finally:  # whatever failed, nothing of the group outlives the test
        try:
            os.killpg(leader.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        leader.wait()
        leader.stdout.close()
    stop_group(leader)  # a group already gone: nothing to do, no error


# A process as every entry point starts one (`prepare`), with a handler registered before it (which runs
# after the ones registered by `prepare`) that reports the collector's state once the others ran, and a file
# left open for the teardown to flush.
AT_EXIT = """
import atexit, gc, sys
atexit.register(lambda: print("frozen objects at the end:", gc.get_freeze_count(), flush=True))
from tasks.determinism.bootstrap import prepare
prepare()
atexit.register(lambda: print("a handler registered later ran", flush=True))
left_open = open(sys.argv[1], "w")
left_open.write("flushed by the teardown")
"""


def test_a_started_process_exits_with_its_objects_frozen_and_its_handlers_and_files_done(tmp_path) -> None:
    out = tmp_path / "left-open.txt"
    done = subprocess.run([sys.executable, "-c", AT_EXIT, str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "a handler registered later ran", done.stdout
    frozen = int(lines[1].rpartition(" ")[2])
    assert frozen > 10_000, done.stdout  # every object the process holds: its modules at least
    assert out.read_text() == "flushed by the teardown"


# A process that loads what a stage's MLflow record loads, counting the full collections (generation 2) the
# collector runs meanwhile and what they free; started as every entry point starts one (`prepare`) or not.
IMPORTS = """
import gc, sys
full = []
gc.callbacks.append(lambda phase, info: phase == "stop" and info["generation"] == 2 and full.append(info["collected"]))
from tasks.determinism.bootstrap import prepare
if sys.argv[1] == "started":
    prepare()
import mlflow.store.tracking.sqlalchemy_store
print(len(full), sum(full), *gc.get_threshold())
"""


def _full_collections(how: str) -> tuple[int, int, tuple[int, ...]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", IMPORTS, how], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    runs, freed, *threshold = map(int, done.stdout.split())
    return runs, freed, tuple(threshold)


def test_a_started_process_imports_a_large_library_without_full_collections_that_free_nothing() -> None:
    """Without `prepare`, MLflow's import alone makes the collector walk the whole heap several times over
    (4 times here, freeing 70 objects); after it, at most once: only the full collections are rarer, the
    young and middle generations are collected as often as Python's defaults do."""
    runs, freed, threshold = _full_collections("plain")
    assert runs >= 3 and freed < 1000, (runs, freed)  # the walks this is about: many, and nearly nothing freed
    runs, _, tuned = _full_collections("started")
    assert runs <= 1, runs
    assert tuned == (*threshold[:2], FULL_COLLECTION_EVERY) and FULL_COLLECTION_EVERY > threshold[2], (tuned, threshold)
