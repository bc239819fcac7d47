"""`determinism.num_threads: auto`: the cores a process is given, shared among the processes of one job
(tasks/determinism/threads.py), so that a sweep's workers or a node's DDP ranks never run more threads
than there are cores."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from tasks.core.config.base import ConfigError
from tasks.core.config.params import Params
from tasks.core.config.yaml_io import load_params
from tasks.determinism import threads
from tasks.train.launcher import launch_env
from tests.conftest import ROOT, subprocess_env


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


def _stat(cores: dict[int, tuple[int, ...]]) -> str:
    """/proc/stat with each core's (busy, idle) jiffies, or (busy, idle, niced): busy at a positive nice."""
    lines = ["cpu  1 2 3 4 5 0 0 0 0 0"]
    lines += [f"cpu{n} {c[0]} {c[2] if len(c) > 2 else 0} 0 {c[1]} 0 0 0 0 0 0" for n, c in cores.items()]
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
    assert threads.idle_cores(0, read=lambda: next(samples), job=dict) == 2  # 1.7, rounded


def test_idle_cores_counts_what_its_own_job_kept_busy_as_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    samples = iter([_stat({0: (0, 0), 1: (0, 0)}), _stat({0: (10, 0), 1: (10, 0)})])  # both busy, 10 ticks
    # this process used 0.04 s and its child 0.02 (of the 0.2 s both cores had); one that ended or began
    # between the looks is left out
    job = iter([{1: 1.0, 2: 5.0, 3: 7.0}, {1: 1.04, 2: 5.02, 4: 9.0}])
    assert threads.idle_cores(0, read=lambda: next(samples), job=lambda: next(job), ticks_per_s=100) == 1  # 0.6


def test_portable_threads_leave_out_the_busy_cores(eight_cores: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "idle_cores", lambda: 3)
    assert threads.resolve("auto", follow_load=True) == 3
    assert threads.resolve("auto") == 8  # native: the count changes the bytes, so it never follows the load
    assert threads.resolve(6, follow_load=True) == 6  # a number is a number
    monkeypatch.setattr(threads, "idle_cores", lambda: 0)
    assert threads.resolve("auto", follow_load=True) == 1
    monkeypatch.setattr(threads, "idle_cores", lambda: None)  # no /proc/stat: the cores given
    assert threads.resolve("auto", follow_load=True) == 8


HOG = "import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"


@contextmanager
def _hogs(ours: bool) -> Iterator[list[int]]:
    """A process spinning on each of our cores: started by this process (`ours`: its job), or detached,
    as another's (its shell exits at once, leaving it to init)."""
    pids = []
    for core in sorted(threads._cores()):
        code = HOG.format(core=core)
        if ours:
            pids.append(subprocess.Popen([sys.executable, "-c", code]).pid)
        else:
            started = f"{shlex.quote(sys.executable)} -c {shlex.quote(code)} >/dev/null 2>&1 & echo $!"
            pids.append(int(subprocess.run(["sh", "-c", started], capture_output=True, text=True, check=True).stdout))
    try:
        time.sleep(0.5)  # started and spinning
        yield pids
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            if ours:
                os.waitpid(pid, 0)


@pytest.mark.slow
def test_cores_kept_busy_by_other_processes_are_seen_busy_and_by_our_own_job_idle() -> None:
    """On the real /proc/stat: a process spinning on each of our cores leaves none idle, unless this
    process started them (a flow run's own server recording the last task as the next stage starts):
    their CPU time is then its job's."""
    with _hogs(ours=False) as others:
        assert threads.idle_cores(0.3) == 0
        assert not set(others) & set(threads.job_seconds())  # (a test worker's job may hold its servers)
    with _hogs(ours=True) as ours:
        before = threads.job_seconds()
        time.sleep(0.3)
        after = threads.job_seconds()
        # what idle_cores counts as idle (its arithmetic: the test above); how much of it the cores
        # give the hogs depends on the other tests running beside this one
        assert sum(after[pid] - before[pid] for pid in ours) > 0.05


