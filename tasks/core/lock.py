"""At most one pipeline run at a time in a project, whichever entry point and whichever host started it.

DVC's own repo lock does not give this: `dvc repro` releases it while a stage's command runs, and
the Prefect flow runs its stages in-process. So the project has one more lock:

- the Prefect flow (`make run`, deployment runs) holds it for its whole run;
- `python -m tasks <stage>`, the command `dvc repro` runs, holds it for its stage.

A run that finds the lock taken waits up to `orchestration.lock_wait_s` for the other to finish,
saying who holds it, then is refused with `PipelineBusy`: nothing is written, so `data/`,
`dvc.lock`, the DVC remote and the MLflow store (runs, registry, champion alias) only ever see one
writer.

Where the lock lives is where its writers meet:

- **one host** (no `LOCKSTEP_PIPELINE_LOCK_URL`): a file lock in the checkout (`filelock`: flock,
  released by the kernel if the holder dies, so a SIGKILLed run never leaves a stale lock);
- **a team stack** (`LOCKSTEP_PIPELINE_LOCK_URL`, set by the stack's client environment,
  `source $LOCKSTEP_STACK_DIR/env`): a session-level advisory lock in the stack's PostgreSQL, which
  every host that writes the shared registry and DVC remote reaches. A second host never sees the
  first one's file, and two trainers would both train, push and move the champion. PostgreSQL
  releases a session's advisory locks when its connection ends, so a killed run frees it as the
  file lock does (a host that vanishes: when TCP keepalives give up, ~1 min, set below).

A session can also end under a run that is alive: PostgreSQL restarted, or the run's host cut off
the network (the server then drops the session after its keepalives, and another host may take the
lock). The holder does not find out by itself, so it asks its session every CHECK_S seconds, and a
question left unanswered for USER_TIMEOUT_MS fails (TCP_USER_TIMEOUT): it learns of the loss within
CHECK_S + USER_TIMEOUT_MS, well before the server would let another host in (KEEPALIVE, ~60 s). It
then stops at once, as a SIGKILLed run would (`_stop_the_run`: every output is written
all-or-nothing, its MLflow runs are marked KILLED by the next run's sweep, Prefect marks its flow run
crashed), and does not try to take the lock back: another run may hold it by then, or have held it
and gone, and two runs must never write the registry, the champion alias or the DVC remote at once.
A restart of PostgreSQL thus costs the run in progress; the next one (the schedule's, or a retry)
starts clean.

Not Prefect's global concurrency limits: they live in one Prefect server, and `make run` (Prefect's
ephemeral server) and `dvc repro` (no server) would not see them; a slot held by a killed process
stays taken until its lease expires (300 s by default in Prefect 3.8), and a slot does not say who
holds it. Nor Prefect's deployment concurrency limit (flows/deployments.py says why).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from tasks.core.atomic import write_text
from tasks.core.errors import ExitCode, ExpectedFailure, Refused
from tasks.core.layout import ROOT

LOCK_FILE = Path(".dvc/tmp/lockstep-pipeline.lock")
# Who holds it, for the message a waiting run prints. A separate file: filelock truncates the lock
# file itself on every attempt to take it.
HOLDER_FILE = Path(".dvc/tmp/lockstep-pipeline.holder.json")

# A libpq URL (postgresql://user@host:port/database; the password from PGPASSFILE, never the URL)
LOCK_URL_ENV = "LOCKSTEP_PIPELINE_LOCK_URL"
# The lock's key among the database's advisory locks (one bigint space per database): a hash of a
# name, so that nothing else using the database picks it by chance.
LOCK_KEY = int.from_bytes(hashlib.sha256(b"lockstep pipeline lock").digest()[:8], "big", signed=True)
POLL_S = 1.0  # how often a waiting run asks again; the wait itself is bounded by lock_wait_s
# The server drops a session whose host stops answering after idle + interval * count seconds:
# a trainer that lost its network or power releases the lock within about a minute.
KEEPALIVE = {"tcp_keepalives_idle": 30, "tcp_keepalives_interval": 10, "tcp_keepalives_count": 3}
# The holder's own check of its session (module doc): a query every CHECK_S seconds, and the kernel
# drops the connection when what it sent stays unacknowledged for USER_TIMEOUT_MS (a cut link). Their
# sum stays well under the server's drop time above (30 + 3 * 10 s), so that a host cut off knows it
# lost the lock before any other host can take it.
CHECK_S = 5.0
USER_TIMEOUT_MS = 20_000

log = logging.getLogger(__name__)


class PipelineBusy(Refused):
    """Another pipeline run held the project lock for longer than we were allowed to wait."""


class LockUnavailable(ExpectedFailure):
    """The shared lock's database cannot be reached: no run may start without the lock."""


