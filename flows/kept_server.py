"""A Prefect server kept for the project's next runs (`make run`, `make sweep`), and the process that keeps it.

A run that finds no server to report to (PREFECT_API_URL unset, no `make schedule` server:
flows/project_server.py) used to start one for itself and stop it as it ended: every run then waited for
that server's start, 5-7 CPU-seconds of Prefect's imports on 2 cores (B2 in docs/benchmarks.md). Now the run
starts a keeper, detached from it (this module, `keep`): the keeper starts the server, records it as the
project's server (`project_server.record`, so the same checks admit it), and stops it once no run has used
it for IDLE_ENV seconds (IDLE_S by default). A later run within that time reports to it at once.

Runs hold a shared lock on PREFECT_HOME/kept-server.lock while they use the project's server and touch
PREFECT_HOME/kept-server.used as they start and end; the keeper stops its server only with that lock held
exclusively, so no run loses its server halfway. One keeper per project: each holds
PREFECT_HOME/keeper.lock for its life; one that finds it held leaves the project to the other.

    LOCKSTEP_PREFECT_SERVER_IDLE_S=0 make run   # keep none: the run starts its own server and stops it
    python -m flows.kept_server stop            # stop the kept server now, once the runs using it end
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import psutil

from flows import local_server, prefect_settings, project_server
from tasks.core.layout import ROOT
from tasks.core.redact import SECRET_NAME

IDLE_ENV = "LOCKSTEP_PREFECT_SERVER_IDLE_S"
IDLE_S = 600.0  # ten minutes: the next run of someone at work on the project, not tomorrow's
POLL_S = 2.0  # how often the keeper checks whether its server is still used
IN_USE = "kept-server.lock"
USED = "kept-server.used"
KEEPER_LOCK = "keeper.lock"
LOG_FILE = "kept-server.log"

log = logging.getLogger(__name__)


def idle_s() -> float:
    """Seconds a kept server waits unused before it stops (IDLE_ENV); 0: no server is kept."""
    text = os.environ.get(IDLE_ENV, "").strip()
    if not text:
        return IDLE_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise ValueError(f"{IDLE_ENV}={text!r}: expected seconds, a number >= 0 (0: keep no Prefect server)")
    return value


class KeptServer:
    """The project's server for one run: `make schedule`'s or a kept one, started here if none runs.

    Constructed before the run's own start-up (imports), which then overlaps the server's; `wait()` gives
    (API URL, auth string); `release()` when the run is over."""

    def __init__(self, home: Path) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self._in_use: IO[str] | None = open(home / IN_USE, "a")  # noqa: SIM115 (held until release)
        fcntl.flock(self._in_use, fcntl.LOCK_SH)  # waits while a keeper stops its server
        self.found = project_server.find(home)
        self.keeper: subprocess.Popen[bytes] | None = None
        self._record_was, self._asked = _record_time(home), time.monotonic()
        if self.found is None:
            self.keeper = _start_keeper(home)
            print(
                f"Prefect: a server kept for this project's next runs (stops after {idle_s():g} s unused; "
                f"`python -m flows.kept_server stop` stops it now, {IDLE_ENV}=0 keeps none)",
                file=sys.stderr,
            )
        _touch(home / USED)

    @property
    def starting(self) -> bool:
        return self.found is None

    def wait(self, timeout_s: float = local_server.SERVER_START_TIMEOUT_S) -> tuple[str, str]:
        """The server's (API URL, auth string) once it answers; raises, with the keeper's log, if it cannot."""
        deadline = time.monotonic() + timeout_s
        while self.found is None:
            exited = self.keeper.poll() if self.keeper is not None else None
            if exited is not None and not _held(self.home / KEEPER_LOCK):
                # no keeper left: ours failed, or left the project to another one, which stopped since
                if exited != 0:
                    raise RuntimeError(
                        f"the kept Prefect server did not start (its keeper exited with code {exited}; set "
                        f"{IDLE_ENV}=0 to start one for each run instead); {self.home / LOG_FILE}:\n"
                        + _tail(self.home / LOG_FILE)
                    )
                self.keeper = _start_keeper(self.home)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the kept Prefect server did not answer within {timeout_s:g} s; {self.home / LOG_FILE}:\n"
                    + _tail(self.home / LOG_FILE)
                )
            time.sleep(0.1)
            recorded = _record_time(self.home)
            # asked when a keeper records its server, and again each second while a record stands (a busy
            # machine's server may not answer the first check in time)
            if recorded is not None and (recorded != self._record_was or time.monotonic() - self._asked >= 1):
                self._record_was, self._asked = recorded, time.monotonic()
                self.found = project_server.find(self.home)
        return self.found

    def release(self) -> None:
        if self._in_use is not None:
            _touch(self.home / USED)
            self._in_use.close()  # and the lock with it
            self._in_use = None


def _start_keeper(home: Path) -> subprocess.Popen[bytes]:
    """`python -m flows.kept_server keep`, in a session of its own and writing to LOG_FILE: it outlives the
    run and holds none of its pipes (a `make run | tee` ends with the run). Its environment lacks the run's
    secrets (names as tasks/core/redact.py reads them), which a server has no use for."""
    env = {name: value for name, value in os.environ.items() if not SECRET_NAME.search(name)}
    with open(home / LOG_FILE, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "flows.kept_server", "keep"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def keep(home: Path) -> int:
    """The keeper's life: the server started and recorded, stopped once unused for `idle_s()` (or on SIGTERM)."""
    limit = idle_s()
    keeper = open(home / KEEPER_LOCK, "a+")  # noqa: SIM115 (held for the keeper's life)
    try:
        fcntl.flock(keeper, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("another keeper keeps this project's server", flush=True)
        return 0
    keeper.truncate(0)
    keeper.write(f"{os.getpid()}\n")
    keeper.flush()
    # the string recorded servers answer to (api-auth), which the runs that find it read
    os.environ["PREFECT_SERVER_API_AUTH_STRING"] = local_server.project_auth_string(home)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the `finally` below stops the server
    server = _started()
    unused: IO[str] | None = None
    try:
        project_server.record(home, server.host, server.port, server.proc.pid, server.auth_string)
        _touch(home / USED)  # unused from now on, not since whatever run came last
        print(f"serving {server.api_url} (pid {server.proc.pid}) until unused for {limit:g} s", flush=True)
        while server.proc.poll() is None and (unused := _unused_for(home, limit)) is None:
            time.sleep(POLL_S)
    finally:
        # No longer recorded, stopped and the project left to a new keeper, all before a run waiting
        # for `unused`'s lock may look for a server again
        project_server.forget(home, server.proc.pid)
        server.stop()
        keeper.close()
        if unused is not None:
            unused.close()
    return 0


def _started(attempts: int = 3) -> local_server.LocalServer:
    """A server that answers. `free_port` cannot reserve the port it finds: another process may take it
    before the server binds it (tests start many at once), and the server then exits; so a few tries."""
    for _ in range(attempts - 1):
        server = local_server.LocalServer(ephemeral=True, quiet=True, die_with_parent=True)
        try:
            server.wait()
            return server
        except RuntimeError as exc:
            server.stop()
            if "exited with code" not in str(exc):
                raise
            print(f"the server's start failed, trying another port: {exc}", flush=True)
    server = local_server.LocalServer(ephemeral=True, quiet=True, die_with_parent=True)
    server.wait()  # the last try: its failure is the keeper's
    return server


def _unused_for(home: Path, limit: float) -> IO[str] | None:
    """IN_USE, locked exclusively, if no run uses the server and none has for `limit` seconds; else None."""
    in_use = open(home / IN_USE, "a")  # noqa: SIM115 (returned locked, or closed here)
    try:
        fcntl.flock(in_use, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if time.time() - (home / USED).stat().st_mtime >= limit:
            return in_use
    except (BlockingIOError, FileNotFoundError):  # a run uses it; the keeper's touch removed
        pass
    in_use.close()
    return None


def stop(home: Path, timeout_s: float = 60) -> bool:
    """Stop the project's kept server once the runs using it end; whether one was running."""
    with open(home / IN_USE, "a") as in_use:
        fcntl.flock(in_use, fcntl.LOCK_EX)  # no run uses it from here on
        try:
            pid = int((home / KEEPER_LOCK).read_text().strip() or -1)
        except (FileNotFoundError, ValueError):
            return False
        if not _held(home / KEEPER_LOCK) or not _is_keeper(pid):
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _held(home / KEEPER_LOCK) and time.monotonic() < deadline:
            time.sleep(0.1)
        return True


def _is_keeper(pid: int) -> bool:
    try:
        return psutil.Process(pid).cmdline()[-3:] == ["-m", "flows.kept_server", "keep"]
    except (psutil.Error, ValueError):
        return False


def _held(path: Path) -> bool:
    """Whether another process holds `path`'s lock."""
    with open(path, "a") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


def _touch(path: Path) -> None:
    path.touch()  # its time: when a run last used the server


def _record_time(home: Path) -> int | None:
    try:
        return (home / project_server.RECORD_FILE).stat().st_mtime_ns
    except FileNotFoundError:
        return None


def _tail(path: Path, limit: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError as exc:
        return f"(unreadable: {exc})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flows.kept_server", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "command", choices=["stop", "keep"], help="stop: the project's kept server; keep: what a run starts"
    )
    command = parser.parse_args(argv).command
    prefect_settings.configure()  # the project's Prefect defaults, PREFECT_HOME among them
    home = local_server.prefect_home()
    if command == "keep":
        return keep(home)
    print("stopped the kept Prefect server" if stop(home) else "no kept Prefect server runs for this project")
    return 0


if __name__ == "__main__":
    sys.exit(main())
