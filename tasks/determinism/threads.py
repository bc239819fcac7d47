"""How many threads a process computes with: `determinism.num_threads`, or, under `auto` (the default),
the cores this process may run on divided among the processes of one job that run beside it.

A sweep's local workers and one node's DDP ranks each train at once on the same cores; each taking
every core would run more threads than cores, and OpenMP's threads then wait on each other at every
parallel region, a slowdown of several times. Whoever starts such processes says how many share the
cores (`shared_env`), and `resolve` divides: 2 workers on 2 cores train with 1 thread each.

In portable mode the weights do not depend on the thread count (tasks/determinism/blas.py cuts
products by shape), so `auto` also leaves out the cores that other processes keep busy when the
process starts (`idle_cores`): two threads beside one busy process wait on each other at every
parallel region, several times slower than one thread. What this process and the processes it
started do is its own job, not another's load; what processes run well below this one's priority
(`background_seconds`) is no load either. In native mode the count changes the
weights, so it follows only the cores given: a run records the count it used (the fingerprint's
`hw.threads`), and a sweep fixes one count for all its trials (flows/sweep.py).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Literal

import psutil

from tasks.core.config.base import ConfigError

SHARE_ENV = "LOCKSTEP_CPU_SHARE"  # how many processes of one job share this process's cores
# How long OpenMP's threads (torch's pool, which portable mode's products run on too) spin before they
# sleep while waiting for a peer, in libgomp's loop iterations. Its default spins for milliseconds,
# as if each thread had a core of its own; on a shared machine a peer that lost its core keeps the
# others spinning through its whole time slice, every parallel region, and native mode (whose thread
# count may not follow the load) collapsed. A spin of about a tenth of a millisecond kept the quiet
# speed (docs/benchmarks.md, B11). How threads wait changes no result.
SPIN_COUNT = "10000"
MAX_SHARE = 4096

NumThreads = int | Literal["auto"]
log = logging.getLogger(__name__)


def pin_waiting(environ: MutableMapping[str, str] = os.environ) -> None:
    """Before torch loads (libgomp reads it then): OpenMP's threads spin briefly before they sleep, unless
    the user chose how they wait (GOMP_SPINCOUNT, or OMP_WAIT_POLICY, which that would override)."""
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def cores_given() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's limit), not
    the machine's count."""
    return len(_cores())


def sharing() -> int:
    """How many processes share this process's cores: $LOCKSTEP_CPU_SHARE, else 1."""
    raw = os.environ.get(SHARE_ENV)
    if raw is None:
        return 1
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_SHARE:
        raise ConfigError(f"{SHARE_ENV}={raw[:40]!r}: expected a whole number of processes from 1 to {MAX_SHARE}")
    return int(raw)


