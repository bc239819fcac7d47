"""How many threads a process computes with: `determinism.num_threads`, or, under `auto` (the default),
the cores this process may run on divided among the processes of one job that run beside it.

A sweep's local workers and one node's DDP ranks each train at once on the same cores; each taking
every core would run more threads than cores, and OpenMP's threads then wait on each other at every
parallel region, a slowdown of several times. Whoever starts such processes says how many share the
cores (`shared_env`), and `resolve` divides: 2 workers on 2 cores train with 1 thread each.

In portable mode the weights do not depend on the thread count (tasks/determinism/blas.py cuts
products by shape), so `auto` costs nothing in reproducibility. In native mode it does: a run
records the count it used (the fingerprint's `hw.threads`), and a sweep fixes one count for all its
trials (flows/sweep.py).
"""

from __future__ import annotations

import os
from typing import Literal

from tasks.core.config.base import ConfigError

SHARE_ENV = "LOCKSTEP_CPU_SHARE"  # how many processes of one job share this process's cores
MAX_SHARE = 4096

NumThreads = int | Literal["auto"]


def cores_given() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's limit), not
    the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1


def sharing() -> int:
    """How many processes share this process's cores: $LOCKSTEP_CPU_SHARE, else 1."""
    raw = os.environ.get(SHARE_ENV)
    if raw is None:
        return 1
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_SHARE:
        raise ConfigError(f"{SHARE_ENV}={raw[:40]!r}: expected a whole number of processes from 1 to {MAX_SHARE}")
    return int(raw)


def resolve(num_threads: NumThreads, processes: int = 1) -> int:
    """The thread count for one of `processes` processes started from this one (1: this process)."""
    if num_threads != "auto":
        return num_threads
    return max(1, cores_given() // (sharing() * processes))


def shared_env(processes: int) -> dict[str, str]:
    """The environment for `processes` processes started side by side from this one on its cores."""
    return {SHARE_ENV: str(min(MAX_SHARE, sharing() * processes))}
