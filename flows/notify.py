"""Telling the people who run the service: a failed, crashed or refused run, and each promotion decision.

Configured in params.yaml `orchestration.notify` (tasks/core/config/ `NotifyConfig`); the webhook URL,
which carries a token, is never a param: it comes from a Prefect notification block named in
`notify.block` (`slack-webhook/oncall`, `custom-webhook/oncall`..., made with the UI or
`Block.save`), else from the environment variable `notify.url_env` (LOCKSTEP_NOTIFY_URL). With
neither, each run says once, when it starts, that nobody is told. The settings are those of the params
the run checked (flows/run_params.py), else the deployment's own params.yaml: never those of a
`params_file` the run refused or that changed after its check (`notify_config`).

The mechanisms, all Prefect's own flow state hooks (the pipeline flow's `on_running`, `on_failure`,
`on_completion`, `on_crashed`):

- failed / refused: `on_failure`, in the flow run's process, once the run is Failed. Only there are
  the exception (a `DataRefused` from the download stage makes the event `refused`) and the stage it
  came from (`stage()`, around each stage task) known.
- promotion: `on_completion`: the flow's result (`results["export"]["promotion"]`) is in memory.
- crashed: `on_crashed`. A process killed with SIGKILL, or by the OOM killer, runs nothing; but the
  process that started it does: Prefect's Runner (`flow.serve`, `make schedule`) and its process
  worker see the non-zero exit, propose Crashed, and, if the server accepts it, run the flow's
  `on_crashed` hooks in their own process (prefect/runner/runner.py `_run_on_crashed_hooks`,
  prefect/runner/_flow_run_executor.py). The stage is then the task run the API still shows
  running. A crash the engine itself catches (SIGTERM, Ctrl-C) runs the same hook in the flow's
  process; the runner then finds the outcome handled (and a Crashed proposal on a run already
  terminal is refused by the server: "already in terminal state"), so its hooks do not run again:
  one message either way (tests/flows/test_notify.py kills a served run both ways).

Why hooks rather than an automation (`prefect.flow-run.Crashed` -> send-notification): an
automation's message is rendered on the server from the flow run's event, which does not know
the stage or the error's type (refused vs failed) or the promotion line; it needs the URL stored on
the server as a block even when it comes from the environment; and an automation beside these
hooks would send a second message per event. Not covered: a `make run` process (no runner behind
it) killed with SIGKILL takes its own Prefect server with it, and a served run whose serve process
dies too stays Running: nobody is left to notice.

Sending never fails or stalls a run: each message goes out from a daemon thread that the hook
waits for at most `timeout_s`; a slow, dead or failing receiver, or a missing block, is a warning
in the run's log, naming the block or the variable, never the URL (scrubbed from every error). An
environment URL is posted with the standard library rather than wrapped in Prefect's
CustomWebhookNotificationBlock: that block renders `{{...}}` templates inside the payload (an
error line can hold braces) and its HTTP errors quote the URL; urllib logs nothing. A block's own
`notify` formats its payload (Slack blocks: Slack; a Custom Webhook: its `{{subject}}`/`{{body}}`
template); `format` shapes the environment webhook's JSON: `slack` `{"text": ...}`, `generic` every
field of `Event` plus `text`. The formats are the registry tasks/core/config/service.py `NOTIFY_FORMATS`;
each registers here how an `Event` becomes its JSON, `@PAYLOADS.register(name)`. One message per run
and event: a second attempt in the same process is dropped.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from tasks.core.cli import one_line
from tasks.core.config.base import ConfigError
from tasks.core.config.service import NOTIFY_FORMATS, NotifyConfig
from tasks.core.config.yaml_io import PARAMS_FILE, load_params
from tasks.core.errors import DataRefused, ExpectedFailure
from tasks.core.layout import ROOT
from tasks.core.redact import MASK
from tasks.core.registry import Implementations

MAX_ERROR_CHARS = 1000  # an error line longer than this is cut (a message, not a log)
MAX_NAME_CHARS = 200  # a flow run's or deployment's name, which whoever starts a run through the API chooses

_running: dict[str, str] = {}  # flow run id -> the stage it is in (this process's runs)
_sent: set[tuple[str, str]] = set()  # (flow run id, event) already sent from this process
_checked: dict[str, NotifyConfig] = {}  # flow run id -> orchestration.notify of the params it checked
_sent_lock = threading.Lock()


@dataclass(frozen=True)
class Event:
    """One message's fields (the generic format's JSON, with `text`)."""

    event: str  # failed | crashed | refused | promotion
    flow: str
    flow_run: str  # the run's name
    flow_run_id: str
    deployment: str | None  # <flow>/<deployment>; None for `make run`
    state: str  # Failed | Crashed | Completed
    stage: str | None = None  # the stage that failed or was running; None: none (or not known)
    error: str | None = None  # one line, redacted
    promotion: str | None = None

    def text(self) -> str:
        lines = [f"{self.flow}: flow run '{self.flow_run}' {self.state} ({self.event})"]
        lines.append(f"deployment: {self.deployment or 'none (run from the command line)'}")
        if self.event != "promotion":
            lines.append(f"stage: {self.stage or 'none (before or after the stages)'}")
        if self.error:
            lines.append(f"error: {self.error}")
        if self.promotion:
            lines.append(f"promotion: {self.promotion}")
        lines.append(f"flow run id: {self.flow_run_id}")
        return "\n".join(lines)

    def payload(self, fmt: str) -> dict[str, Any]:
        return PAYLOADS[fmt](self)


# The JSON each format of NOTIFY_FORMATS posts to the environment's webhook, from the event.
PAYLOADS: Implementations[Callable[[Event], dict[str, Any]]] = Implementations(NOTIFY_FORMATS)


@PAYLOADS.register("slack")
def _slack(event: Event) -> dict[str, Any]:
    # Slack reads `<!channel>`, `<url|label>` and `&...;` in a message as mentions, links and entities; a
    # run's name or an error line holding them must show as text (Slack's escaping: &amp; &lt; &gt;)
    text = event.text().replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return {"text": text}


@PAYLOADS.register("generic")
def _generic(event: Event) -> dict[str, Any]:
    return {**asdict(event), "text": event.text()}


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Around a stage's task in the flow: a failure or crash inside names `name`."""
    # heavy: prefect (~2-4 s), only inside a flow run; this module loads without it
    from prefect.runtime import flow_run

    run_id = str(flow_run.id or "")
    _running[run_id] = name
    yield  # not in a `finally`: a stage that raised stays named for the hooks
    _running.pop(run_id, None)


