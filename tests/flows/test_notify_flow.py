"""Notifications end to end: the real flow (`python -m flows.pipeline`, and the flow function as a
deployment's run calls it) in clones of the session's trained project, reporting to the module's
Prefect server (`prefect_server`). A failed stage, a refused snapshot, a run refused for the lock and
a promotion each send one message, whatever the receiver does; a params file cannot redirect or
silence the notice of its own failure; the URL, which holds a token, is written nowhere.

The hooks and the sender alone: tests/flows/test_notify.py; crashes of the served deployment:
tests/flows/test_served_deployment.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.core.lock import pipeline_lock
from tests.conftest import PrefectServer, clone_project, run, subprocess_env
from tests.support.notify_token import HOOK_PATH, holds_token, in_text
from tests.support.prefect_client import flow_run_states, start_flow_runs, wait_for_line
from tests.support.webhook import WebhookReceiver

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- each event, whatever the receiver does


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
    assert not any(in_text(text) for text in outputs)
    files = [path for folder in (repo, api.home) for path in folder.rglob("*")]
    leaked = [str(path) for path in files if path.is_file() and not path.is_symlink() and holds_token(path)]
    assert not leaked, leaked


def _hook_seconds(output: str, hook: str) -> float:
    """From the run's console log: how long Prefect spent in `hook`."""
    stamps = [
        datetime.strptime(found.group(1), "%H:%M:%S.%f")
        for line in output.splitlines()
        if (found := re.match(rf"(\d\d:\d\d:\d\d\.\d+) .*(?:Running hook|Hook) '{hook}'", line))
    ]
    assert len(stamps) == 2, output[-3000:]
    return (stamps[1] - stamps[0]).total_seconds()


def test_a_failed_stage_sends_one_message_even_to_a_slow_receiver(
    dvc_repo: dict[str, Any], prefect_server: PrefectServer, tmp_path: Path
) -> None:
    """An impossible export gate fails the export stage: one `failed` message naming it and the
    gate's line, while the receiver takes the message and never answers: the hook gives up after
    timeout_s, the run is Failed exactly as without notifications. The URL is written nowhere. The
    stages that ran before the failure (a new learning rate: train to compress) are in dvc.lock
    (flows/commits.py), so the next run starts at export."""
    repo = _clone(dvc_repo, tmp_path, {"timeout_s": 2})
    with WebhookReceiver("slow", slow_s=120) as hook:
        sets = ["--set", "train.lr=0.03", "--set", "export.max_abs_diff=1e-12"]
        done, took = _flow(repo, prefect_server, hook.url(HOOK_PATH), *sets)
        messages = hook.wait_for(2, timeout_s=1)
    output = done.stdout + done.stderr
    assert done.returncode == 3 and "Finished in state Failed(" in output, output[-3000:]
    assert set(json.loads(run(["dvc", "status", "--json"], repo).stdout)) == {"export"}, output[-3000:]
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


def test_a_refused_snapshot_sends_one_refused_message(
    dvc_repo: dict[str, Any], prefect_server: PrefectServer, tmp_path: Path
) -> None:
    """A new snapshot the data checks refuse (any class imbalance is too much): the download stage
    raises DataRefused; one `refused` message, generic JSON, naming the check and its numbers."""
    repo = _clone(dvc_repo, tmp_path, {"format": "generic"})
    with WebhookReceiver() as hook:
        done, took = _flow(
            repo, prefect_server, hook.url(HOOK_PATH), "--force", "--set", "checks.max_class_imbalance=1"
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


# --------------------------------------------------------------------------- whose params route the notice


def _planted(repo: Path, name: str, notify_params: dict[str, Any]) -> str:
    """A copy of params.yaml with other `orchestration.notify`, in a folder others can write to
    (an upload, a data folder); its path relative to the project."""
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["orchestration"]["notify"].update(notify_params)
    path = repo / "incoming" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return str(path.relative_to(repo))


@dataclass(frozen=True)
class ParamsFileRuns:
    files: list[str]  # the params file of each run, relative to the project
    states: list[dict[str, str]]  # each run's final state
    told: list[dict[str, Any]]  # what the on-call receiver got, in order
    attacker: list[dict[str, Any]]  # what the receiver the planted files name got


@pytest.fixture(scope="module")
def params_file_runs(
    dvc_repo: dict[str, Any], prefect_server: PrefectServer, tmp_path_factory: pytest.TempPathFactory
) -> ParamsFileRuns:
    """Issue 66, item 3: three runs started as a deployment's runs are (no overrides allowed), one after
    the other in one process (one start of Prefect, the flow and their imports for the three), while a
    real holder keeps the pipeline lock. The first two have a params file that redirects the notice
    (another `url_env`) or silences it (no `failed` event): refused for it, before the lock. The third's
    file passes the check (params.yaml's copy) and is swapped for one that redirects the notice while
    the run waits for the lock, until it gives up."""
    base = tmp_path_factory.mktemp("params-file")
    repo = _clone(dvc_repo, base, lock_wait_s=20)
    files = [_planted(repo, "redirect.yaml", {"url_env": "ATTACKER_URL"})]
    files += [_planted(repo, "silence.yaml", {"events": ["promotion"]}), _planted(repo, "params.yaml", {})]
    log = base / "flow.log"
    with WebhookReceiver() as oncall, WebhookReceiver() as attacker:
        env = subprocess_env(
            LOCKSTEP_NOTIFY_URL=oncall.url(HOOK_PATH), ATTACKER_URL=attacker.url(), **prefect_server.env
        )
        with pipeline_lock("the test", wait_s=0, root=repo):
            proc = start_flow_runs(repo, [{"params_file": name} for name in files], log, env)
            wait_for_line(log, "waiting up to", proc)  # the third run's: the first two were refused
            _planted(repo, "params.yaml", {"url_env": "ATTACKER_URL"})
            states = flow_run_states(proc, log)
        told = oncall.wait_for(3, timeout_s=5)
    return ParamsFileRuns(files, states, told, list(attacker.messages))


def test_a_refused_params_file_cannot_redirect_or_silence_the_failure_notice(params_file_runs: ParamsFileRuns) -> None:
    """A run with a params file that redirects or silences the notice is refused for it; the notice of
    that refusal still goes where the deployment's own params.yaml sends it, not where the refused file does."""
    (redirect, silence, _), states, told = params_file_runs.files, params_file_runs.states, params_file_runs.told
    assert [s["type"] for s in states[:2]] == ["FAILED", "FAILED"], states
    assert "orchestration.notify.url_env is not among" in states[0]["message"], states
    assert "orchestration.notify.events is not among" in states[1]["message"], states
    assert params_file_runs.attacker == []
    assert len(told) == 3 and all("Failed (failed)" in m["text"] for m in told[:2]), told
    assert f"params_file {redirect}: orchestration.notify.url_env" in told[0]["text"], told[0]
    assert f"params_file {silence}: orchestration.notify.events" in told[1]["text"], told[1]


def test_a_params_file_swapped_while_the_run_waits_cannot_redirect_its_failure_notice(
    params_file_runs: ParamsFileRuns,
) -> None:
    """A params file that passes the check is swapped for one that redirects the notice while its run
    waits for the pipeline lock: the notice of that failure goes where the checked params sent it."""
    state, told = params_file_runs.states[2], params_file_runs.told
    assert state["type"] == "FAILED" and "another pipeline run is in progress" in state["message"], state
    assert params_file_runs.attacker == []
    assert len(told) == 3 and "another pipeline run is in progress" in told[2]["text"], told