def resolve(num_threads: NumThreads, processes: int = 1, follow_load: bool = False) -> int:
    """The thread count for one of `processes` processes started from this one (1: this process);
    with `follow_load` (portable mode), at most the cores that are idle now."""
    if num_threads != "auto":
        return num_threads
    count = max(1, cores_given() // (sharing() * processes))
    idle = idle_cores() if follow_load else None
    if idle is None or idle >= count:
        return count
    log.info(
        "%d of the %d cores given are busy with other processes: computing with %d thread(s), not %d",
        cores_given() - idle,
        cores_given(),
        max(1, idle),
        count,
    )
    return max(1, idle)


def _proc_stat() -> str:
    return Path("/proc/stat").read_text()


def idle_cores(
    window_s: float = 0.1,
    read: Callable[[], str] = _proc_stat,
    job: Callable[[], dict[int, float]] | None = None,
    ticks_per_s: int | None = None,
) -> int | None:
    """How many of this process's cores were idle over the next `window_s` seconds (while this process
    sleeps), or busy only with its own job (`job_seconds`) or with background work (`background_seconds`),
    rounded; None where the kernel does not say (no /proc/stat).

    Why its job counts as idle: a flow run's stages start right after the one before ended, when the
    flow's own Prefect server records that task. Counted as another's load, that tenth of a second made
    the next stage compute with 1 thread of 2 at 6 of the 12 starts of a torch stage (three forced `make run`s on a
    quiet 2-core Intel Xeon, 2026-12-05), for the whole stage."""
    job = job or _yielding_seconds
    try:
        before, job_before = _cpu_times(read()), job()
        time.sleep(window_s)
        after, job_after = _cpu_times(read()), job()
    except OSError:
        return None
    cores = [cpu for cpu in _cores() if cpu in before and cpu in after]
    idle, ticks = 0.0, 0
    for cpu in cores:
        total = sum(after[cpu]) - sum(before[cpu])
        idle += _idle_ticks(before[cpu], after[cpu]) / total if total > 0 else 1.0
        ticks += total
    window = ticks / len(cores) if cores else 0
    if window > 0:  # the job's seconds over the window, in cores' worth
        ours = _seconds_between(job_before, job_after)
        idle = min(len(cores), idle + ours * (ticks_per_s or os.sysconf("SC_CLK_TCK")) / window)
    return int(idle + 0.5)


def job_seconds() -> dict[int, float]:
    """The CPU seconds (user + system) of this process's threads and of each process it started that still
    runs, by pid: its job (a flow run's own Prefect server, a loader's workers, a launcher's ranks)."""
    me = psutil.Process()
    seconds = {me.pid: _own_seconds()}
    for child in me.children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:  # ended since it was listed
            continue
        seconds[child.pid] = times.user + times.system
    return seconds


# A process at least this much nicer than this one gives its core up whenever this one's threads want it
# (the kernel weighs nice 10 at a tenth of nice 0), so its work is no reason to take fewer threads. Measured
# on the 2-core Intel Xeon, a resnet9 step of 64 RGB images of 32x32 in portable mode beside one process
# spinning on a core (2026-12-06): at nice 10, 0.18 s on 2 threads against 0.22 on 1; at nice 5 even (0.24,
# 0.23); at nice 2, as at ours, 2 threads lose (0.28 against 0.22): benchmarks/results/threads-niced.json.
# /proc/stat's nice column lumps every positive niceness together, so the nicer processes are looked at one
# by one.
BACKGROUND_NICE = 10


def background_seconds() -> dict[int, float]:
    """The CPU seconds (user + system) of each process running at least BACKGROUND_NICE nicer than this
    one, by pid: background work, whose cores this process's threads get whenever they want them."""
    floor = os.getpriority(os.PRIO_PROCESS, 0) + BACKGROUND_NICE
    seconds = {}
    for proc in psutil.process_iter(["nice", "cpu_times"]):  # (None where a process may not be read)
        nice, times = proc.info["nice"], proc.info["cpu_times"]
        if nice is not None and times is not None and nice >= floor:
            seconds[proc.pid] = times.user + times.system
    return seconds


def _yielding_seconds() -> dict[int, float]:
    """What idle_cores counts as idle beside the idle ticks: its own job's and background work's seconds."""
    return {**background_seconds(), **job_seconds()}


def _seconds_between(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two readings by the processes in both (one that began or ended between
    them is left out: counted as load, the careful side)."""
    return sum(after[pid] - before[pid] for pid in after.keys() & before.keys())


def _cores() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # macOS has no affinity call
        return set(range(os.cpu_count() or 1))


def _cpu_times(stat: str) -> dict[int, list[int]]:
    """/proc/stat's per-core lines: core number -> its jiffies (user nice system idle iowait ...)."""
    times = {}
    for line in stat.splitlines():
        name, _, fields = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit():
            times[int(name[3:])] = [int(field) for field in fields.split()]
    return times


def _idle_ticks(before: list[int], after: list[int]) -> int:
    """A core's idle and iowait ticks (/proc/stat's 4th and 5th fields) between two readings."""
    return after[3] + after[4] - before[3] - before[4]


def _own_seconds() -> float:
    """CPU seconds this process's threads have used (user + system), its children not included."""
    user, system = os.times()[:2]
    return user + system


class LoadFollower:
    """A portable process's thread count, decided again from time to time (each training epoch): the
    cores it may take (`ceiling`) less those that other processes kept busy since the last decision.

    The kernel counts this process's own work as busy too, so its CPU time is subtracted: its own
    threads never count against it, nor does background work (`background_seconds`). Two processes
    started together each see idle cores and take them all; after their first epoch each sees the
    other's work, and both settle on a share. When the other finishes, the cores come back. (The count
    is decided at start by `resolve`, with a short look at /proc/stat; this looks at the whole stretch
    since.)
    """

    MIN_WINDOW_S = 0.2  # a shorter stretch is a few clock ticks of /proc/stat: noise
    FREE_BELOW = 0.25  # of a core's time used by others

    def __init__(
        self,
        ceiling: int,
        read: Callable[[], str] = _proc_stat,
        own: Callable[[], float] = _own_seconds,
        ticks_per_s: int | None = None,
        background: Callable[[], dict[int, float]] = background_seconds,
    ) -> None:
        self.ceiling = ceiling
        self._read, self._own, self._background = read, own, background
        self._ticks_per_s = ticks_per_s or os.sysconf("SC_CLK_TCK")
        self._last = self._sample()
        # background_seconds at the last look while niced work ran; the first look is taken now (a few
        # milliseconds, once): a training beside niced work takes its cores from the first epoch
        self._niced: dict[int, float] | None = background()

    def _sample(self) -> tuple[dict[int, list[int]], float] | None:
        try:
            return _cpu_times(self._read()), self._own()
        except OSError:
            return None

    def count(self) -> int | None:
        """The thread count for what comes next, from the load since the last call (or since this
        follower was made); None where the kernel does not say or the stretch was too short to judge."""
        now = self._sample()
        before, self._last = self._last, now
        if before is None or now is None:
            return None
        (times_before, own_before), (times_now, own_now) = before, now
        cores = [cpu for cpu in _cores() if cpu in times_before and cpu in times_now]
        if not cores:
            return None
        total = sum(sum(times_now[cpu]) - sum(times_before[cpu]) for cpu in cores)
        idle = sum(_idle_ticks(times_before[cpu], times_now[cpu]) for cpu in cores)
        window = total / len(cores)  # ticks that passed, per core
        if window < self.MIN_WINDOW_S * self._ticks_per_s:
            self._last = before  # judge a longer stretch next time
            return None
        yielded = (own_now - own_before + self._background_since(times_before, times_now, cores)) * self._ticks_per_s
        others = max(0.0, total - idle - yielded) / window  # cores' worth
        # A core counts as free only if others used under a quarter of it: a thread too many costs far
        # more (its peers wait on it at every parallel region) than a thread too few.
        return max(1, min(self.ceiling, len(cores) - math.ceil(others - self.FREE_BELOW)))

    def _background_since(self, before: dict[int, list[int]], now: dict[int, list[int]], cores: list[int]) -> float:
        """Seconds background work ran since the last look. Looked for process by process only while
        /proc/stat's nice column moves (most machines run nothing niced, and a look at every process
        each epoch would cost them milliseconds for nothing); the first look after niced work began has
        nothing to compare with, and counts it as load."""
        if sum(now[cpu][1] - before[cpu][1] for cpu in cores) <= 0:  # (user, nice, system, idle, ...)
            self._niced = None
            return 0.0
        previous, self._niced = self._niced, self._background()
        return _seconds_between(previous, self._niced) if previous is not None else 0.0


# The thread pools' own variables, read when each library loads: OpenMP's (torch's pool), MKL's, OpenBLAS's (numpy's)
POOL_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def pool_env(threads: int) -> dict[str, str]:
    """The environment that gives a child process's thread pools `threads` threads from their start: for
    one that does not pin its own before computing (numpy's data steps, a benchmark's child), or a
    launcher that reads them (torchrun sets OMP_NUM_THREADS=1 where it is unset, and warns)."""
    return dict.fromkeys(POOL_VARIABLES, str(threads))


def shared_env(processes: int) -> dict[str, str]:
    """The environment for `processes` processes started side by side from this one on its cores."""
    return {SHARE_ENV: str(min(MAX_SHARE, sharing() * processes))}
