"""The Prefect server the project's commands talk to: the local one they start (`LocalServer`,
`local_api`), a check of the one in PREFECT_API_URL, what a flow run may override, and the zombie-run
automation. Prefect's own settings are flows/prefect_settings.py's.

The servers we start are locked down with what Prefect offers, since by default one answers any
origin with no credentials: a web page, or DNS rebinding, could otherwise start runs through the
user's browser. Each requires an API auth string (HTTP basic: `lockstep:<random>`; a page does not
know it, so a rebound host name gets 401), CSRF tokens on every change, and CORS only for the
server's own origin. `make schedule`'s string is made once and kept in PREFECT_HOME/api-auth (mode
0600) for the other shells and the UI's login; a `make run` server gets a new one each time.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

from filelock import FileLock

from flows import prefect_settings, project_server
from tasks.core.config.base import OverrideRefused
from tasks.core.errors import ExpectedFailure
from tasks.core.processes import stop_group
from tasks.core.redact import redact

# a cold `prefect server start` (database migrations) takes ~20 s on 2 cores; a warm one ~3 s
SERVER_START_TIMEOUT_S = 180


# Comma-separated keys beyond the API allow-list (tasks/core/config/policy.py API_OVERRIDABLE; remote keys
# by name) that flow runs of this process may override: set by `flows.deployments serve --allow-override`
# (the served deployment's runs inherit serve's environment; Prefect's Runner applies no job
# variables) and by `flows.pipeline --set` (the user typed them). Never read for a run of a work
# pool's deployment: there the worker's environment is whatever the worker was started with, and
# the allow-list is the deployment's own (DEPLOYMENT_ALLOW_VARIABLE).
ALLOW_OVERRIDES_ENV = "LOCKSTEP_ALLOW_OVERRIDES"
# The job variable in which `flows.deployments deploy --allow-override` stores the allow-list in the
# deployment's own record; the flow reads it back through the API. The pool's template uses it in no
# job configuration (it reaches no process), and a flow run that sets it is refused (`run_allow_list`).
DEPLOYMENT_ALLOW_VARIABLE = "lockstep_allow_overrides"


def allowed_overrides() -> frozenset[str]:
    return _keys(os.environ.get(ALLOW_OVERRIDES_ENV, ""))


def _keys(text: str) -> frozenset[str]:
    return frozenset(key.strip() for key in text.split(",") if key.strip())


def run_allow_list() -> frozenset[str]:
    """The keys beyond API_OVERRIDABLE that this flow run may change, from where no run can set them.

    - no deployment (`make run`, `python -m flows.pipeline --set`): this process's ALLOW_OVERRIDES_ENV;
    - a served deployment (no work pool): the same, inherited from `serve`;
    - a work pool's deployment: the deployment's own DEPLOYMENT_ALLOW_VARIABLE, read through the API.

    A deployment's run that sets job variables of its own (env, command...; a pool made by `deploy`
    refuses them, but POST /flow_runs/ and other pools do not) is refused here, before its parameters
    are read: OverrideRefused, one line."""
    # Prefect loads where a server is talked to: stack/ and the tests import this module without it (~2 s)
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    flow_run = context.flow_run if context else None
    if flow_run is None or flow_run.deployment_id is None:
        return allowed_overrides()
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment(flow_run.deployment_id)
    own = deployment.job_variables or {}
    set_by_run = sorted(key for key, value in (flow_run.job_variables or {}).items() if own.get(key) != value)
    if set_by_run:
        raise OverrideRefused(
            f"job_variables: {', '.join(set_by_run)} set by this flow run; expected none (a run of "
            f"deployment {deployment.name} takes the deployment's own job variables): nothing run"
        )
    if deployment.work_pool_name is None:
        return allowed_overrides()
    return _keys(str(own.get(DEPLOYMENT_ALLOW_VARIABLE) or ""))


# Zombie flow runs: a flow run whose process died with its host, or lost its network, stays Running
# on the server forever, since nothing is left to report its end (a worker that is alive reports a
# process that exited). Prefect's answer (docs: "Detect zombie flows") is two halves: every flow run
# sends a heartbeat event every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (the stack's client
# environment sets it: stack/state.py FLOW_HEARTBEAT_S), and an automation on the server marks
# Crashed a run that sent one and then neither another nor a final state within MISSED_HEARTBEATS
# periods. `python -m stack up` makes the automation (`ensure_zombie_automation`).
MISSED_HEARTBEATS = 3
HEARTBEAT_ENV = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"
ZOMBIE_AUTOMATION = "lockstep: crash flow runs that stopped sending heartbeats"


def ensure_zombie_automation(api_url: str, auth_string: str, heartbeat_s: int) -> bool:
    """Create the zombie automation on the server at `api_url` for flow runs that send a heartbeat
    every `heartbeat_s`, unless it has one of that name; whether it was created."""
    # Prefect loads where a server is talked to: stack/ and the tests import this module without it (~2 s)
    from prefect.automations import AutomationCore
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    final = ("Completed", "Failed", "Cancelled", "Crashed")
    after_s = MISSED_HEARTBEATS * heartbeat_s
    automation = AutomationCore(
        name=ZOMBIE_AUTOMATION,
        description=f"a flow run that misses {MISSED_HEARTBEATS} heartbeats ({heartbeat_s} s apart) is marked Crashed "
        "(made by `python -m stack up`; flows/prefect_env.py)",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{state}" for state in final)},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=after_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {after_s} s: its process or its host is gone, or cut off "
                f"the network (automation {ZOMBIE_AUTOMATION!r})",
            )
        ],
    )
    settings = {PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth_string}
    with temporary_settings(settings), get_client(sync_client=True) as client:
        if client.read_automations_by_name(ZOMBIE_AUTOMATION):
            return False
        client.create_automation(automation)
    return True


AUTH_FILE = project_server.AUTH_FILE
AUTH_USER = "lockstep"


@contextmanager
def local_api(while_starting: Callable[[], None] | None = None, find_project_server: bool = True) -> Iterator[bool]:
    """Flows called inside run against PREFECT_API_URL if set, else against the project's server if
    one is running (`make schedule`'s: flows/project_server.py) and `find_project_server`, else against
    a server of our own; yields whether the server is ours (it stops with the process:
    flows/local_records.py).

    Prefect's ephemeral mode would start that server too, but only once a flow is called, after
    importing Prefect's server code into this process (~2.5 s) and then waiting ~3 s for it. Started
    here instead, it comes up while the caller's `while_starting` runs (imports): a no-op pipeline run
    is mostly start-up (B3 in benchmarks/: 11.6 -> 7.7 s on 2 cores). With a server already up
    (PREFECT_API_URL) there is no wait to fill, and `while_starting` does not run: a pipeline run that
    then finds nothing stale never needs what it loads (MLflow's client: ~3 of the ~8 CPU-seconds such
    a run took on 2 cores; measured 2026-12-02).
    """
    server, running = None, None
    if os.environ.get("PREFECT_API_URL"):
        check_api()
    elif not find_project_server or (running := project_server.find(prefect_home())) is None:
        server = LocalServer(ephemeral=True, quiet=True, die_with_parent=True)
        # Stopped at exit, as Prefect stops its ephemeral server: exit handlers run last-in first-out,
        # so Prefect's log and event workers (registered later) have sent what they hold by then.
        atexit.register(server.stop)
    if server is not None and while_starting is not None:
        threading.Thread(target=while_starting, daemon=True).start()
    # Prefect loads where a server is talked to (stack/ and the tests import this module without it), and
    # after the server was started: its ~1 s of imports overlaps the server's ~3 s start
    from prefect.settings import (
        PREFECT_API_AUTH_STRING,
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        temporary_settings,
    )

    settings = None
    if server is not None:
        settings = {PREFECT_API_URL: server.wait(), PREFECT_API_AUTH_STRING: server.auth_string}
    elif running is not None:  # the project's server (`make schedule`), found running (project_server.py)
        settings = {PREFECT_API_URL: running[0], PREFECT_API_AUTH_STRING: running[1]}
    if settings and HEARTBEAT_ENV not in os.environ:
        # Heartbeats feed a zombie automation on a server (the stack's: ZOMBIE_AUTOMATION); neither this
        # process's own server nor the project's has one, so none watches them. Prefect's heartbeat thread
        # sleeps in whole seconds and each flow run waits for it to wake at its end
        # (flow_engine._send_heartbeats, 3.8.8): up to a second a run (0.99 s in a profiled no-op
        # --reingest run, 2026-12-05).
        settings[PREFECT_FLOWS_HEARTBEAT_FREQUENCY] = None
    with temporary_settings(settings) if settings else nullcontext():
        yield server is not None


class PrefectUnavailable(ExpectedFailure):
    """The Prefect server in PREFECT_API_URL does not answer, or refuses our credentials."""


def check_api(timeout_s: float = 10) -> None:
    """Fail in seconds, in one line, when the server in PREFECT_API_URL is unreachable or refuses the
    auth string: Prefect's client would raise a traceback from deep inside the flow's start."""
    # Prefect loads where a server is talked to: stack/ and the tests import this module without it (~2 s)
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, PREFECT_API_URL

    url, auth, key = (_plain(s.value()) for s in (PREFECT_API_URL, PREFECT_API_AUTH_STRING, PREFECT_API_KEY))
    headers = {"Authorization": project_server.basic_auth(auth)} if auth else {}
    if key:  # Prefect Cloud's API key
        headers = {"Authorization": f"Bearer {key}"}
    request = urllib.request.Request(f"{url.rstrip('/')}/admin/version", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise PrefectUnavailable(
                f"Prefect server {redact(url)} (PREFECT_API_URL) refused the credentials (HTTP {exc.code}): "
                "check PREFECT_API_AUTH_STRING (or PREFECT_API_KEY)"
            ) from None
        # any other answer (404 from a server without this endpoint, e.g. Prefect Cloud's) is a server
        # that answers and accepts us: the flow's own calls go on
        if exc.code >= 500:
            raise PrefectUnavailable(
                f"Prefect server {redact(url)} (PREFECT_API_URL) answered HTTP {exc.code}"
            ) from None
    except OSError as exc:
        reason = getattr(exc, "reason", exc)
        raise PrefectUnavailable(f"Prefect server {redact(url)} (PREFECT_API_URL) is unreachable: {reason}") from None


def _plain(value: Any) -> str:
    """A setting's value, whether Prefect hands it over plain or as a pydantic SecretStr."""
    return str(value.get_secret_value() if hasattr(value, "get_secret_value") else value or "")


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
            preexec_fn=_die_with_parent if die_with_parent else None,
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


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the process that started it dies, even by SIGKILL
    (Linux; `prefect server start` with one worker is a single process, so this reaches uvicorn)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


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
