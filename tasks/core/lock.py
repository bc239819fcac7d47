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
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from tasks.core.atomic import write_text
from tasks.core.errors import ExpectedFailure, Refused
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
        )
    except psycopg.Error as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        raise LockUnavailable(f"{where}: cannot take the pipeline lock: {reason}; nothing run") from None
    try:
        _acquire(conn, where, wait_s, logger)
        conn.execute("SELECT set_config('application_name', %s, false)", (_application_name(holder),))
        try:
            yield
        finally:
            try:
                conn.execute("SELECT pg_advisory_unlock(%s)", (LOCK_KEY,))
            except psycopg.Error:
                # The session is gone (PostgreSQL restarted, the network cut), and the lock with it,
                # maybe while this run was still writing: say so; the run's result stands.
                logger.error("%s: the connection holding the pipeline lock was lost during this run", where)
    finally:
        conn.close()  # never raises, a lost connection too


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
