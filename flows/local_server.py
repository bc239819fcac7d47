"""The Prefect servers the project's commands start (`LocalServer`): `make schedule`'s, the one a run keeps
(flows/kept_server.py) and the one a run starts for itself (flows/prefect_env.py `local_api`), with their
credentials and their wait for an answer.

The servers we start are locked down with what Prefect offers, since by default one answers any
origin with no credentials: a web page, or DNS rebinding, could otherwise start runs through the
user's browser. Each requires an API auth string (HTTP basic: `lockstep:<random>`; a page does not
know it, so a rebound host name gets 401), CSRF tokens on every change, and CORS only for the
server's own origin. The project's string is made once and kept in PREFECT_HOME/api-auth (mode
0600) for the other shells and the UI's login (`make schedule`'s server and a kept one use it); a server
a run starts for itself gets a new one each time.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from filelock import FileLock

from flows import prefect_settings, project_server
from tasks.core import processes
from tasks.core.processes import stop_group

# a cold `prefect server start` (database migrations) takes ~20 s on 2 cores; a warm one ~3 s
SERVER_START_TIMEOUT_S = 180
AUTH_FILE = project_server.AUTH_FILE
AUTH_USER = "lockstep"


def prefect_home() -> Path:
    return Path(os.environ.get("PREFECT_HOME", prefect_settings.defaults()["PREFECT_HOME"]))


def new_auth_string() -> str:
    return f"{AUTH_USER}:{secrets.token_urlsafe(24)}"


def project_auth_string(home: Path) -> str:
    """The auth string kept in `home`/api-auth, made (mode 0600) on first use; never printed or logged."""
    path = home / AUTH_FILE
    if not path.exists():
        home.mkdir(parents=True, exist_ok=True)
        staging = home / f".{AUTH_FILE}.{os.getpid()}"
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(new_auth_string() + "\n")
        try:  # a link, not a rename: of two servers starting at once, the first one's string stays
            os.link(staging, path)
        except FileExistsError:
            pass
        finally:
            staging.unlink()
    value = path.read_text().strip()
    if ":" not in value:
        raise RuntimeError(f"{path}: expected 'user:password' (delete the file to make a new one)")
    return value


def secure_server_env(env: dict[str, str], host: str, port: int, auth_string: str) -> None:
    """Auth, CSRF, CORS and the UI's API URL for a server we start, each unless the user set it."""
    env.setdefault("PREFECT_SERVER_API_AUTH_STRING", auth_string)
    env.setdefault("PREFECT_SERVER_CSRF_PROTECTION_ENABLED", "true")
    origin_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host  # the UI calls its own origin
    env.setdefault("PREFECT_SERVER_CORS_ALLOWED_ORIGINS", f"http://{origin_host}:{port}")
    # the API the UI's pages call: Prefect would otherwise tell them the default port (4200) whatever
    # port the server runs on, and the UI says "Can't connect to Server API"
    env.setdefault("PREFECT_SERVER_UI_API_URL", f"http://{origin_host}:{port}/api")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the server may still lose a race for it: it then exits)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class LocalServer:
    """`prefect server start` on `host:port` (127.0.0.1 unless asked), in its own process group.

    Started on construction and not waited for, so that callers can do their own start-up (imports)
    while it comes up; `wait()` returns its API URL once it answers. `ephemeral`: the server one
    flow run needs, as Prefect's own ephemeral mode runs it (no UI; of the background services only
    those that record task runs, events and logs: no scheduling, late-run marking or cleanup loops,
    which are `make schedule`'s server's job), but started before, not after, the caller's imports.
    `die_with_parent`: it never outlives the process that started it, however that one ends.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        ephemeral: bool = False,
        quiet: bool = False,
        die_with_parent: bool = False,
    ) -> None:
        self.host, self.port = host, port or free_port(host)
        # the project's settings (analytics off...) for the server whoever starts it, the user's first
        env = {**prefect_settings.defaults(), **os.environ, "PREFECT_HOME": str(prefect_home())}
        if "PREFECT_SERVER_API_AUTH_STRING" not in env:
            auth = new_auth_string() if ephemeral else project_auth_string(prefect_home())
            secure_server_env(env, host, self.port, auth)
        else:  # the user's own string
            secure_server_env(env, host, self.port, env["PREFECT_SERVER_API_AUTH_STRING"])
        # what a client of this server sends (PREFECT_API_AUTH_STRING); a secret, masked in logs
        self.auth_string = env["PREFECT_SERVER_API_AUTH_STRING"]
        # One server at a time creates or migrates the project's Prefect database: two `make run`s
        # started together raced there and one server died ("table artifact has no column named
        # task_run_state_id"). Held until this server answers (`wait`), or fails to.
        Path(env["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
        self._starting: FileLock | None = FileLock(Path(env["PREFECT_HOME"]) / "server-start.lock")
        self._starting.acquire(timeout=SERVER_START_TIMEOUT_S)
        if ephemeral:  # what Prefect sets for its own ephemeral server (prefect/server/api/server.py)
            env["PREFECT__SERVER_EPHEMERAL"] = "1"
            # No block catalogue: registering every installed block type at start loads each Prefect
            # collection first (prefect-dask: Dask's import), ~1 of the ~8 CPU-seconds this server takes
            # to answer on 2 cores (measured 2026-12-02). A flow run saves no block; a block saved to
            # it registers its own type (`Block.save`); the catalogue is for the UI, which this server
            # does not serve. The environment the user set wins.
            env.setdefault("PREFECT_SERVER_REGISTER_BLOCKS_ON_START", "false")
            env.setdefault("PREFECT_SERVER_MEMOIZE_BLOCK_AUTO_REGISTRATION", "false")
        # quiet: its output goes to a file (shown if it fails to start), not a pipe, which a chatty
        # server would fill and block on
        self._log = tempfile.TemporaryFile(mode="w+", prefix="lockstep-prefect-server-") if quiet else None
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prefect",
                "server",
                "start",
                "--host",
                host,
                "--port",
                str(self.port),
                *(["--no-ui"] if ephemeral else []),
            ],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT if quiet else None,
            start_new_session=True,
            # (`prefect server start` with one worker is a single process: this reaches uvicorn)
            preexec_fn=processes.die_with_parent if die_with_parent else None,
        )

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.port}/api"

    def wait(self, timeout_s: float = SERVER_START_TIMEOUT_S) -> str:
        """Block until the server answers; its API URL. Raises (with its output) if it exits first."""
        try:
            wait_until_healthy(f"{self.api_url}/health", self.proc, timeout_s)
        except RuntimeError as exc:
            if self._log is None:
                raise
            self._log.seek(0)
            raise RuntimeError(f"{exc}\nserver output:\n{self._log.read()[-3000:]}") from None
        finally:
            self._started()
        return self.api_url

    def _started(self) -> None:
        if self._starting is not None:
            self._starting.release()
            self._starting = None

    def stop(self) -> None:
        """SIGTERM its process group (uvicorn and the services), SIGKILL after 30 s."""
        self._started()
        stop_group(self.proc)
        if self._log is not None:
            self._log.close()


def wait_until_healthy(url: str, proc: subprocess.Popen[Any], timeout_s: float) -> None:
    """Return once `url` answers 200; raise if `proc` (the server) exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{' '.join(map(str, proc.args))} exited with code {proc.returncode} before {url} "
                "answered (is the port in use?)"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout_s:g} s")