@contextmanager
def pipeline_lock(
    holder: str, wait_s: float, root: Path = ROOT, logger: logging.Logger | logging.LoggerAdapter[Any] = log
) -> Iterator[None]:
    """Hold the project's pipeline lock for the block; `holder` names this run in others' messages.
    A wait is reported on `logger` (the flow passes its run logger, so the wait shows in Prefect).
    The lock is PostgreSQL's when LOCKSTEP_PIPELINE_LOCK_URL is set, else a file in `root`."""
    url = os.environ.get(LOCK_URL_ENV, "").strip()
    held = _database_lock(url, holder, wait_s, logger) if url else _file_lock(holder, wait_s, root, logger)
    with held:
        yield


# --------------------------------------------------------------------------- one host: a file


def _holder(root: Path) -> str:
    try:
        info = json.loads((root / HOLDER_FILE).read_text())
    except (OSError, ValueError):
        return "another pipeline run"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
    return f"{info['holder']} (pid {info['pid']}, since {since})"


@contextmanager
def _file_lock(
    holder: str, wait_s: float, root: Path, logger: logging.Logger | logging.LoggerAdapter[Any]
) -> Iterator[None]:
    (root / LOCK_FILE).parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(root / LOCK_FILE)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.warning("waiting up to %g s for the pipeline run in progress: %s", wait_s, _holder(root))
        try:
            lock.acquire(timeout=wait_s)
        except Timeout:
            raise PipelineBusy(_busy(str(LOCK_FILE), _holder(root), wait_s)) from None
    try:
        write_text(root / HOLDER_FILE, json.dumps({"holder": holder, "pid": os.getpid(), "since": time.time()}))
        yield
    finally:
        (root / HOLDER_FILE).unlink(missing_ok=True)
        lock.release()


def _busy(where: str, who: str, wait_s: float) -> str:
    return (
        f"{where}: another pipeline run is in progress: {who}; waited {wait_s:g} s "
        "(orchestration.lock_wait_s), try again when it ends"
    )


# --------------------------------------------------------------------------- many hosts: PostgreSQL


def _where(url: str) -> str:
    """The lock's database for messages: host, port and database (the CLI masks a URL's user part)."""
    # optional: psycopg (~0.6 s), only for a PostgreSQL lock (the team stack)
    from psycopg.conninfo import conninfo_to_dict

    try:
        parts = conninfo_to_dict(_libpq_url(url))
    except Exception:  # a malformed URL: say which variable, show nothing of it
        raise LockUnavailable(f"{LOCK_URL_ENV}: not a PostgreSQL URL (postgresql://user@host:port/database)") from None
    port = f":{parts['port']}" if parts.get("port") else ""
    return f"postgresql://{parts.get('host', 'localhost')}{port}/{parts.get('dbname', '')} (advisory lock)"


def _libpq_url(url: str) -> str:
    """SQLAlchemy's spelling (postgresql+psycopg://, as the stack's other URLs) is accepted too."""
    scheme, sep, rest = url.partition("://")
    return f"postgresql://{rest}" if sep and scheme.startswith("postgresql+") else url


def _application_name(holder: str) -> str:
    """What other sessions see of this one (pg_stat_activity): at most 63 ASCII characters."""
    suffix = f" on {socket.gethostname()} (pid {os.getpid()})"
    text = holder.encode("ascii", "replace").decode()
    room = 63 - len(suffix)
    return (text if len(text) <= room else text[: max(room - 1, 0)] + "~") + suffix


# The session holding our key, as pg_locks shows it (a bigint key is classid = high, objid = low 32 bits).
HOLDER_QUERY = """
SELECT a.application_name, a.query_start
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.classid::bigint = %s AND l.objid::bigint = %s
"""


