"""The project's running Prefect server, found by the commands that would otherwise start one.

`make schedule` runs a Prefect server for the project until it is stopped (flows/deployments.py
`local_server`). A `make run` or `make sweep` in another shell used to start a second server of its own
on the same database: ~5 CPU-seconds of Prefect's imports before it answers on 2 cores. Against the
schedule's server a forced digits run took 39.8 s instead of 43.3 s on a Zen 3 EPYC
(benchmarks/results/b2-amd-zen3.json). So the serving process writes where its server is, and the
commands run against it while it answers, as they run against PREFECT_API_URL when the user sets it.

The record, PREFECT_HOME/server.json: the API's loopback port, the server's PID and that process's start
time, and the Prefect version it runs; not its auth string, which stays in PREFECT_HOME/api-auth (mode
0600). A command sends that string to the recorded port only if, by the process table, the recorded
process (same PID, same start time: not a reused PID) is this user's `prefect server start --port PORT`
listening on that loopback address, no HTTP proxy is configured (the request would go through it), and
the server then reports the Prefect version installed here. The request is made with http.client: no
proxy, no redirect. Anything else, and the command starts its own server as before, saying why (at
INFO where the recorded server has simply stopped). What no check closes: the port freed by a server
that stops between the checks and the run's later calls, which Prefect's client then sends the string to
(docs/operations-and-retraining.md).
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import stat
import urllib.request
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psutil

from tasks.core.atomic import write_text

log = logging.getLogger(__name__)

RECORD_FILE = "server.json"
AUTH_FILE = "api-auth"  # the project server's `user:password`, mode 0600 (local_server.project_auth_string)
MAX_RECORD_BYTES = 4096  # a few short fields; anything larger is not ours
CHECK_TIMEOUT_S = 2.0  # a server on this machine that does not answer in 2 s is not one to run against
# The addresses a record may name, and the wildcard a server bound to every address of that family uses
LOOPBACK = {"127.0.0.1": "0.0.0.0", "::1": "::"}


class NotUsable(Exception):
    """Why the recorded server is not one to run against; `stopped`: because it is gone."""

    def __init__(self, reason: str, stopped: bool = False) -> None:
        super().__init__(reason)
        self.stopped = stopped


def record(home: Path, host: str, port: int, pid: int, auth_string: str) -> None:
    """Say that the server `pid` on host:port serves the project whose Prefect state is in `home`.

    Not recorded: a server bound to a non-loopback address of this machine only (the commands reach it
    by PREFECT_API_URL), or one asking for an auth string other than api-auth's (the user's own, which
    the commands do not know)."""
    address = {"0.0.0.0": "127.0.0.1", "localhost": "127.0.0.1", "::": "::1"}.get(host, host)
    try:
        project_string = read_small(home / AUTH_FILE).strip()
    except NotUsable:
        return
    if address not in LOOPBACK or project_string != auth_string:
        return
    started = psutil.Process(pid).create_time()
    entry = {"address": address, "port": port, "pid": pid, "started": started, "prefect": version("prefect")}
    write_text(home / RECORD_FILE, json.dumps(entry) + "\n")


def forget(home: Path, pid: int) -> None:
    """Remove the record of server `pid`, if the file still names it (not a newer server's)."""
    path = home / RECORD_FILE
    try:
        if json.loads(read_small(path)).get("pid") == pid:
            path.unlink()
    except (NotUsable, OSError, ValueError, AttributeError):
        pass  # gone, or not a record of ours: nothing of `pid`'s to remove


def find(home: Path) -> tuple[str, str] | None:
    """(API URL, auth string) of the project's running server, checked as the module says; None if
    there is none to run against."""
    path = home / RECORD_FILE
    if not path.exists():
        return None
    installed = version("prefect")
    try:
        address, port, pid, started = _read(path, installed)
        auth = read_small(home / AUTH_FILE).strip()
        if ":" not in auth:
            raise NotUsable(f"{home / AUTH_FILE} does not hold 'user:password'")
        _refuse_proxies()
        _check_process(pid, started, address, port)
        _check_answers(address, port, auth, installed)
    except NotUsable as exc:
        # a server that stopped is the usual reason, and says nothing the user must act on; the others do
        level = logging.INFO if exc.stopped else logging.WARNING
        log.log(level, "%s: %s; starting a Prefect server for this run", path, exc)
        return None
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}/api", auth


def basic_auth(auth_string: str) -> str:
    """The Authorization header's value for a Prefect server's `user:password` auth string."""
    return "Basic " + base64.b64encode(auth_string.encode()).decode()


