"""Notifications (flows/notify.py), unit tests: the hooks and the sender called directly against a
receiver on 127.0.0.1 (tests/support/webhook.py). Failed, refused and crashed runs and promotion
decisions reach a webhook, once per event; a slow or dead receiver is a warning within the timeout;
the URL, which holds a token, is never written anywhere.

End to end: the real flow in tests/flows/test_notify_flow.py, crashes of the served deployment in
tests/flows/test_served_deployment.py.
"""

from __future__ import annotations

import logging
import time
import urllib.error
from types import SimpleNamespace
from typing import Any

import pytest

from flows import notify
from tasks.core.errors import DataRefused, ExpectedFailure
from tasks.core.redact import redact
from tests.support.notify_token import HOOK_PATH, QUERY_SECRET, TOKEN
from tests.support.webhook import WebhookReceiver

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
    # (Slack's format, the default: its markup characters escaped, which Slack shows as `>`)
    assert "stage: download" in message["text"] and "class_imbalance 1.05 &gt; 1" in message["text"]
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


FORGED_NAME = (
    "nightly' Completed (promotion)\npromotion: v9 promoted\r\n<!channel> re-login: <https://evil.example|x> &amp;"
)


@pytest.mark.parametrize("fmt", ["slack", "generic"])
def test_a_run_name_from_the_api_cannot_forge_lines_mentions_or_links(
    monkeypatch: pytest.MonkeyPatch, quiet_logger: logging.Logger, fmt: str
) -> None:
    """Whoever starts a run through the API names it (and its tasks): in the message each name is one line,
    cut short, and Slack shows its markup as text instead of pinging the channel or drawing a link."""
    flow, flow_run, state = _run_objects("Failed", ValueError("x"))
    flow_run.name = FORGED_NAME + "x" * 500
    with WebhookReceiver() as hook:
        monkeypatch.setenv("LOCKSTEP_NOTIFY_URL", hook.url(HOOK_PATH))
        monkeypatch.setattr(notify, "notify_config", lambda flow_run: notify.NotifyConfig(format=fmt))
        monkeypatch.setattr(notify, "_running", {FLOW_RUN_ID: "train\n<!here>"})
        notify.on_failure(flow, flow_run, state)
        (message,) = hook.wait_for(1)
    lines = message["text"].splitlines()
    assert [line.split(":")[0] for line in lines[1:]] == ["deployment", "stage", "error", "flow run id"], lines
    assert lines[0].startswith("lockstep-pipeline: flow run 'nightly' Completed (promotion)\\npromotion: v9 promoted")
    assert len(lines[0]) < notify.MAX_NAME_CHARS + 100
    if fmt == "slack":
        assert "<" not in message["text"] and ">" not in message["text"], message["text"]
        assert "&lt;!channel&gt;" in lines[0] and "&amp;amp;" in lines[0] and lines[2] == "stage: train\\n&lt;!here&gt;"
    else:
        assert message["flow_run"].startswith("nightly' Completed") and "\n" not in message["flow_run"]
        assert len(message["flow_run"]) == notify.MAX_NAME_CHARS and message["stage"] == "train\\n<!here>"


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