def _db_holder(conn: Any) -> str:
    high, low = (LOCK_KEY >> 32) & 0xFFFFFFFF, LOCK_KEY & 0xFFFFFFFF
    row = conn.execute(HOLDER_QUERY, (high, low)).fetchone()
    if row is None:
        return "another pipeline run"
    name, since = row
    # the holder's last statement is the SET that named it, right after it took the lock
    when = f", since {since.astimezone():%Y-%m-%d %H:%M:%S}" if since else ""
    return f"{name or 'a session without a name'}{when}"


@contextmanager
def _database_lock(
    url: str, holder: str, wait_s: float, logger: logging.Logger | logging.LoggerAdapter[Any]
) -> Iterator[None]:
    # optional: psycopg (~0.6 s), only for a PostgreSQL lock (the team stack)
    import psycopg

    where = _where(url)
    options = " ".join(f"-c {name}={value}" for name, value in KEEPALIVE.items())
    try:
        conn = psycopg.connect(
            _libpq_url(url),
            autocommit=True,
            connect_timeout=10,
            application_name="lockstep: waiting for the pipeline lock",
            options=options,
            keepalives=1,
            keepalives_idle=KEEPALIVE["tcp_keepalives_idle"],
            keepalives_interval=KEEPALIVE["tcp_keepalives_interval"],
            keepalives_count=KEEPALIVE["tcp_keepalives_count"],
            tcp_user_timeout=USER_TIMEOUT_MS,
        )
    except psycopg.Error as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        raise LockUnavailable(f"{where}: cannot take the pipeline lock: {reason}; nothing run") from None
    try:
        _acquire(conn, where, wait_s, logger)
        conn.execute("SELECT set_config('application_name', %s, false)", (_application_name(holder),))
        done = threading.Event()
        watch = threading.Thread(
            target=_watch, args=(conn, done, where, logger), name="pipeline-lock-watch", daemon=True
        )
        watch.start()
        try:
            yield
        finally:
            done.set()
            watch.join()  # at most one check in flight: bounded by USER_TIMEOUT_MS
            try:
                conn.execute("SELECT pg_advisory_unlock(%s)", (LOCK_KEY,))
            except psycopg.Error:
                # lost between the watch's last check and the end of the block: the work was done
                # while the lock was held, at most CHECK_S before
                logger.error("%s: the connection holding the pipeline lock was lost during this run", where)
    finally:
        conn.close()  # never raises, a lost connection too


def _watch(conn: Any, done: threading.Event, where: str, logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
    """While the block runs: ask the holding session every CHECK_S whether it is still there; if not,
    the lock is gone too, and the run is stopped (module doc)."""
    # optional: psycopg (~0.6 s), only for a PostgreSQL lock (the team stack)
    import psycopg

    while not done.wait(CHECK_S):
        try:
            conn.execute("SELECT 1")
        except psycopg.Error as exc:
            if done.is_set():  # the block ended meanwhile: the unlock reports it
                return
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            _stop_the_run(
                f"{where}: the connection holding the pipeline lock was lost ({reason}): another run may take "
                "the lock now, so this run stops here, writing nothing more, as a killed run would; run it again",
                logger,
            )
            return


def _stop_the_run(message: str, logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
    """End this process now, from the watching thread: the main thread may be deep in a stage, or
    blocked on a server it cannot reach, and must not write another byte. The message goes to stderr
    (a worker streams it to its log) and to the run's logger first."""
    try:
        logger.error(message)
    finally:
        print(f"error: {message}", file=sys.stderr, flush=True)
        os._exit(ExitCode.FAILED)


def _acquire(conn: Any, where: str, wait_s: float, logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
    """pg_try_advisory_lock, polled until it succeeds or `wait_s` has passed (then PipelineBusy)."""
    deadline = time.monotonic() + wait_s
    warned = False
    while not conn.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_KEY,)).fetchone()[0]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PipelineBusy(_busy(where, _db_holder(conn), wait_s))
        if not warned:
            logger.warning("waiting up to %g s for the pipeline run in progress: %s", wait_s, _db_holder(conn))
            warned = True
        time.sleep(min(POLL_S, left))
