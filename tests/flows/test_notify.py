"""Notifications (flows/notify.py): failed, refused and crashed runs and promotion decisions reach a
webhook, once per event; a slow or dead receiver never fails or stalls a run; the URL, which holds a
token, is never written anywhere.

Unit tests call the hooks and the sender directly against a receiver on 127.0.0.1 (tests/support/webhook.py).
End-to-end tests run the real flow (`python -m flows.pipeline`) in clones of the session's trained
project, and the served deployment (`python -m flows.deployments serve`) for crashes: its flow-run
process is killed with SIGKILL (the Runner reports the crash) or SIGTERM (the engine does) while its
download stage waits on the data source, a loopback HTTP server that holds the request until then.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from benchmarks.fakedata.archives import pack
from benchmarks.httpserver import FileServer
from flows import notify
from tasks.core.errors import DataRefused, ExpectedFailure
from tasks.core.lock import pipeline_lock
from tasks.core.redact import redact
from tests.conftest import (
    PrefectServer,
    client_for,
    clone_project,
    free_port,
    run,
    service,
    subprocess_env,
    write_params,
)
from tests.support.digits import write_digits
from tests.support.prefect_client import (
    PrefectAPI,
    flow_run_states,
    start_flow_runs,
    wait_for_deployment,
    wait_for_line,
)
from tests.support.webhook import WebhookReceiver

# A token that tasks/core/redact.py would NOT mask (one case, no secret-like name): finding it nowhere
# shows that nothing wrote the URL, not that a log filter hid it. Made here, so that this file's own
# copy in a test project does not hold it.
TOKEN, QUERY_SECRET = f"ls0notify0{secrets.token_hex(8)}", f"zz0{secrets.token_hex(4)}"
HOOK_PATH = f"/hooks/{TOKEN}/b1?code={QUERY_SECRET}"
FLOW_RUN_ID = "0b5e3c4e-1111-4222-8333-444455556666"


def test_the_test_token_is_not_one_redaction_would_hide() -> None:
    url = f"http://127.0.0.1:1{HOOK_PATH}"
    assert TOKEN in redact(url) and QUERY_SECRET in redact(url)


# --------------------------------------------------------------------------- unit: hooks and sender


@pytest.fixture
def quiet_logger(monkeypatch: pytest.MonkeyPatch) -> logging.Logger:
    """The hooks' run logger as a plain logger (no Prefect API to send records to in unit tests)."""
    logger = logging.getLogger("tests.notify")
    monkeypatch.setattr(notify, "_logger", lambda flow, flow_run: logger)
    monkeypatch.setattr(notify, "_sent", set())
    monkeypatch.setattr(notify, "_running", {})
    return logger


def _run_objects(state_name: str, result: Any = None, message: str = "") -> tuple[Any, Any, Any]:
    flow = SimpleNamespace(name="lockstep-pipeline")
    flow_run = SimpleNamespace(id=FLOW_RUN_ID, name="brave-otter", parameters={}, deployment_id=None)

    def state_result(raise_on_failure: bool = True) -> Any:
        return result

    return flow, flow_run, SimpleNamespace(name=state_name, message=message, result=state_result)


def test_a_refused_snapshot_is_its_own_event_naming_the_stage_and_the_check(
    monkeypatch: pytest.MonkeyPatch, quiet_logger: logging.Logger
) -> None:
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", FLOW_RUN_ID)  # what prefect.runtime reads outside a run
    refused = DataRefused("data check(s) refused the new snapshot: class_imbalance 1.05 > 1")
    with WebhookReceiver() as hook:
        monkeypatch.setenv("LOCKSTEP_NOTIFY_URL", hook.url(HOOK_PATH))
        with pytest.raises(DataRefused), notify.stage("download"):
            raise refused
        notify.on_failure(*_run_objects("Failed", refused))
        notify.on_failure(*_run_objects("Failed", refused))  # a hook run twice still sends once
        (message,) = hook.wait_for(2, timeout_s=1)
    assert message["text"].startswith("lockstep-pipeline: flow run 'brave-otter' Failed (refused)")
    assert "stage: download" in message["text"] and "class_imbalance 1.05 > 1" in message["text"]
    assert f"flow run id: {FLOW_RUN_ID}" in message["text"]
    assert notify.failure_event(ExpectedFailure("gate")) == notify.failure_event(ValueError()) == "failed"


