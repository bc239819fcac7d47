"""Who owns a run, and whether that owner is gone: the process lookup behind tracking.

Every run lockstep opens names its owner in tags (`owner_tags`): the host name, the pid namespace,
the pid and the process's start time. The owner is the process that ends the run; for the parent run
of a `dvc repro` / `dvc exp run` session that is the dvc process every stage process shares
(`session_owner`). `judge_owner` tells whether the owner still runs (on this host, in this pid
namespace); a run of another host is known to be over only through its Prefect flow run
(`flow_run_state`). tasks/tracking/orphans.py marks the runs whose owner is gone; tasks/tracking/runs.py
tags the runs it opens.
"""

from __future__ import annotations

import base64
import getpass
import json
import logging
import os
import platform
import urllib.request
import uuid
from datetime import UTC, datetime
from pathlib import Path

import psutil

from tasks.core.cli import one_line
from tasks.core.processes import start_mark, started_as

log = logging.getLogger(__name__)

OWNER_HOST = "lockstep.owner.host"
OWNER_PIDNS = "lockstep.owner.pidns"  # the same host name in two containers: their pids differ
OWNER_PID = "lockstep.owner.pid"
OWNER_STARTED = "lockstep.owner.started"  # ISO 8601 UTC, ms: for people (a clock step moves it)
OWNER_MARK = "lockstep.owner.start_mark"  # tasks.core.processes.start_mark: tells a reused pid apart

# verdicts
GONE, STALE = "gone", "stale"  # marked
ALIVE, ELSEWHERE, UNOWNED = "alive", "another host", "no owner"  # left alone


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")  # e.g. "pid:[4026531836]"
    except OSError:
        return "none"  # no /proc (macOS): no pid namespaces either


def iso_time(seconds: float) -> str:
    """`seconds` since 1970 as ISO 8601 UTC; a time no datetime holds (a planted tag's year 9999 in
    UTC-14, a start time in the far future) as the number, never an error: one planted run must not
    stop the orphan sweep for every other."""
    try:
        return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    except (OverflowError, OSError, ValueError):
        return f"{seconds:.0f} s after 1970 (out of range)"


def owner_tags(proc: psutil.Process | None = None) -> dict[str, str]:
    """The tags that name `proc` (default: this process) as a run's owner."""
    proc = proc or psutil.Process()
    return {
        OWNER_HOST: platform.node(),
        OWNER_PIDNS: _pid_namespace(),
        OWNER_PID: str(proc.pid),
        OWNER_STARTED: iso_time(proc.create_time()),
        OWNER_MARK: start_mark(proc),
    }


def who(what: str) -> str:
    """`what`, with this process, host and user: who marked a run."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a container's uid without a passwd entry
        user = str(os.getuid())
    return f"{what} (pid {os.getpid()} on {platform.node()}, user {user})"


def _process_gone(pid: int, mark: str | None, started: float) -> str | None:
    """How the process `pid` that started at `mark` (or, in a run from before marks, at wall-clock
    `started`) is gone, or None if it runs (or cannot be told)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return "has exited (a zombie)"
        if not started_as(proc, mark, started):
            return f"is gone (pid {pid} is now another process, started {iso_time(proc.create_time())})"
    except psutil.NoSuchProcess:
        return "is gone"
    except psutil.Error:  # access denied: it exists, someone else's
        return None
    return None


def owner_of(tags: dict[str, str]) -> str:
    """The owner as the reasons name it (owner tags present and well-formed)."""
    started = datetime.fromisoformat(tags[OWNER_STARTED]).timestamp()
    return f"process {tags[OWNER_PID]} on host {tags.get(OWNER_HOST)} (started {iso_time(started)})"


def judge_owner(tags: dict[str, str]) -> tuple[str, str]:
    host, pidns = tags.get(OWNER_HOST), tags.get(OWNER_PIDNS)
    try:
        pid, started = int(tags[OWNER_PID]), datetime.fromisoformat(tags[OWNER_STARTED]).timestamp()
    except (KeyError, ValueError):
        return UNOWNED, "no owner recorded (an older lockstep, or not lockstep's run)"
    process = owner_of(tags)
    if host != platform.node() or pidns != _pid_namespace():
        where = "another host" if host != platform.node() else f"another pid namespace ({pidns})"
        return ELSEWHERE, f"{process} is on {where}: not checked from here"
    if pid <= 0:
        return UNOWNED, f"owner pid {pid} is not a process"
    gone = _process_gone(pid, tags.get(OWNER_MARK), started)
    if gone is None:
        return ALIVE, f"{process} is running"
    return GONE, f"{process} {gone}"


def flow_run_state(flow_run_id: str) -> tuple[str, str, str] | None:
    """(type, name, message) of a flow run's state on the Prefect server in PREFECT_API_URL, or None if
    it cannot be told. A plain GET (no Prefect import: a stage process sweeps too)."""
    try:
        url = f"{os.environ['PREFECT_API_URL'].rstrip('/')}/flow_runs/{uuid.UUID(flow_run_id)}"
    except ValueError:
        return None
    request = urllib.request.Request(url)
    # unredirected: urllib copies ordinary headers to wherever a redirect points, another host too
    if auth := os.environ.get("PREFECT_API_AUTH_STRING"):
        request.add_unredirected_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    elif key := os.environ.get("PREFECT_API_KEY"):
        request.add_unredirected_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            state = json.load(answer).get("state") or {}
    except (OSError, ValueError) as exc:  # unreachable, refused, not JSON: the run is left alone
        log.debug("Prefect flow run %s: state not read: %s", flow_run_id, exc)
        return None
    return str(state.get("type")), str(state.get("name")), one_line(str(state.get("message") or ""))[:300]


def session_owner() -> tuple[str, psutil.Process]:
    """The process every stage process of one `dvc repro` / `dvc exp run` invocation shares: that dvc
    process ("dvc"), or this process itself ("process") outside DVC."""
    me = psutil.Process()
    for proc in me.parents():
        try:
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        if "dvc" in (Path(part).name for part in cmd[:3]):  # `dvc ...` or `python -m dvc ...`
            return "dvc", proc
    return "process", me


def session_key(owner: tuple[str, psutil.Process] | None = None) -> str:
    """An id shared by every stage process of one `dvc repro` / `dvc exp run` invocation."""
    kind, proc = owner or session_owner()
    return f"{kind}:{proc.pid}:{start_mark(proc)}"  # the same at every stage, whatever the clock does