# --------------------------------------------------------------------------- the flow's state hooks


def announce(flow: Any, flow_run: Any, state: Any) -> None:
    """on_running: say once per run who will be told (or that nobody will)."""
    cfg = notify_config(flow_run)
    _logger(flow, flow_run).info("notifications: %s", describe(cfg, os.environ))


def on_failure(flow: Any, flow_run: Any, state: Any) -> None:
    exc = _exception(state)
    error = error_line(exc) if exc is not None else _scrubbed(state.message or "")
    notify(flow, flow_run, state, failure_event(exc), stage=_running.get(str(flow_run.id)), error=error)


def on_crashed(flow: Any, flow_run: Any, state: Any) -> None:
    """In the flow's process (a crash the engine caught) or in the runner's (the process died)."""
    stage_name = _running.get(str(flow_run.id)) or _running_stage_from_api(flow_run)
    notify(flow, flow_run, state, "crashed", stage=stage_name, error=_scrubbed(state.message or "crashed"))


def on_completion(flow: Any, flow_run: Any, state: Any) -> None:
    line = promotion_line(_result(state))
    if line:
        notify(flow, flow_run, state, "promotion", promotion=line)


# --------------------------------------------------------------------------- what a message says


def failure_event(exc: BaseException | None) -> str:
    return "refused" if isinstance(exc, DataRefused) else "failed"


def error_line(exc: BaseException) -> str:
    """The exception as one redacted line: an expected failure's own message, else `Type: message`."""
    text = str(exc) if isinstance(exc, ExpectedFailure | ConfigError) else f"{type(exc).__name__}: {exc}"
    return _scrubbed(text)


