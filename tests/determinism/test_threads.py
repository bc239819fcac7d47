"""`determinism.num_threads: auto`: the cores a process is given, shared among the processes of one job
(tasks/determinism/threads.py), so that a sweep's workers or a node's DDP ranks never run more threads
than there are cores."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.core.config.base import ConfigError
from tasks.core.config.params import Params
from tasks.core.config.yaml_io import load_params
from tasks.determinism import threads
from tasks.train.launcher import launch_env
from tests.conftest import ROOT


@pytest.fixture
def eight_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv(threads.SHARE_ENV, raising=False)


def test_auto_is_the_default_and_takes_the_cores_given(eight_cores: None) -> None:
    assert load_params(ROOT / "params.yaml").determinism.num_threads == "auto"
    assert threads.resolve("auto") == 8
    assert threads.resolve(3) == 3  # a number is a number, whatever the cores


def test_processes_side_by_side_share_the_cores(eight_cores: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert threads.resolve("auto", processes=3) == 2
    assert threads.resolve("auto", processes=16) == 1  # never none
    # a process started with a share passes it on, multiplied, to what it starts (a sweep's trial
    # that itself starts DDP ranks)
    monkeypatch.setenv(threads.SHARE_ENV, threads.shared_env(2)[threads.SHARE_ENV])
    assert threads.resolve("auto") == 4
    assert threads.shared_env(2) == {threads.SHARE_ENV: "4"}
    assert threads.resolve("auto", processes=2) == 2


@pytest.mark.parametrize("value", ["0", "-1", "two", "1e3", "99999"])
def test_a_bad_share_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(threads.SHARE_ENV, value)
    with pytest.raises(ConfigError, match=f"{threads.SHARE_ENV}=.*expected a whole number of processes"):
        threads.resolve("auto")


def test_a_nodes_ddp_ranks_each_get_their_share(eight_cores: None, tmp_path: Path) -> None:
    params = Params.model_validate({"train": {"strategy": "ddp", "nproc_per_node": 4}})
    env = launch_env(params, tmp_path)
    assert env[threads.SHARE_ENV] == "4" and env["OMP_NUM_THREADS"] == "2"
    pinned = Params.model_validate(
        {"train": {"strategy": "ddp", "nproc_per_node": 4}, "determinism": {"num_threads": 3}}
    )
    assert launch_env(pinned, tmp_path)["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize("value", [0, 1025, "all", 2.5])
def test_num_threads_is_a_count_or_auto(value: object) -> None:
    with pytest.raises(ValueError, match="num_threads"):
        Params.model_validate({"determinism": {"num_threads": value}})


def _stat(cores: dict[int, tuple[int, int]]) -> str:
    """/proc/stat with each core's (busy, idle) jiffies."""
    lines = ["cpu  1 2 3 4 5 0 0 0 0 0"]
    lines += [f"cpu{n} {busy} 0 0 {idle} 0 0 0 0 0 0" for n, (busy, idle) in cores.items()]
    return "\n".join([*lines, "intr 1 2 3", "ctxt 5"]) + "\n"


def test_idle_cores_counts_the_idle_share_of_the_cores_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2})  # core 3 is not ours
    samples = iter(
        [
            _stat({0: (0, 0), 1: (0, 0), 2: (0, 0), 3: (0, 0)}),
            # core 0 busy, core 1 idle, core 2 idle 70% of the time; core 3 (busy) is another's
            _stat({0: (10, 0), 1: (0, 10), 2: (3, 7), 3: (10, 0)}),
        ]
    )
    assert threads.idle_cores(0, read=lambda: next(samples)) == 2  # 1.7, rounded


def test_portable_threads_leave_out_the_busy_cores(eight_cores: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "idle_cores", lambda: 3)
    assert threads.resolve("auto", follow_load=True) == 3
    assert threads.resolve("auto") == 8  # native: the count changes the bytes, so it never follows the load
    assert threads.resolve(6, follow_load=True) == 6  # a number is a number
    monkeypatch.setattr(threads, "idle_cores", lambda: 0)
    assert threads.resolve("auto", follow_load=True) == 1
    monkeypatch.setattr(threads, "idle_cores", lambda: None)  # no /proc/stat: the cores given
    assert threads.resolve("auto", follow_load=True) == 8


@pytest.mark.slow
def test_cores_kept_busy_by_other_processes_are_seen_busy() -> None:
    """On the real /proc/stat: a process spinning on each of our cores leaves none idle."""
    cores = sorted(threads._cores())
    hogs = [
        subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
        for core in cores
    ]
    try:
        time.sleep(0.5)  # started and spinning
        assert threads.idle_cores(0.3) == 0
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
