"""When a process started, told in a way a clock step does not change: how a saved pid is known to
still be the same process, and not a stranger that reused it.

psutil's `create_time()` is a wall-clock time. On Linux it is the start since boot plus the boot
time, and the kernel derives the boot time from the current clock: when NTP or a VM's clock sync steps
the clock, every running process's create_time moves with it. It moved by exactly 5 s on a CI machine
(2026-12-05), and the stack took its own MLflow server for a stranger and left it running when asked
to stop it. psutil identifies a process by its start since boot for this reason
(`Process._get_ident`), but does not make that public; `start_mark` reads it, with the boot's id, so
that a mark made before a reboot never matches a process after it. And how a process group we started
is stopped (`stop_group`), and how a process of ours spends less on Python's cyclic garbage
collector while it imports and while it ends (`tune_collector`); and a child tied to its parent's life
(`die_with_parent`).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import gc
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

# A record made before marks existed holds only the wall-clock start, which NTP's slews move by up to
# a second; a pid reused within a second of its previous owner's start is far rarer than that.
SAME_START_S = 1.0

_PROC = Path("/proc")


def start_mark(proc: psutil.Process) -> str:
    """When `proc` started, in a form no clock step changes: "<boot id>/<clock ticks since boot>" on
    Linux; elsewhere (macOS keeps a process's start as a fixed timestamp) "wall/<its start>".

    Raises psutil.NoSuchProcess if the process is gone."""
    if not (_PROC / "self" / "stat").exists():
        return f"wall/{proc.create_time():.6f}"
    try:
        stat = (_PROC / str(proc.pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        raise psutil.NoSuchProcess(proc.pid) from None
    # proc(5): the command's name (field 2) may hold spaces and ")", so fields are counted after its
    # last ")"; the start since boot is field 22, the 20th after the name
    return f"{_boot_id()}/{stat[stat.rindex(')') + 2 :].split()[19]}"


@functools.cache
def _boot_id() -> str:
    # the same for the life of the process (a new one at each boot): read once
    return (_PROC / "sys" / "kernel" / "random" / "boot_id").read_text().strip()


def started_as(proc: psutil.Process, mark: str | None, started: float | None = None) -> bool:
    """Whether `proc` is the process a record names: by its `mark` (start_mark) or, in a record made
    before marks, by its wall-clock start `started` within SAME_START_S.

    Raises psutil.NoSuchProcess if the process is gone."""
    if mark is not None:
        return start_mark(proc) == mark
    return started is not None and abs(proc.create_time() - started) <= SAME_START_S


def stop_group(proc: subprocess.Popen[Any], timeout_s: float = 30) -> None:
    """SIGTERM the process group `proc` leads (started with `start_new_session`), SIGKILL after `timeout_s`."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# Middle-generation collections between two full ones (CPython's default: 10). A full collection walks every
# object the collector tracks, and CPython runs one whenever 10 middle ones have run and the objects that
# survived into the oldest generation since the last have grown it by a quarter: while a process imports
# MLflow, Prefect or torch they do, again and again, and each walk is longer. A stage process ran 5-9 of them
# (0.3-1.1 s) and a forced flow run 11 (1.8 s), during their imports, freeing nearly nothing (counted with
# gc.callbacks on the digits pipeline, 2-core Intel Xeon, 2026-12-05). With `prepare` setting 100, `python -m
# tasks stats` took 1.82 s instead of 2.11, evaluate 3.58 s instead of 4.17 (medians of 6, taking turns), a
# forced flow run 22.25 s instead of 22.99 (medians of 4), peak RSS the same (train, compress, preprocess:
# within 0.5%). Young and middle collections are unchanged, so garbage in reference cycles is still found
# early; a long-lived process (a sweep's worker, a flow serving for days) still runs full collections, after
# ten times as many middle ones.
def die_with_parent() -> None:
    """In a child, before exec (`preexec_fn`): SIGTERM it when the process that started it dies, even by
    SIGKILL (Linux's PR_SET_PDEATHSIG; elsewhere nothing: the child is then stopped by its parent only)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


FULL_COLLECTION_EVERY = 100

_freezing_at_exit = False


def tune_collector() -> None:
    """Python's cyclic collector set for a process that loads large libraries: full collections ten times
    rarer (FULL_COLLECTION_EVERY says why), and none at exit (`freeze_at_exit`). Idempotent."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)
    freeze_at_exit()


def freeze_at_exit() -> None:
    """At this process's exit, after every exit handler registered later has run (atexit runs them last in,
    first out), move every object into the collector's permanent generation (`gc.freeze`), so that the
    interpreter's teardown collections skip them. Idempotent.

    Why: a process that has loaded torch, MLflow, Prefect and DVC holds over half a million objects that
    the collector tracks, and the full collections Python runs while it tears down walk all of them. Such
    a process took 2.2 s from its last line to its exit on 2 cores, 0.4 s frozen; `python -m tasks
    evaluate` 8.6 -> 7.1 s, a forced `make run` 35.3 -> 32.5 s (medians, Intel Xeon, 2026-12-05). Every
    stage process, flow run and DDP rank paid it. (`gc.freeze` came from Instagram's forking servers,
    bpo-31558.) The rest of the teardown still runs: exit handlers (Prefect's and MLflow's flushes,
    logging's) and every object freed by its reference count (files closed, buffers flushed). Only
    garbage caught in reference cycles is no longer collected at exit, and Python never promised to run
    its finalizers then."""
    global _freezing_at_exit
    if not _freezing_at_exit:
        atexit.register(gc.freeze)
        _freezing_at_exit = True