def test_the_generic_format_carries_each_field_and_the_error_is_one_redacted_line(
    monkeypatch: pytest.MonkeyPatch, quiet_logger: logging.Logger
) -> None:
    monkeypatch.setenv("MY_API_TOKEN", "s3cr3t-value-123")
    error = ValueError("fetching https://user:pw@example.com/x failed\nwith s3cr3t-value-123")
    with WebhookReceiver() as hook:
        monkeypatch.setenv("LOCKSTEP_NOTIFY_URL", hook.url(HOOK_PATH))
        monkeypatch.setattr(notify, "notify_config", lambda flow_run: notify.NotifyConfig(format="generic"))
        notify.on_failure(*_run_objects("Failed", error))
        (message,) = hook.wait_for(1)
    assert hook.paths == [HOOK_PATH]
    assert {k: message[k] for k in ("event", "flow", "flow_run", "flow_run_id", "deployment", "state", "stage")} == {
        "event": "failed",
        "flow": "lockstep-pipeline",
        "flow_run": "brave-otter",
        "flow_run_id": FLOW_RUN_ID,
        "deployment": None,
        "state": "Failed",
        "stage": None,
    }
    assert message["error"] == "ValueError: fetching https://***@example.com/x failed\\nwith ***"
    assert message["promotion"] is None and "stage: none" in message["text"]


def test_a_promotion_is_sent_once_and_only_when_export_registered_a_model(
    monkeypatch: pytest.MonkeyPatch, quiet_logger: logging.Logger
) -> None:
    line = "lockstep-classifier v3 promoted to champion: 0.9712 vs champion v2 0.9650 on the same 270 test images"
    with WebhookReceiver() as hook:
        monkeypatch.setenv("LOCKSTEP_NOTIFY_URL", hook.url(HOOK_PATH))
        notify.on_completion(*_run_objects("Completed", {"export": {"ran": False}}))  # export up to date
        notify.on_completion(*_run_objects("Completed", {"export": {"ran": True, "promotion": line}}))
        notify.on_completion(*_run_objects("Completed", {"export": {"ran": True, "promotion": line}}))
        messages = hook.wait_for(2, timeout_s=1)
    assert len(messages) == 1, messages
    assert "Completed (promotion)" in messages[0]["text"] and f"promotion: {line}" in messages[0]["text"]


def test_events_left_out_of_params_are_not_sent(monkeypatch: pytest.MonkeyPatch, quiet_logger: logging.Logger) -> None:
    with WebhookReceiver() as hook:
        monkeypatch.setenv("LOCKSTEP_NOTIFY_URL", hook.url(HOOK_PATH))
        monkeypatch.setattr(notify, "notify_config", lambda flow_run: notify.NotifyConfig(events=("crashed",)))
        notify.on_failure(*_run_objects("Failed", ValueError("x")))
        assert hook.wait_for(1, timeout_s=0.5) == []


