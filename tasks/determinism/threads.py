"""How many threads a process computes with: `determinism.num_threads`, or, under `auto` (the default),
the cores this process may run on divided among the processes of one job that run beside it.

A sweep's local workers and one node's DDP ranks each train at once on the same cores; each taking
every core would run more threads than cores, and OpenMP's threads then wait on each other at every
parallel region, a slowdown of several times. Whoever starts such processes says how many share the
cores (`shared_env`), and `resolve` divides: 2 workers on 2 cores train with 1 thread each.

In portable mode the weights do not depend on the thread count (tasks/determinism/blas.py cuts
products by shape), so `auto` also leaves out the cores that other processes keep busy when the
process starts (`idle_cores`): two threads beside one busy process wait on each other at every
parallel region, several times slower than one thread. In native mode the count changes the
weights, so it follows only the cores given: a run records the count it used (the fingerprint's
`hw.threads`), and a sweep fixes one count for all its trials (flows/sweep.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from tasks.core.config.base import ConfigError

SHARE_ENV = "LOCKSTEP_CPU_SHARE"  # how many processes of one job share this process's cores
MAX_SHARE = 4096

NumThreads = int | Literal["auto"]
log = logging.getLogger(__name__)


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


def idle_cores(window_s: float = 0.1, read: Callable[[], str] = _proc_stat) -> int | None:
    """How many of this process's cores were idle over the next `window_s` seconds (while this
    process sleeps), rounded; None where the kernel does not say (no /proc/stat)."""
    try:
        before = _cpu_times(read())
        time.sleep(window_s)
        after = _cpu_times(read())
    except OSError:
        return None
    idle = 0.0
    for cpu in _cores():
        if cpu in before and cpu in after:
            total = sum(after[cpu]) - sum(before[cpu])
            # idle and iowait: the 4th and 5th fields
            idle += (after[cpu][3] + after[cpu][4] - before[cpu][3] - before[cpu][4]) / total if total > 0 else 1.0
    return int(idle + 0.5)


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


def shared_env(processes: int) -> dict[str, str]:
    """The environment for `processes` processes started side by side from this one on its cores."""
    return {SHARE_ENV: str(min(MAX_SHARE, sharing() * processes))}
