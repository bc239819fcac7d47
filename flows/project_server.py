"""The project's running Prefect server, found by the commands that would otherwise start one.

`make schedule` runs a Prefect server for the project until it is stopped (flows/deployments.py
`local_server`). A `make run` or `make sweep` in another shell used to start a second server of its own
on the same database: ~5 CPU-seconds of Prefect's imports before it answers, 5 s of a 26 s digits run on
2 cores (benchmarks/results/b2-amd-zen3.json: the flow 1.47x the plain stage calls with its own server,
1.27x against one already running). So the serving process writes where its server is, and the
commands run against it while it answers, as they run against PREFECT_API_URL when the user sets it.

What is written, PREFECT_HOME/server.json: the API's loopback URL, the server's PID and the Prefect
version it runs; not its auth string, which stays in PREFECT_HOME/api-auth (mode 0600). A command sends
that string only to a server that this file names and that is, by the process table, that PID's
`prefect server start` listening on that loopback port with the Prefect version installed here;
anything else (a stale file, another program on the port, an upgrade, a string of the user's own) and
the command starts its own server, as before, saying why where the file was there but not usable.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import urllib.error
import urllib.request
from importlib.metadata import version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil

from tasks.core.atomic import write_text

log = logging.getLogger(__name__)

STATE_FILE = "server.json"
MAX_STATE_BYTES = 4096  # the file is three short fields; anything larger is not ours
LOOPBACK = ("127.0.0.1", "::1")
CHECK_TIMEOUT_S = 2.0  # a server on this machine that does not answer in 2 s is not one to run against


def loopback_url(host: str, port: int) -> str:
    """The API's URL as a client on this machine reaches it (a server bound to every address included)."""
    host = "127.0.0.1" if host in ("0.0.0.0", "localhost") else "::1" if host == "::" else host
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}/api"


def record(home: Path, host: str, port: int, pid: int) -> None:
    """Say that the server `pid` on host:port serves the project whose Prefect state is in `home`
    (a server bound to another machine's address only is not recorded: the commands reach it by
    PREFECT_API_URL)."""
    url = loopback_url(host, port)
    if urlsplit(url).hostname not in LOOPBACK:
        return
    state = {"api_url": url, "pid": pid, "prefect": version("prefect")}
    write_text(home / STATE_FILE, json.dumps(state) + "\n")


def forget(home: Path, pid: int) -> None:
    """Remove the record of server `pid`, if the file still names it (not a newer server's)."""
    path = home / STATE_FILE
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass  # gone, or not a record of ours: nothing of `pid`'s to remove


def find(home: Path, auth_file: Path) -> tuple[str, str] | None:
    """(API URL, auth string) of the project's running server, checked as the module says; None if
    there is none to run against."""
    path = home / STATE_FILE
    if not path.exists():
        return None
    try:
        url, pid = _read(path)
        auth = _auth_string(auth_file)
        _check_process(pid, url)
        _check_answers(url, auth)
    except _NotUsable as exc:
        # a server that stopped is the usual reason, and says nothing the user must act on; the others do
        level = logging.INFO if exc.stopped else logging.WARNING
        log.log(level, "%s: %s; starting a Prefect server for this run", path, exc)
        return None
    return url, auth


class _NotUsable(Exception):
    """Why the recorded server is not one to run against; `stopped`: because it is gone."""

    def __init__(self, reason: str, stopped: bool = False) -> None:
        super().__init__(reason)
        self.stopped = stopped


def _read(path: Path) -> tuple[str, int]:
    try:
        if path.stat().st_size > MAX_STATE_BYTES:
            raise _NotUsable(f"larger than {MAX_STATE_BYTES} bytes")
        state: Any = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _NotUsable(f"not readable as JSON ({exc})") from None
    if not isinstance(state, dict):
        raise _NotUsable("expected a JSON object")
    url, pid, prefect = state.get("api_url"), state.get("pid"), state.get("prefect")
    if not isinstance(url, str) or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise _NotUsable("expected api_url (a string) and pid (a positive integer)")
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname not in LOOPBACK or parts.port is None or parts.path != "/api":
        raise _NotUsable(f"api_url {url!r} is not http://127.0.0.1:PORT/api (a server elsewhere: set PREFECT_API_URL)")
    if prefect != version("prefect"):
        raise _NotUsable(f"the server runs Prefect {prefect}, this environment {version('prefect')}")
    return url, pid


def _auth_string(auth_file: Path) -> str:
    try:
        auth = auth_file.read_text().strip()
    except OSError as exc:
        raise _NotUsable(f"no auth string to send it ({auth_file}: {exc.strerror})") from None
    if ":" not in auth:
        raise _NotUsable(f"{auth_file} does not hold 'user:password'")
    return auth


def _check_process(pid: int, url: str) -> None:
    """That `pid` is a `prefect server start` of this user's, listening on the URL's port."""
    port = urlsplit(url).port
    try:
        process = psutil.Process(pid)
        command = process.cmdline()
        if process.uids().real != os.getuid():
            raise _NotUsable(f"process {pid} is another user's")
        # the machine's sockets, this PID's: psutil.net_connections, not Process.net_connections (psutil >= 6)
        listening = {
            c.laddr.port for c in psutil.net_connections("inet") if c.pid == pid and c.status == psutil.CONN_LISTEN
        }
    except psutil.NoSuchProcess:
        raise _NotUsable(f"its server (process {pid}) is gone", stopped=True) from None
    except psutil.Error as exc:
        raise _NotUsable(f"process {pid} cannot be inspected ({type(exc).__name__})") from None
    words = " ".join(command)
    if "prefect" not in words or "server start" not in words:
        raise _NotUsable(f"process {pid} is not a Prefect server")
    if port not in listening:
        raise _NotUsable(f"process {pid} does not listen on port {port}")


def _check_answers(url: str, auth: str) -> None:
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
    request = urllib.request.Request(f"{url}/admin/version", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=CHECK_TIMEOUT_S) as response:
            response.read(256)
    except urllib.error.HTTPError as exc:
        hint = " (a string of the user's own: set PREFECT_API_URL and PREFECT_API_AUTH_STRING)"
        raise _NotUsable(f"its server answered HTTP {exc.code}{hint if exc.code in (401, 403) else ''}") from None
    except OSError as exc:
        raise _NotUsable(f"its server does not answer ({getattr(exc, 'reason', exc)})") from None