def promotion_line(results: Any) -> str | None:
    """The export stage's promotion decision, if this run's export registered a model."""
    export = results.get("export") if isinstance(results, Mapping) else None
    line = export.get("promotion") if isinstance(export, Mapping) else None
    return _scrubbed(str(line)) if line else None


def _name(text: Any) -> str:
    return _scrubbed(str(text))[:MAX_NAME_CHARS]


def _scrubbed(text: str, secrets: tuple[str, ...] = ()) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return one_line(text)[:MAX_ERROR_CHARS]


# --------------------------------------------------------------------------- sending


def notify(flow: Any, flow_run: Any, state: Any, event: str, **fields: str | None) -> bool:
    """Send `event` for this flow run, once, if params ask for it; True if the receiver took it."""
    cfg = notify_config(flow_run)
    if event not in cfg.events:
        return False
    with _sent_lock:
        if (str(flow_run.id), event) in _sent:
            return False
        _sent.add((str(flow_run.id), event))
    # Names come from whoever started the run or its tasks (the API accepts any string): one line each,
    # cut short, so that none forges a line of the message (the error and promotion lines are scrubbed)
    deployment, stage_name = _deployment_name(flow, flow_run), fields.pop("stage", None)
    message = Event(
        event=event,
        flow=_name(flow.name),
        flow_run=_name(flow_run.name),
        flow_run_id=str(flow_run.id),
        deployment=_name(deployment) if deployment else None,
        state=_name(state.name),
        stage=_name(stage_name) if stage_name else None,
        **fields,
    )
    return send(message, cfg, _logger(flow, flow_run))


def send(message: Event, cfg: NotifyConfig, logger: Any, env: Mapping[str, str] = os.environ) -> bool:
    """Deliver `message` to the configured block or webhook within `cfg.timeout_s`; a failure is a
    warning (without the URL), never an exception. True if the receiver took it."""
    deliver = _deliverer(message, cfg, env)
    target = describe(cfg, env)
    if deliver is None:
        logger.debug("notifications: %s; the %s event reaches nobody", target, message.event)  # said at start
        return False
    outcome: list[BaseException | None] = []

    def attempt() -> None:
        try:
            deliver()
            outcome.append(None)
        except BaseException as exc:  # reported below, never raised into the run
            outcome.append(exc)

    thread = threading.Thread(target=attempt, name=f"lockstep-notify-{message.event}", daemon=True)
    thread.start()
    thread.join(cfg.timeout_s)
    # The socket's own timeout equals the join's, so on a busy machine the thread may report its
    # timeout a moment before the join returns: that is still "no answer", not a failure.
    if not outcome or _timed_out(outcome[0]):
        logger.warning(
            "notification (%s) to %s: no answer within %g s (orchestration.notify.timeout_s); the run goes on",
            message.event,
            target,
            cfg.timeout_s,
        )
        return False
    if outcome[0] is not None:
        exc = outcome[0]
        reason = _scrubbed(f"{type(exc).__name__}: {exc}", _secrets(cfg, env))
        logger.warning("notification (%s) to %s failed: %s; the run goes on", message.event, target, reason)
        return False
    logger.info("notification (%s) sent to %s", message.event, target)
    return True


def _timed_out(exc: BaseException | None) -> bool:
    reason = getattr(exc, "reason", None)  # urllib wraps a connect timeout in a URLError
    return isinstance(exc, TimeoutError) or isinstance(reason, TimeoutError)


def describe(cfg: NotifyConfig, env: Mapping[str, str]) -> str:
    """Where messages go, without the URL."""
    if cfg.block:
        return f"Prefect block {cfg.block} ({', '.join(cfg.events)})"
    if env.get(cfg.url_env):
        return f"the webhook in ${cfg.url_env} ({cfg.format} format; {', '.join(cfg.events)})"
    return f"nobody is notified (no orchestration.notify.block, ${cfg.url_env} unset)"


def _deliverer(message: Event, cfg: NotifyConfig, env: Mapping[str, str]) -> Callable[[], None] | None:
    if cfg.block:
        block_name = cfg.block
        return lambda: _notify_block(block_name, message)
    url = env.get(cfg.url_env)
    if not url:
        return None
    return lambda: post_json(url, message.payload(cfg.format), cfg.timeout_s)