def test_a_follower_leaves_out_what_others_kept_busy_and_takes_it_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between two looks, the kernel's busy time less this process's own is what others used."""
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    jiffies = {0: [0, 0], 1: [0, 0]}  # (busy, idle) per core
    own = [0.0]

    def spend(ours: list[int], others: list[int], idle: list[int]) -> None:  # ticks per core
        for core in (0, 1):
            jiffies[core][0] += ours[core] + others[core]
            jiffies[core][1] += idle[core]
        own[0] += sum(ours) / 100

    follower = threads.LoadFollower(
        2, read=lambda: _stat({k: tuple(v) for k, v in jiffies.items()}), own=lambda: own[0], ticks_per_s=100
    )
    spend(ours=[100, 0], others=[0, 100], idle=[0, 0])  # another process kept core 1 busy
    assert follower.count() == 1
    spend(ours=[100, 100], others=[0, 0], idle=[0, 0])  # our own two threads: not held against us
    assert follower.count() == 2
    spend(ours=[50, 0], others=[0, 20], idle=[50, 80])  # another used a fifth of a core: still free
    assert follower.count() == 2
    spend(ours=[50, 0], others=[0, 30], idle=[50, 70])  # a third: not free (a thread too many costs more)
    assert follower.count() == 1
    spend(ours=[5, 0], others=[0, 5], idle=[0, 0])  # 0.05 s: too short to judge ...
    assert follower.count() is None
    spend(ours=[15, 0], others=[0, 15], idle=[0, 0])  # ... so the next look judges the whole 0.2 s
    assert follower.count() == 1
    one = threads.LoadFollower(
        1, read=lambda: _stat({k: tuple(v) for k, v in jiffies.items()}), own=lambda: own[0], ticks_per_s=100
    )
    spend(ours=[100, 0], others=[0, 0], idle=[0, 100])
    assert one.count() == 1  # never above the cores given (and this process's share of them)


def test_a_follower_takes_the_cores_of_background_work_but_not_of_niced_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Work at a positive nice (/proc/stat's nice column) yields only if its processes run BACKGROUND_NICE
    nicer than this one (`background_seconds`, by pid); the first look at it has nothing to compare
    with and counts it as load. While nothing runs niced, no process is looked at."""
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    jiffies = {0: [0, 0, 0], 1: [0, 0, 0]}  # (busy, idle, niced) per core
    background = {7: 0.0}  # a nice-19 process's seconds
    looked = []

    def seconds() -> dict[int, float]:
        looked.append(True)
        return dict(background)

    def spend(ours: int, niced: int, of_background: float) -> None:  # ticks on core 0 and on core 1
        jiffies[0][0] += ours
        jiffies[1][2] += niced
        background[7] += of_background

    follower = threads.LoadFollower(
        2,
        read=lambda: _stat({k: tuple(v) for k, v in jiffies.items()}),
        own=lambda: jiffies[0][0] / 100,  # this process's threads: core 0's busy ticks
        ticks_per_s=100,
        background=seconds,
    )
    assert len(looked) == 1  # made: a first look, so that work niced from the start is seen as such
    spend(ours=100, niced=100, of_background=1.0)
    assert follower.count() == 2  # the background process's second: its core is ours when we want it
    spend(ours=100, niced=0, of_background=0)
    assert follower.count() == 2 and len(looked) == 2  # nothing ran niced: no look at every process
    spend(ours=100, niced=100, of_background=1.0)
    assert follower.count() == 1 and len(looked) == 3  # niced again: nothing to compare with, so load
    spend(ours=100, niced=100, of_background=1.0)
    assert follower.count() == 2
    spend(ours=100, niced=100, of_background=0.0)  # niced work of a process not nice enough (a peer)
    assert follower.count() == 1


NICE_HOG = "import os; os.nice({nice})\nwhile True: pass"


def test_background_work_is_the_processes_at_least_background_nice_nicer_than_this_one() -> None:
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    if ours + threads.BACKGROUND_NICE > 19:
        pytest.skip(f"this process runs at nice {ours}: no process can be {threads.BACKGROUND_NICE} nicer")
    hogs = {
        nice: subprocess.Popen([sys.executable, "-c", NICE_HOG.format(nice=nice)])
        for nice in (2, threads.BACKGROUND_NICE)
    }
    background = psutil.Process(hogs[threads.BACKGROUND_NICE].pid)

    def settled() -> bool:  # both reniced, and the background one has a clock tick of CPU time (on a loaded
        # machine a nice-10 process may get none for a while: its seconds would read 0.0)
        reniced = all(psutil.Process(hog.pid).nice() == ours + nice for nice, hog in hogs.items())
        return reniced and sum(background.cpu_times()[:2]) > 0

    try:
        deadline = time.monotonic() + 30
        while not settled():
            assert time.monotonic() < deadline, "the spinning processes did not renice themselves and run in 30 s"
            time.sleep(0.05)
        seen = threads.background_seconds()
        assert hogs[threads.BACKGROUND_NICE].pid in seen and seen[hogs[threads.BACKGROUND_NICE].pid] > 0
        assert hogs[2].pid not in seen  # 2 nicer: its work slows ours (a peer's load)
        assert os.getpid() not in seen
    finally:
        for hog in hogs.values():
            hog.kill()
            hog.wait()


@pytest.mark.slow
def test_a_portable_training_takes_fewer_threads_while_other_processes_keep_the_cores_busy(
    torch_threads: None,
) -> None:
    """Real /proc/stat, real busy processes: the next epoch's count (pinning.follow_load) drops to 1;
    under native mode, or a fixed num_threads, it never moves."""
    import torch

    from tasks.determinism import pinning

    cores = sorted(threads._cores())
    if len(cores) < 2:
        pytest.skip("one core: nothing to leave out")
    pinning.pin_everything(0, "auto", True, "portable")
    hogs = [
        subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
        for core in cores
    ]
    try:
        time.sleep(1.0)
        pinning.follow_load()
        assert torch.get_num_threads() == 1
        pinning.pin_everything(0, 2, True, "portable")
        time.sleep(0.5)
        pinning.follow_load()
        assert torch.get_num_threads() == 2  # a number is a number
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@pytest.mark.parametrize(
    ("chosen", "expected"),
    [
        ({}, threads.SPIN_COUNT),
        ({"GOMP_SPINCOUNT": "300000"}, "300000"),  # the user's choice stands
        ({"OMP_WAIT_POLICY": "PASSIVE"}, None),  # a spin count would override the policy they chose
    ],
)
def test_openmp_threads_spin_briefly_unless_the_user_chose(chosen: dict[str, str], expected: str | None) -> None:
    environ = dict(chosen)
    threads.pin_waiting(environ)
    assert environ.get("GOMP_SPINCOUNT") == expected and environ.get("OMP_WAIT_POLICY") == chosen.get("OMP_WAIT_POLICY")


def test_every_entry_point_sets_the_spin_before_torch_loads() -> None:
    """bootstrap, which each entry point calls first, sets it in the process (before libgomp reads it) and
    for the processes it starts (DDP ranks, Dask workers, stages)."""
    env = {k: v for k, v in subprocess_env().items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = (
        "import os, sys\nfrom tasks.determinism.bootstrap import bootstrap\nbootstrap()\n"
        "assert 'torch' not in sys.modules\nimport torch\nprint(os.environ['GOMP_SPINCOUNT'])"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == threads.SPIN_COUNT
