"""The Prefect server the project's commands talk to (`local_api`: PREFECT_API_URL's, checked; the project's
running one; or one started for them, flows/local_server.py), what a flow run may override, and the
zombie-run automation. Prefect's own settings are flows/prefect_settings.py's.
"""

from __future__ import annotations

import atexit
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

from flows import kept_server, project_server
from flows.local_server import LocalServer, prefect_home
from tasks.core.config.base import OverrideRefused
from tasks.core.errors import ExpectedFailure
from tasks.core.redact import redact

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
    server, running, kept = None, None, None
    if os.environ.get("PREFECT_API_URL"):
        check_api()
    elif find_project_server and kept_server.idle_s() > 0 and not project_server.proxies_set():
        kept = kept_server.KeptServer(prefect_home())  # the project's server, started and kept if none runs
    elif not find_project_server or (running := project_server.find(prefect_home())) is None:
        server = LocalServer(ephemeral=True, quiet=True, die_with_parent=True)
        # Stopped at exit, as Prefect stops its ephemeral server: exit handlers run last-in first-out,
        # so Prefect's log and event workers (registered later) have sent what they hold by then.
        atexit.register(server.stop)
    if (server is not None or (kept is not None and kept.starting)) and while_starting is not None:
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
    elif kept is not None:
        running = kept.wait()
    if running is not None:  # the project's server (`make schedule`), found running (project_server.py)
        settings = {PREFECT_API_URL: running[0], PREFECT_API_AUTH_STRING: running[1]}
    if settings and HEARTBEAT_ENV not in os.environ:
        # Heartbeats feed a zombie automation on a server (the stack's: ZOMBIE_AUTOMATION); neither this
        # process's own server nor the project's has one, so none watches them. Prefect's heartbeat thread
        # sleeps in whole seconds and each flow run waits for it to wake at its end
        # (flow_engine._send_heartbeats, 3.8.8): up to a second a run (0.99 s in a profiled no-op
        # --reingest run, 2026-12-05).
        settings[PREFECT_FLOWS_HEARTBEAT_FREQUENCY] = None
    try:
        with temporary_settings(settings) if settings else nullcontext():
            yield server is not None
    finally:
        if kept is not None:
            kept.release()


class PrefectUnavailable(ExpectedFailure):
    """The Prefect server in PREFECT_API_URL does not answer, or refuses our credentials."""


def check_api(timeout_s: float = 10) -> None:
    """Fail in seconds, in one line, when the server in PREFECT_API_URL is unreachable or refuses the
    auth string: Prefect's client would raise a traceback from deep inside the flow's start."""
    # Prefect loads where a server is talked to: stack/ and the tests import this module without it (~2 s)
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, PREFECT_API_URL

    url, auth, key = (_plain(s.value()) for s in (PREFECT_API_URL, PREFECT_API_AUTH_STRING, PREFECT_API_KEY))
    request = urllib.request.Request(f"{url.rstrip('/')}/admin/version")
    if key or auth:  # Prefect Cloud's API key, else a server's auth string
        # unredirected: urllib copies ordinary headers to wherever a redirect points, another host too
        request.add_unredirected_header("Authorization", f"Bearer {key}" if key else project_server.basic_auth(auth))
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