def _secrets(cfg: NotifyConfig, env: Mapping[str, str]) -> tuple[str, ...]:
    return (env.get(cfg.url_env, ""),)


def _notify_block(name: str, message: Event) -> None:
    # heavy: prefect (~2-4 s), only when a notification block is used; this module loads without it
    from prefect.blocks.abstract import NotificationBlock
    from prefect.blocks.core import Block

    block = Block.load(name)
    if not isinstance(block, NotificationBlock):
        raise ConfigError(f"orchestration.notify.block: {name} is a {type(block).__name__}, not a notification block")
    subject = f"{message.flow}: flow run '{message.flow_run}' {message.state} ({message.event})"
    try:
        with block.raise_on_failure():
            block.notify(body=message.text(), subject=subject)
    except Exception as exc:  # the block's own errors may quote its URL
        url = getattr(block, "url", "")
        url = url.get_secret_value() if hasattr(url, "get_secret_value") else str(url)
        raise RuntimeError(_scrubbed(f"{type(exc).__name__}: {exc}", (url,))) from None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a webhook answers; it does not send the message elsewhere


def post_json(url: str, payload: dict[str, Any], timeout_s: float) -> None:
    """POST `payload` as JSON; raises on a connection error, a timeout or a non-2xx answer."""
    if not url.startswith(("http://", "https://")):
        raise ConfigError("the notification URL is not an http(s) URL")
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", "User-Agent": "lockstep-notify"},
        method="POST",
    )
    with urllib.request.build_opener(_NoRedirect).open(request, timeout=timeout_s) as response:
        if not 200 <= response.status < 300:
            raise RuntimeError(f"the receiver answered HTTP {response.status}")


# --------------------------------------------------------------------------- the run's context


def checked(cfg: NotifyConfig) -> None:
    """Called by the flow once this run's params passed their check: its hooks use `cfg` from then on."""
    # heavy: prefect (~2-4 s), only inside a flow run; this module loads without it
    from prefect.runtime import flow_run

    _checked[str(flow_run.id or "")] = cfg


def notify_config(flow_run: Any) -> NotifyConfig:
    """`orchestration.notify` of the params this run checked (`checked`); before that, or if they were
    refused, or in another process (a runner reporting a crash), the deployment's own params.yaml's;
    the defaults if that cannot be read (a run that failed on an invalid params.yaml is still reported).

    Never the run's `params_file` as it is now: the run may have refused it, or it may have been
    swapped since it was checked, and either would let whoever wrote it redirect or silence the notice."""
    cfg = _checked.get(str(flow_run.id))
    if cfg is not None:
        return cfg
    try:
        return load_params(ROOT / PARAMS_FILE).orchestration.notify
    except Exception:
        return NotifyConfig()


def _logger(flow: Any, flow_run: Any) -> Any:
    # heavy: prefect (~2-4 s), only inside a flow run; this module loads without it
    from prefect.logging.loggers import flow_run_logger

    return flow_run_logger(flow_run, flow)


def _exception(state: Any) -> BaseException | None:
    try:
        result = state.result(raise_on_failure=False)
    except Exception:  # the result is not in this process
        return None
    return result if isinstance(result, BaseException) else None


def _result(state: Any) -> Any:
    try:
        return state.result(raise_on_failure=False)
    except Exception:
        return None


def _deployment_name(flow: Any, flow_run: Any) -> str | None:
    if not getattr(flow_run, "deployment_id", None):
        return None
    try:
        # heavy: prefect (~2-4 s), only when the server is asked; this module loads without it
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return f"{flow.name}/{client.read_deployment(flow_run.deployment_id).name}"
    except Exception:
        return str(flow_run.deployment_id)


def _running_stage_from_api(flow_run: Any) -> str | None:
    """The stage task the API still shows running: the one a killed process was in."""
    try:
        # heavy: prefect (~2-4 s), only when the server is asked; this module loads without it
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        with get_client(sync_client=True) as client:
            task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    except Exception:
        return None
    running = [t for t in task_runs if t.state is not None and t.state.is_running()]
    return max(running, key=lambda t: t.start_time or t.created).name if running else None