def test_without_a_block_or_url_the_run_says_once_that_nobody_is_notified(
    monkeypatch: pytest.MonkeyPatch, quiet_logger: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("LOCKSTEP_NOTIFY_URL", raising=False)
    with caplog.at_level(logging.DEBUG, logger="tests.notify"):
        notify.announce(*_run_objects("Running"))
        notify.on_failure(*_run_objects("Failed", ValueError("x")))  # no error
    said = [r for r in caplog.records if "nobody is notified" in r.getMessage() and r.levelno >= logging.INFO]
    assert len(said) == 1, caplog.text


def _message(event: str = "failed") -> notify.Event:
    return notify.Event(event, "lockstep-pipeline", "brave-otter", FLOW_RUN_ID, None, "Failed", "export", "gate")


@pytest.mark.parametrize("mode", ["slow", "dead", "error"])
def test_a_slow_dead_or_failing_receiver_is_a_warning_within_timeout(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    logger = logging.getLogger("tests.notify")
    with WebhookReceiver(mode, slow_s=30) as hook:
        url = hook.url(HOOK_PATH)
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="tests.notify"):
            sent = notify.send(_message(), notify.NotifyConfig(timeout_s=0.5), logger, {"LOCKSTEP_NOTIFY_URL": url})
        took = time.monotonic() - started
    assert not sent and took < 1.5, took
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    expected = {"slow": "no answer within 0.5 s", "dead": "Connection refused", "error": "HTTP Error 500"}[mode]
    assert expected in warning and "$LOCKSTEP_NOTIFY_URL" in warning, warning
    assert TOKEN not in caplog.text and QUERY_SECRET not in caplog.text and "127.0.0.1" not in caplog.text


@pytest.mark.parametrize("timeout", [TimeoutError("timed out"), urllib.error.URLError(TimeoutError("timed out"))])
def test_a_socket_timeout_reported_before_the_deadline_is_still_no_answer(
    timeout: Exception, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a busy machine the socket's timeout (equal to timeout_s) can fire a moment before the
    join's deadline: the warning is the same "no answer", not a failure with a socket error."""

    def times_out(*_: Any) -> None:
        raise timeout

    monkeypatch.setattr(notify, "post_json", times_out)
    logger = logging.getLogger("tests.notify")
    with caplog.at_level(logging.INFO, logger="tests.notify"):
        assert not notify.send(
            _message(), notify.NotifyConfig(timeout_s=2), logger, {"LOCKSTEP_NOTIFY_URL": "http://x/"}
        )
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "no answer within 2 s" in warning and "$LOCKSTEP_NOTIFY_URL" in warning, warning


def test_a_healthy_receiver_gets_slack_json(caplog: pytest.LogCaptureFixture) -> None:
    with WebhookReceiver() as hook, caplog.at_level(logging.INFO, logger="tests.notify"):
        env = {"LOCKSTEP_NOTIFY_URL": hook.url(HOOK_PATH)}
        assert notify.send(_message(), notify.NotifyConfig(), logging.getLogger("tests.notify"), env)
        assert hook.messages == [{"text": _message().text()}]
    assert "notification (failed) sent to the webhook in $LOCKSTEP_NOTIFY_URL" in caplog.text
    assert TOKEN not in caplog.text


# --------------------------------------------------------------------------- end to end: the flow


def _clone(dvc_repo: dict[str, Any], tmp_path: Path, notify_params: dict[str, Any] | None = None, **orch: Any) -> Path:
    repo = clone_project(dvc_repo["repo"], tmp_path / "repo")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["orchestration"].update(orch)
    params["orchestration"]["notify"].update(notify_params or {})
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return repo


def _flow(repo: Path, api: PrefectServer, url: str, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    command = [sys.executable, "-m", "flows.pipeline", *args]
    done = run(command, repo, check=False, LOCKSTEP_NOTIFY_URL=url, **api.env)
    return done, time.monotonic() - started


def _assert_url_written_nowhere(repo: Path, api: PrefectServer, *outputs: str) -> None:
    """Not in the console, nor in any file of the project (MLflow's store and artifacts, params.yaml,
    dvc.lock) or of the Prefect server the run reported to (its database: run logs, flow-run parameters)."""
    for text in outputs:
        assert TOKEN not in text and QUERY_SECRET not in text
    files = [path for folder in (repo, api.home) for path in folder.rglob("*")]
    leaked = [str(path) for path in files if path.is_file() and not path.is_symlink() and _holds_token(path)]
    assert not leaked, leaked


def _holds_token(path: Path) -> bool:
    data = path.read_bytes()
    return TOKEN.encode() in data or QUERY_SECRET.encode() in data


def _hook_seconds(output: str, hook: str) -> float:
    """From the run's console log: how long Prefect spent in `hook`."""
    stamps = [
        datetime.strptime(found.group(1), "%H:%M:%S.%f")
        for line in output.splitlines()
        if (found := re.match(rf"(\d\d:\d\d:\d\d\.\d+) .*(?:Running hook|Hook) '{hook}'", line))
    ]
    assert len(stamps) == 2, output[-3000:]
    return (stamps[1] - stamps[0]).total_seconds()


@pytest.mark.slow
def test_a_failed_stage_sends_one_message_even_to_a_slow_receiver(
    dvc_repo: dict[str, Any], prefect_server: PrefectServer, tmp_path: Path
) -> None:
    """An impossible export gate fails the export stage: one `failed` message naming it and the
    gate's line, while the receiver takes the message and never answers: the hook gives up after
    timeout_s, the run is Failed exactly as without notifications. The URL is written nowhere."""
    repo = _clone(dvc_repo, tmp_path, {"timeout_s": 2})
    with WebhookReceiver("slow", slow_s=120) as hook:
        done, took = _flow(repo, prefect_server, hook.url(HOOK_PATH), "--set", "export.max_abs_diff=1e-12")
        messages = hook.wait_for(2, timeout_s=1)
    output = done.stdout + done.stderr
    assert done.returncode == 3 and "Finished in state Failed(" in output, output[-3000:]
    assert len(messages) == 1, messages
    text = messages[0]["text"]
    assert re.match(r"lockstep-pipeline: flow run '[\w-]+' Failed \(failed\)\n", text), text
    assert "stage: export" in text and "export parity gate(s) failed" in text and "allowed 1e-12" in text
    run_name = re.match(r"lockstep-pipeline: flow run '([\w-]+)'", text).group(1)
    assert f"Flow run '{run_name}'" in output
    assert _hook_seconds(output, "on_failure") < 2 + 1.5
    assert "notification (failed) to the webhook in $LOCKSTEP_NOTIFY_URL" in output and "no answer within 2 s" in output
    _assert_url_written_nowhere(repo, prefect_server, done.stdout, done.stderr)
    print(f"failed export stage, slow receiver: run {took:.1f} s, hook {_hook_seconds(output, 'on_failure'):.1f} s")


@pytest.mark.slow
def test_a_refused_snapshot_sends_one_refused_message(
    dvc_repo: dict[str, Any], prefect_server: PrefectServer, tmp_path: Path
) -> None:
    """A new snapshot the data checks refuse (any class imbalance is too much): the download stage
    raises DataRefused; one `refused` message, generic JSON, naming the check and its numbers."""
    repo = _clone(dvc_repo, tmp_path, {"format": "generic"})
    with WebhookReceiver() as hook:
        done, took = _flow(
            repo, prefect_server, hook.url(HOOK_PATH), "--reingest", "--set", "checks.max_class_imbalance=1"
        )
        messages = hook.wait_for(2, timeout_s=1)
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(messages) == 1, messages
    message = messages[0]
    assert (message["event"], message["state"], message["stage"]) == ("refused", "Failed", "download")
    assert "refused the new snapshot" in message["error"] and "class_imbalance" in message["error"], message
    assert message["error"] in done.stderr  # the same line the command printed
    assert message["flow_run"] in done.stdout + done.stderr and len(message["flow_run_id"]) == 36
    _assert_url_written_nowhere(repo, prefect_server, done.stdout, done.stderr)
    print(f"refused snapshot: run {took:.1f} s")


@pytest.mark.slow
def test_a_dead_receiver_never_fails_or_stalls_the_run(
    dvc_repo: dict[str, Any], prefect_server: PrefectServer, tmp_path: Path
) -> None:
    """A run refused because another holds the pipeline lock fails as it always does (exit 3,
    Failed) when nothing listens at the webhook: one warning, without the URL, and no delay."""
    repo = _clone(dvc_repo, tmp_path, {"timeout_s": 5}, lock_wait_s=0)
    with WebhookReceiver("dead") as hook, pipeline_lock("the test", wait_s=0, root=repo):
        done, took = _flow(repo, prefect_server, hook.url(HOOK_PATH))
    output = done.stdout + done.stderr
    assert done.returncode == 3 and "another pipeline run is in progress" in done.stderr, output[-3000:]
    assert "Finished in state Failed(" in output
    warnings = [line for line in output.splitlines() if "notification (failed)" in line]
    assert len(warnings) == 1 and "Connection refused" in warnings[0], warnings
    assert _hook_seconds(output, "on_failure") < 2
    _assert_url_written_nowhere(repo, prefect_server, done.stdout, done.stderr)
    print(f"dead receiver: run {took:.1f} s, hook {_hook_seconds(output, 'on_failure'):.2f} s")


@pytest.mark.slow
def test_a_completed_run_that_registered_a_model_sends_its_promotion(
    dvc_repo: dict[str, Any], prefect_server: PrefectServer, tmp_path: Path
) -> None:
    """A changed export gate re-runs export alone, which registers version 2 and decides on the
    champion: a Completed run, and one message with the export stage's verdict line."""
    repo = _clone(dvc_repo, tmp_path)
    with WebhookReceiver() as hook:
        done, took = _flow(repo, prefect_server, hook.url(HOOK_PATH), "--set", "export.min_top1_agreement=0.94")
        messages = hook.wait_for(1, timeout_s=2)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "Finished in state Completed(" in output, output[-3000:]
    assert len(messages) == 1, messages
    text = messages[0]["text"]
    assert re.match(r"lockstep-pipeline: flow run '[\w-]+' Completed \(promotion\)\n", text), text
    assert re.search(r"^promotion: lockstep-classifier v2 .*champion v1 ", text, re.MULTILINE), text
    _assert_url_written_nowhere(repo, prefect_server, done.stdout, done.stderr)
    print(f"promotion: run {took:.1f} s, {len(messages)} message(s)")


# --------------------------------------------------------------------------- end to end: whose params route the notice


def _planted(repo: Path, name: str, notify_params: dict[str, Any]) -> str:
    """A copy of params.yaml with other `orchestration.notify`, in a folder others can write to
    (an upload, a data folder); its path relative to the project."""
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["orchestration"]["notify"].update(notify_params)
    path = repo / "incoming" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return str(path.relative_to(repo))


@pytest.mark.slow
def test_a_refused_params_file_cannot_redirect_or_silence_the_failure_notice(
    dvc_repo: dict[str, Any], prefect_server: PrefectServer, tmp_path: Path
) -> None:
    """Issue 66, item 3. A run started through the API with a params file that redirects the notice
    (another `url_env`) or silences it (no `failed` event) is refused for it; the notice of that
    refusal still goes where the deployment's own params.yaml sends it, not where the refused file does."""
    repo = _clone(dvc_repo, tmp_path)
    redirect = _planted(repo, "redirect.yaml", {"url_env": "ATTACKER_URL"})
    silence = _planted(repo, "silence.yaml", {"events": ["promotion"]})
    log = tmp_path / "flow.log"
    with WebhookReceiver() as oncall, WebhookReceiver() as attacker:
        env = subprocess_env(
            LOCKSTEP_NOTIFY_URL=oncall.url(HOOK_PATH), ATTACKER_URL=attacker.url(), **prefect_server.env
        )
        proc = start_flow_runs(repo, [{"params_file": redirect}, {"params_file": silence}], log, env)
        states = flow_run_states(proc, log)
        told = oncall.wait_for(2, timeout_s=5)
    assert [s["type"] for s in states] == ["FAILED", "FAILED"], states
    assert "orchestration.notify.url_env is not among" in states[0]["message"], states
    assert "orchestration.notify.events is not among" in states[1]["message"], states
    assert attacker.messages == []
    assert len(told) == 2 and all("Failed (failed)" in m["text"] for m in told), told
    assert f"params_file {redirect}: orchestration.notify.url_env" in told[0]["text"], told[0]
    assert f"params_file {silence}: orchestration.notify.events" in told[1]["text"], told[1]


@pytest.mark.slow
def test_a_params_file_swapped_while_the_run_waits_cannot_redirect_its_failure_notice(
    dvc_repo: dict[str, Any], prefect_server: PrefectServer, tmp_path: Path
) -> None:
    """Issue 66, item 3. A params file that passes the check (params.yaml's copy) is swapped for one
    that redirects the notice while its run waits for the pipeline lock, held by a real holder until
    the run gives up: the notice of that failure goes where the checked params sent it."""
    repo = _clone(dvc_repo, tmp_path, lock_wait_s=20)
    incoming = _planted(repo, "params.yaml", {})
    log = tmp_path / "flow.log"
    with WebhookReceiver() as oncall, WebhookReceiver() as attacker:
        env = subprocess_env(
            LOCKSTEP_NOTIFY_URL=oncall.url(HOOK_PATH), ATTACKER_URL=attacker.url(), **prefect_server.env
        )
        with pipeline_lock("the test", wait_s=0, root=repo):
            proc = start_flow_runs(repo, [{"params_file": incoming}], log, env)
            wait_for_line(log, "waiting up to", proc)
            _planted(repo, "params.yaml", {"url_env": "ATTACKER_URL"})
            (state,) = flow_run_states(proc, log)
        told = oncall.wait_for(1, timeout_s=5)
    assert state["type"] == "FAILED" and "another pipeline run is in progress" in state["message"], state
    assert attacker.messages == []
    assert len(told) == 1 and "another pipeline run is in progress" in told[0]["text"], told


# --------------------------------------------------------------------------- end to end: crashes when served


DEPLOYMENT = "lockstep-pipeline/nightly"
BLOCK = "custom-webhook/oncall"
ARCHIVE = "/datasets/digits.tar.gz"
# How long the source holds a download a test kills: the kill comes within seconds; the hold ends
# sooner if the server stops.
HOLD_S = 600


@dataclass
class Served:
    repo: Path
    hook: WebhookReceiver
    serve: subprocess.Popen[bytes]
    prefect: PrefectAPI
    source: FileServer  # the data source (an image-folder archive): holds a download on request


@pytest.fixture(scope="module")
def served(dvc_repo: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`python -m flows.deployments serve` (its own Prefect server) in a trained clone, notifying
    through a Prefect Custom Webhook block saved on that server, as an operator would set it up. Its data
    is sklearn's digits as an image-folder archive on a loopback HTTP server, so that a test can hold
    the download stage for as long as it needs: killed "while download runs" is then not a race with a
    stage that takes a second."""
    base = tmp_path_factory.mktemp("notify-served")
    write_digits(base / "digits", range(1797))
    sha256 = pack(base / "digits", base / "digits.tar.gz", "tar.gz")
    with FileServer(hang_s=HOLD_S) as source, WebhookReceiver() as hook:
        source.add(ARCHIVE, (base / "digits.tar.gz").read_bytes())
        repo = _clone(dvc_repo, base, {"block": BLOCK}, cron=None)
        data = {"source": "imagefolder", "url": source.url_for(ARCHIVE), "sha256": sha256, "channels": 1}
        write_params(repo / "params.yaml", {"data": data}, base=repo / "params.yaml")
        port = free_port()
        api = f"http://127.0.0.1:{port}/api"
        serve_cmd = [sys.executable, "-m", "flows.deployments", "serve", "--port", str(port)]
        with service(serve_cmd, repo, f"{api}/health", base / "serve.log") as serve:
            prefect = PrefectAPI(api, wait_for_deployment(api, repo / ".prefect" / "api-auth", DEPLOYMENT, serve, 180))
            save_block = (
                "from prefect.blocks.notifications import CustomWebhookNotificationBlock as B; "
                f"B(name='oncall', url={hook.url(HOOK_PATH)!r}, "
                "json_data={'text': '{{body}}', 'subject': '{{subject}}'}).save('oncall')"
            )
            run([sys.executable, "-c", save_block], repo, **prefect.client_env)
            yield Served(repo, hook, serve, prefect, source)
    log = (base / "serve.log").read_text()
    assert TOKEN not in log and QUERY_SECRET not in log


def _flow_run_process(flow_run_id: str, parent: int) -> int:
    """The process serve started for the flow run (its child with PREFECT__FLOW_RUN_ID set)."""
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no process of serve (pid {parent}) runs flow run {flow_run_id}")


def _until(done: Callable[[], bool], what: str, deadline: float, seen: object = None) -> None:
    """Poll `done` until it holds; past `deadline` (time.monotonic()) fail with `what` and what was `seen`."""
    while not done():
        assert time.monotonic() < deadline, what if seen is None else f"{what}: {seen}"
        time.sleep(0.2)


def _kill_in_download(stack: Served, sig: signal.Signals) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """Start a deployment run, kill its process with `sig` while the download stage waits on the data
    source (which holds the request); the messages that arrive, and the flow run's final state."""
    before = len(stack.hook.messages)
    # the archive must be fetched again, not taken from the download cache a completed run left
    shutil.rmtree(stack.repo / ".cache" / "downloads", ignore_errors=True)
    requests = stack.source.count(ARCHIVE)
    stack.source.fail(ARCHIVE, "hang")
    started = run(["prefect", "deployment", "run", DEPLOYMENT], stack.repo, **stack.prefect.client_env).stdout
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", started).group(1)
    deadline = time.monotonic() + 300
    _until(
        lambda: stack.source.count(ARCHIVE) > requests,
        "the download stage never asked the source for the data",
        deadline,
    )
    os.kill(_flow_run_process(flow_run_id, stack.serve.pid), sig)
    state: dict[str, Any] = {}

    def crashed_and_told() -> bool:
        state.clear()
        state.update(stack.prefect(f"/flow_runs/{flow_run_id}")["state"])
        return state["type"] == "CRASHED" and len(stack.hook.messages) > before

    _until(crashed_and_told, "the killed run was not reported Crashed with a message", deadline, state)
    time.sleep(5)  # time for a second message, if anything sent one
    return flow_run_id, stack.hook.messages[before:], state


def _assert_one_crash_message(stack: Served, flow_run_id: str, messages: list[dict[str, Any]], state: dict) -> None:
    assert state["type"] == "CRASHED", state
    assert len(messages) == 1, messages
    flow_run = stack.prefect(f"/flow_runs/{flow_run_id}")
    text = messages[0]["text"]
    assert messages[0]["subject"] == f"lockstep-pipeline: flow run '{flow_run['name']}' Crashed (crashed)"
    assert f"deployment: {DEPLOYMENT}" in text and f"flow run id: {flow_run_id}" in text
    assert "stage: download" in text
    assert f"error: {state['message']}" in text, (text, state)


@pytest.mark.slow
def test_a_served_run_killed_with_sigkill_is_reported_crashed_once(served: Served) -> None:
    """Nothing runs in a SIGKILLed process: serve's Runner sees the exit, reports Crashed and runs
    the flow's on_crashed hook in its own process, which finds the stage in the API. The next run
    marks the MLflow runs the killed one left RUNNING as KILLED."""
    flow_run_id, messages, state = _kill_in_download(served, signal.SIGKILL)
    _assert_one_crash_message(served, flow_run_id, messages, state)
    assert "SIGKILL" in messages[0]["text"]
    # Its MLflow runs (the pipeline's parent, and the download stage's if it had opened one) died
    # RUNNING with it; the next deployment run marks them KILLED, saying why (tasks/tracking/orphans.py).
    client = client_for(served.repo)
    experiment = client.get_experiment_by_name("lockstep").experiment_id
    orphans = client.search_runs([experiment], "attributes.status = 'RUNNING'")
    assert "parent" in {r.data.tags.get("lockstep.stage", "parent") for r in orphans}, orphans
    # The sweep is the first thing a run does; this one's source then answers 404, so that it fails a
    # second later rather than training again. Its failure message is waited for here, not left to
    # arrive while another test counts its own.
    before = len(served.hook.messages)
    served.source.fail(ARCHIVE, "404")
    run(["prefect", "deployment", "run", DEPLOYMENT, "--watch"], served.repo, check=False, **served.prefect.client_env)
    _until(lambda: len(served.hook.messages) > before, "the failed run sent no message", time.monotonic() + 120)
    assert "Failed" in served.hook.messages[before]["subject"] and "404" in served.hook.messages[before]["text"]
    for orphan in orphans:
        after = client.get_run(orphan.info.run_id)
        assert after.info.status == "KILLED", after.info
        reason = after.data.tags["lockstep.killed_reason"]
        assert f"process {orphan.data.tags['lockstep.owner.pid']} on host" in reason and "is gone" in reason, reason


@pytest.mark.slow
def test_a_served_run_terminated_is_reported_crashed_once(served: Served) -> None:
    """SIGTERM: the engine reports the crash and runs on_crashed in the flow's process; the Runner
    must not report it a second time."""
    flow_run_id, messages, state = _kill_in_download(served, signal.SIGTERM)
    _assert_one_crash_message(served, flow_run_id, messages, state)
    print(json.dumps(messages[0]))