def read_small(path: Path, limit: int = MAX_RECORD_BYTES) -> str:
    """A small regular file's text; not a link, a FIFO or a device, whose reads could block or not end."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        raise NotUsable(f"{path}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotUsable(f"{path} is not a regular file")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise NotUsable(f"{path} is larger than {limit} bytes")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise NotUsable(f"{path} is not text") from None


def _read(path: Path, installed: str) -> tuple[str, int, int, float]:
    try:
        entry: Any = json.loads(read_small(path))
    except ValueError as exc:
        raise NotUsable(f"not readable as JSON ({exc})") from None
    if not isinstance(entry, dict):
        raise NotUsable("expected a JSON object")
    address, port, pid, started = (entry.get(key) for key in ("address", "port", "pid", "started"))
    if address not in LOOPBACK:
        raise NotUsable(f"address {address!r} is not 127.0.0.1 or ::1 (a server elsewhere: set PREFECT_API_URL)")
    if not all(_positive_int(value) for value in (port, pid)) or port > 65535 or not isinstance(started, float):
        raise NotUsable("expected port and pid (positive integers) and started (a time)")
    if entry.get("prefect") != installed:
        raise NotUsable(f"the server runs Prefect {entry.get('prefect')}, this environment {installed}")
    return address, port, pid, started


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def proxies_set() -> list[str]:
    """The HTTP proxies set in the environment (`http`, `all`): where one is, no recorded server is used.

    Prefect's client (httpx) would send the run's calls, auth string included, through it unless NO_PROXY
    names the address; rather than second-guess two libraries' bypass rules, a run with a proxy set starts
    its own server (a string made for that run alone)."""
    return sorted(name for name in urllib.request.getproxies() if name in ("http", "all"))


def _refuse_proxies() -> None:
    proxies = proxies_set()
    if proxies:
        raise NotUsable(f"a proxy is set ({', '.join(proxies)}_proxy), through which the auth string would go")


def _check_process(pid: int, started: float, address: str, port: int) -> None:
    """That `pid` is the recorded process, this user's `prefect server start --port PORT`, listening on
    the recorded address (or its family's wildcard) and port."""
    try:
        process = psutil.Process(pid)
        if process.create_time() != started:
            raise NotUsable(f"its server (process {pid}) is gone: the PID is another process's now", stopped=True)
        command = process.cmdline()
        if process.uids().real != os.getuid():
            raise NotUsable(f"process {pid} is another user's")
        # the machine's sockets, this PID's: Process.net_connections needs psutil >= 6, pyproject allows 5.9
        sockets = psutil.net_connections("inet")
        bound = {(c.laddr.ip, c.laddr.port) for c in sockets if c.pid == pid and c.status == psutil.CONN_LISTEN}
    except psutil.NoSuchProcess:
        raise NotUsable(f"its server (process {pid}) is gone", stopped=True) from None
    except psutil.Error as exc:
        raise NotUsable(f"process {pid} cannot be inspected ({type(exc).__name__})") from None
    if not (_has(command, "prefect", "server", "start") and _has(command, "--port", str(port))):
        raise NotUsable(f"process {pid} is not `prefect server start --port {port}`")
    if not {(address, port), (LOOPBACK[address], port)} & bound:
        raise NotUsable(f"process {pid} does not listen on {address} port {port}")


def _has(command: list[str], *words: str) -> bool:
    """Whether `words` appear in `command`, one after another."""
    return any(command[i : i + len(words)] == list(words) for i in range(len(command)))


def _check_answers(address: str, port: int, auth: str, installed: str) -> None:
    """That the server answers, with this user's string, the Prefect version installed here."""
    connection = http.client.HTTPConnection(address, port, timeout=CHECK_TIMEOUT_S)
    headers = {"Authorization": basic_auth(auth)}
    try:
        connection.request("GET", "/api/admin/version", headers=headers)
        response = connection.getresponse()
        body = response.read(256)
    except (OSError, http.client.HTTPException) as exc:
        raise NotUsable(f"its server does not answer ({exc})") from None
    finally:
        connection.close()
    if response.status in (401, 403):
        raise NotUsable(
            f"its server refused the string in api-auth (HTTP {response.status}): if you gave it one of your own, "
            "set PREFECT_API_URL and PREFECT_API_AUTH_STRING"
        )
    try:
        reported = json.loads(body)
    except ValueError:
        reported = None
    if response.status != 200 or reported != installed:
        raise NotUsable(f"its server answered HTTP {response.status}, {body[:60]!r}: not Prefect {installed}")
