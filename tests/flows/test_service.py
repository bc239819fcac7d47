"""The pipeline as a service, with real servers on loopback: a Prefect server and the served
deployment (`python -m flows.deployments serve`, what `make schedule` runs), a process work pool with
a real worker, an MLflow tracking server the runs log to over HTTP, and headless Chromium on the
MLflow UI.

The tests share one module-wide stack, like a user's week: a first run, an unchanged source
(nothing retrains), new data (retrains, champion/challenger), a failing stage, a changed parameter,
two overlapping runs on a worker, the schedule, the UI, and what the server refuses (strangers,
other origins, overrides that reach the network). That stopping `serve` takes its server down with
it is tests/reliability/test_server_binds.py's (`make schedule`). The data source is a local image
folder (sklearn's digits written as PNGs), so that a test can change the data the way a real source
changes.
"""

from __future__ import annotations

import json
import re
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.core.config.params import STAGES
from tasks.core.lock import pipeline_lock
from tasks.tracking.dashboard import CURVES, run_page, runs_page
from tests.conftest import (
    ROOT,
    TINY,
    copy_project,
    free_port,
    run,
    seed_prefect_home,
    service,
    stop_group,
    subprocess_env,
    until_healthy,
)
from tests.support.chromium import devtools
from tests.support.digits import write_digits
from tests.support.prefect_client import PrefectAPI, basic_auth, cron_far_from_now, status_of, wait_for_deployment
from tests.support.webhook import WebhookReceiver

pytestmark = pytest.mark.slow

DEPLOYMENT = "lockstep-pipeline/nightly"
FIRST_IMAGES = 1634  # of digits' 1797; the other 163 (10%) arrive later as "new data"
SCREENSHOTS = ROOT / "test-artifacts"  # kept for a person to look at
CRON = cron_far_from_now()  # the nightly default would start a run of its own when a session spans 03:00 UTC
SCHEDULER_WAIT_S = 90  # Prefect's scheduler service loops every 60 s (its recent-deployments loop, 5 s)


@dataclass
class Stack:
    repo: Path
    images: Path
    api: str  # Prefect REST API
    mlflow: str  # MLflow tracking server
    serve: subprocess.Popen[bytes]
    prefect: PrefectAPI  # the API with serve's auth string, as a client uses it
    hook: WebhookReceiver  # the on-call webhook serve's runs notify (LOCKSTEP_NOTIFY_URL)
    timings: dict[str, float] = field(default_factory=dict)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, prefect_database: Path) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp("service")
    images = base / "digits-folder"
    write_digits(images, range(FIRST_IMAGES))
    repo = copy_project(
        base / "repo",
        {
            "data": {"source": "imagefolder", "path": str(images), "channels": 1},
            "compress": {"variants": ["static_int8"]},
            "orchestration": {"notify": {"format": "generic"}, "cron": CRON},
        },
    )
    seed_prefect_home(repo / ".prefect", prefect_database)  # as the project's first `make run` leaves it
    mlflow_port, prefect_port = free_port(), free_port()
    mlflow = f"http://127.0.0.1:{mlflow_port}"
    api = f"http://127.0.0.1:{prefect_port}/api"
    mlflow_server = [
        "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{base / 'mlflow-server.db'}",
        "--artifacts-destination",
        str(base / "mlflow-artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(mlflow_port),
    ]
    # the two servers start side by side (MLflow's ~10 s inside serve's ~20 s); runs need both
    with service(
        mlflow_server,
        base,
        f"{mlflow}/health",
        base / "mlflow-server.log",
        ready=False,
        MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
        MLFLOW_DISABLE_TELEMETRY="true",
    ) as mlflow_proc:
        # what `make schedule` runs: it starts its own Prefect server, then serves the deployment; an
        # export gate is not a key API runs may change unless allowed (test_a_failed_stage_... sets it)
        serve = [sys.executable, "-m", "flows.deployments", "serve", "--port", str(prefect_port)]
        serve += ["--allow-override", "export.max_abs_diff"]
        with (
            WebhookReceiver() as hook,
            service(
                serve,
                repo,
                f"{api}/health",
                base / "serve.log",
                MLFLOW_TRACKING_URI=mlflow,
                LOCKSTEP_NOTIFY_URL=hook.url("/hooks/oncall"),
            ) as serve_proc,
        ):
            # the auth string as a user finds it: in the project's .prefect/api-auth
            auth = wait_for_deployment(api, repo / ".prefect" / "api-auth", DEPLOYMENT, serve_proc, 180)
            until_healthy(mlflow_proc, f"{mlflow}/health", base / "mlflow-server.log")
            yield Stack(repo, images, api, mlflow, serve_proc, PrefectAPI(api, auth), hook)


@dataclass(frozen=True)
class FirstRun:
    flow_run_id: str
    output: str  # what `prefect deployment run --watch` printed


@pytest.fixture(scope="module")
def first_run(stack: Stack) -> FirstRun:
    """The deployment's first run: a full pipeline, champion version 1. Every test that needs a trained
    service asks for it, so that it holds whichever test runs first, or alone; each test leaves the
    pipeline up to date (DVC) for the next."""
    flow_run_id, done = deployment_run(stack)
    return FirstRun(flow_run_id, done.stdout)


# --------------------------------------------------------------------------- helpers


def deployment_run(stack: Stack, name: str = DEPLOYMENT, *args: str, check: bool = True) -> tuple[str, Any]:
    """`prefect deployment run NAME --watch`, as a user types it; returns (flow run id, result)."""
    started = time.monotonic()
    done = run(
        ["prefect", "deployment", "run", name, "--watch", "--watch-timeout", "600", *args],
        stack.repo,
        check=check,
        **stack.prefect.client_env,
    )
    stack.timings[name + " ".join(args)] = time.monotonic() - started
    found = re.search(r"UUID: ([0-9a-f-]{36})", done.stdout)
    assert found, done.stdout
    return found.group(1), done


def api(stack: Stack, path: str, body: dict[str, Any] | None = None) -> Any:
    """One call to Prefect's REST API (POST when there is a body)."""
    return stack.prefect(path, body)


def flow_run_logs(stack: Stack, flow_run_id: str) -> list[dict[str, Any]]:
    return api(
        stack, "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200, "sort": "TIMESTAMP_ASC"}
    )


def notifications(stack: Stack, flow_run_id: str, expected: int) -> list[dict[str, Any]]:
    """The on-call messages about one flow run, once `expected` arrived (and a moment for a duplicate)."""

    def mine() -> list[dict[str, Any]]:
        return [m for m in stack.hook.messages if m.get("flow_run_id") == flow_run_id]

    deadline = time.monotonic() + 30
    while len(mine()) < expected:
        assert time.monotonic() < deadline, (expected, stack.hook.messages)
        time.sleep(0.2)
    time.sleep(1)
    return mine()


def mlflow_client(stack: Stack) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=stack.mlflow)


def executions(stack: Stack) -> list[tuple[Any, dict[str, Any]]]:
    """(parent run, {stage: child run}) for every pipeline execution logged to the server, oldest first."""
    client = mlflow_client(stack)
    experiment = client.get_experiment_by_name("lockstep")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    return [
        (p, {r.data.tags["lockstep.stage"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == p.info.run_id})
        for p in parents
    ]


# --------------------------------------------------------------------------- the tests, in order


def test_deployment_run_completes_and_logs_to_the_mlflow_server(stack: Stack, first_run: FirstRun) -> None:
    assert "Completed" in first_run.output
    parent, children = executions(stack)[0]
    assert set(children) == {"download", "stats", "preprocess", "train", "evaluate", "compress", "export"}
    assert parent.data.tags["lockstep.entry_point"] == "prefect" and parent.info.status == "FINISHED"
    assert all(child.info.status == "FINISHED" for child in children.values())
    # logged over HTTP: the server holds the artifacts too
    artifacts = {a.path for a in mlflow_client(stack).list_artifacts(children["train"].info.run_id)}
    assert {"checkpoints", "history.json", "train.json"} <= artifacts
    assert "test_accuracy" in children["evaluate"].data.metrics
    # the shipped ONNX registered by export, version 1, champion at once (later tests may promote others)
    export = children["export"]
    assert mlflow_client(stack).get_model_version("lockstep-classifier", "1").run_id == export.info.run_id
    assert export.data.tags["registry.decision"] == "promoted to champion"
    # the people on call are told: one message, the decision's line
    (message,) = notifications(stack, first_run.flow_run_id, 1)
    assert (message["event"], message["state"]) == ("promotion", "Completed")
    assert message["promotion"] == export.data.tags["registry.verdict"] and "no champion yet" in message["promotion"]
    # the stages' own log lines reach Prefect's run log
    messages = [entry["message"] for entry in flow_run_logs(stack, first_run.flow_run_id)]
    assert any(m.startswith("train: best_val_accuracy 0.") for m in messages), messages
    epochs = [m.split(":")[0] for m in messages if m.startswith("epoch ")]  # the train stage's, as it trained
    assert epochs == [f"epoch {n}/{TINY['train']['epochs']}" for n in range(1, TINY["train"]["epochs"] + 1)], messages
    print(f"prefect deployment run -> completed pipeline: {stack.timings[DEPLOYMENT]:.1f} s")


def test_unchanged_source_retrains_nothing_and_says_so(stack: Stack, first_run: FirstRun) -> None:
    lock_before = (stack.repo / "dvc.lock").read_text()
    flow_run_id, _ = deployment_run(stack)  # the deployment's reingest=true: the source is read again
    parent, children = executions(stack)[-1]
    assert set(children) == {"download"}
    assert parent.data.tags["lockstep.retrained"] == "false"
    assert "nothing retrained" in parent.data.tags["lockstep.summary"]
    messages = [entry["message"] for entry in flow_run_logs(stack, flow_run_id)]
    assert any("data unchanged" in m and "nothing retrained" in m for m in messages), messages
    time.sleep(2)  # nothing to tell: no failure, no promotion decision
    assert not [m for m in stack.hook.messages if m.get("flow_run_id") == flow_run_id]
    # the same entries (compared as data: DVC may write a null differently after a params.yaml
    # that the flow itself rewrote, as an earlier test's override does)
    assert yaml.safe_load((stack.repo / "dvc.lock").read_text()) == yaml.safe_load(lock_before)


def _split_contents(repo: Path) -> dict[str, set[bytes]]:
    """Each split's images, by content (the preprocessed arrays: what was trained and tested on)."""
    from tasks.data.preprocess import load_split

    pre = repo / "artifacts/preprocessed"
    return {name: {image.tobytes() for image in load_split(pre, name).images} for name in ("train", "val", "test")}


def test_new_data_retrains_with_stable_splits_and_a_paired_promotion(stack: Stack, first_run: FirstRun) -> None:
    client = mlflow_client(stack)
    latest_before = max(int(v.version) for v in client.search_model_versions("name = 'lockstep-classifier'"))
    champion_before = client.get_model_version_by_alias("lockstep-classifier", "champion").version
    splits_before = _split_contents(stack.repo)
    write_digits(stack.images, range(FIRST_IMAGES, 1797))  # 10% more images
    flow_run_id, _ = deployment_run(stack)
    parent, children = executions(stack)[-1]
    assert set(children) == {"download", "stats", "preprocess", "train", "evaluate", "compress", "export"}
    assert parent.data.tags["lockstep.retrained"] == "true" and "new data" in parent.data.tags["lockstep.summary"]
    assert children["train"].data.tags["data.md5"] != executions(stack)[0][1]["train"].data.tags["data.md5"]
    # split by content hash: every image stays where it was, the new ones join, none is in two splits
    after = _split_contents(stack.repo)
    assert all(splits_before[name] <= after[name] for name in after)
    assert not (after["test"] & (after["train"] | after["val"])) and not after["train"] & after["val"]
    assert sum(map(len, after.values())) > sum(map(len, splits_before.values()))
    # the data checks passed, against the data the champion was trained on
    assert children["download"].data.tags["checks.verdict"] == "passed"
    export, metrics = children["export"].data.tags, children["export"].data.metrics
    version = str(latest_before + 1)
    assert export["registry.version"] == version and export["registry.champion_version_before"] == champion_before
    assert client.get_model_version_by_alias("lockstep-classifier", "challenger").version == version
    champion = client.get_model_version_by_alias("lockstep-classifier", "champion").version
    assert export["registry.decision"] == ("promoted to champion" if champion == version else "kept current champion")
    # decided on the same images: the champion's ONNX model scored on the new test split
    test_images = len(after["test"])
    assert f"vs champion v{champion_before}" in export["registry.verdict"]
    assert f"on the same {test_images} test images" in export["registry.verdict"], export["registry.verdict"]
    assert {"registry.champion_accuracy", "registry.margin", "registry.mcnemar_p"} <= set(metrics)
    recorded = client.get_model_version("lockstep-classifier", version).tags["promotion.verdict"]
    assert recorded == export["registry.verdict"]
    assert [m["promotion"] for m in notifications(stack, flow_run_id, 1)] == [export["registry.verdict"]]


def test_a_shrunken_source_is_refused_and_changes_nothing(stack: Stack, first_run: FirstRun) -> None:
    client = mlflow_client(stack)
    before = {name: (stack.repo / name).read_text() for name in ("data.dvc", "dvc.lock")}
    champion = client.get_model_version_by_alias("lockstep-classifier", "champion").version
    versions = len(client.search_model_versions("name = 'lockstep-classifier'"))
    gone = sorted(stack.images.glob("*/*.png"))[::4]  # a quarter of the images vanish from the source
    for path in gone:
        path.unlink()
    try:
        flow_run_id, done = deployment_run(stack, check=False)
    finally:  # the same files back, byte for byte: later tests see the data the pipeline has
        write_digits(stack.images, [int(path.stem) for path in gone])
    assert done.returncode != 0 and "Failed" in done.stdout, done.stdout
    messages = [entry["message"] for entry in flow_run_logs(stack, flow_run_id)]
    refused = [m for m in messages if "data check(s) refused the new snapshot" in m]
    assert refused and "image_drop:" in refused[0] and "25.0% fewer, allowed 10.0%" in refused[0], messages
    assert {name: (stack.repo / name).read_text() for name in before} == before
    assert client.get_model_version_by_alias("lockstep-classifier", "champion").version == champion
    assert len(client.search_model_versions("name = 'lockstep-classifier'")) == versions
    parent, children = executions(stack)[-1]
    assert set(children) == {"download"} and children["download"].info.status == "FAILED"
    assert children["download"].data.tags["checks.verdict"] == "refused"
    (message,) = notifications(stack, flow_run_id, 1)
    assert (message["event"], message["state"], message["stage"]) == ("refused", "Failed", "download")
    assert message["error"] in refused[0] and "image_drop:" in message["error"]


def test_a_failed_stage_is_visible_in_prefect_with_its_log(stack: Stack, first_run: FirstRun) -> None:
    # an impossible export gate: the export stage fails after compress
    impossible = {"overrides": {"export.max_abs_diff": 1e-12}}
    params_before = (stack.repo / "params.yaml").read_text()
    try:
        flow_run_id, done = deployment_run(stack, DEPLOYMENT, "--params", json.dumps(impossible), check=False)
    finally:  # the override is written into params.yaml: put it back, leaving the pipeline up to date
        (stack.repo / "params.yaml").write_text(params_before)
    assert done.returncode != 0 and "Failed" in done.stdout, done.stdout
    task_runs = api(stack, "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
    states = {t["name"]: t["state"]["type"] for t in task_runs}
    assert states["export"] == "FAILED", states
    assert states["compress"] == "COMPLETED"
    messages = [entry["message"] for entry in flow_run_logs(stack, flow_run_id)]
    assert any("export parity gate(s) failed" in m and "allowed 1e-12" in m for m in messages), messages
    assert executions(stack)[-1][1]["export"].info.status == "FAILED"
    (message,) = notifications(stack, flow_run_id, 1)
    assert (message["event"], message["state"], message["stage"]) == ("failed", "Failed", "export")
    assert "export parity gate(s) failed" in message["error"] and "allowed 1e-12" in message["error"]


def test_a_changed_parameter_reruns_from_the_stage_that_reads_it(stack: Stack, first_run: FirstRun) -> None:
    # a value the flow's signature does not accept is refused by Prefect before any run starts
    refused = run(
        ["prefect", "deployment", "run", DEPLOYMENT, "--param", "force=maybe"],
        stack.repo,
        check=False,
        **stack.prefect.client_env,
    )
    assert refused.returncode != 0 and "force" in refused.stdout + refused.stderr
    before = len(executions(stack))
    lr = yaml.safe_load((stack.repo / "params.yaml").read_text())["train"]["lr"]
    lr = round(lr * 0.6, 6)  # a value not run before
    overrides = {"overrides": {"train.lr": lr}}
    deployment_run(stack, DEPLOYMENT, "--params", json.dumps(overrides))
    assert len(executions(stack)) == before + 1  # the refused run never started
    parent, children = executions(stack)[-1]
    assert set(children) == {"download", "train", "evaluate", "compress", "export"}
    assert float(children["train"].data.params["train.lr"]) == lr
    # written into params.yaml like `dvc exp run -S`, comments kept; DVC agrees the pipeline is done
    params_text = (stack.repo / "params.yaml").read_text()
    assert yaml.safe_load(params_text)["train"]["lr"] == lr
    status = run(["dvc", "status"], stack.repo).stdout
    assert "Data and pipelines are up to date" in status, status


def test_overlapping_runs_on_a_process_worker_wait_for_each_other(stack: Stack, first_run: FirstRun) -> None:
    deployed = run(
        [sys.executable, "-m", "flows.deployments", "deploy", "--pool", "lockstep-test", "--name", "pooled"],
        stack.repo,
        MLFLOW_TRACKING_URI=stack.mlflow,
        **stack.prefect.client_env,
    )
    assert "lockstep-pipeline/pooled" in deployed.stdout
    log = stack.repo.parent / "worker.log"
    env = subprocess_env(MLFLOW_TRACKING_URI=stack.mlflow, **stack.prefect.client_env)
    worker = subprocess.Popen(
        ["prefect", "worker", "start", "--pool", "lockstep-test", "--type", "process"],
        cwd=stack.repo,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    try:
        # Two runs at once, while a third party (this test) holds the pipeline lock, so that they
        # overlap for sure: both wait, then run one after the other.
        with pipeline_lock("the test", wait_s=0, root=stack.repo):
            started = [
                run(
                    ["prefect", "deployment", "run", "lockstep-pipeline/pooled"], stack.repo, **stack.prefect.client_env
                ).stdout
                for _ in range(2)
            ]
            ids = [re.search(r"UUID: ([0-9a-f-]{36})", out).group(1) for out in started]
            _wait_until(lambda: all(_waited(stack, i) for i in ids), timeout_s=180)
        final = _wait_for_final_states(stack, ids, timeout_s=300)
    finally:
        stop_group(worker)
    assert final == ["COMPLETED", "COMPLETED"], (final, log.read_text()[-3000:])
    holders = [[e["message"] for e in flow_run_logs(stack, i) if "waiting up to" in e["message"]] for i in ids]
    assert all("the test (pid" in waits[0] for waits in holders), holders
    # one after the other: neither MLflow execution overlaps the other
    (first, _), (second, _) = executions(stack)[-2:]
    assert second.info.start_time >= first.info.end_time
    for parent, children in executions(stack)[-2:]:
        assert parent.data.tags["lockstep.retrained"] == "false" and set(children) == {"download"}
    assert "Data and pipelines are up to date" in run(["dvc", "status"], stack.repo).stdout


def _waited(stack: Stack, flow_run_id: str) -> bool:
    return any("waiting up to" in e["message"] for e in flow_run_logs(stack, flow_run_id))


def _wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not true after {timeout_s} s"
        time.sleep(1)


def _wait_for_final_states(stack: Stack, ids: list[str], timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        states = [api(stack, f"/flow_runs/{i}")["state"]["type"] for i in ids]
        if all(s in ("COMPLETED", "FAILED", "CANCELLED", "CRASHED") for s in states) or time.monotonic() > deadline:
            return states
        time.sleep(2)


def test_the_server_refuses_strangers_and_other_origins(stack: Stack) -> None:
    """`make schedule`'s server, as a web page or a DNS-rebound host name reaches it: no credentials,
    another origin, no CSRF token. Prefect 3.8's defaults answered all of these."""
    auth_file = stack.repo / ".prefect" / "api-auth"
    assert stat.S_IMODE(auth_file.stat().st_mode) == 0o600
    assert stack.prefect.auth_string.startswith("lockstep:") and len(stack.prefect.auth_string) > 30
    deployment = f"{stack.api}/deployments/name/{DEPLOYMENT}"
    assert status_of(deployment)[0] == 401
    assert status_of(deployment, Authorization=basic_auth("lockstep:guess"))[0] == 401
    assert status_of(deployment, Host="evil.example:4200")[0] == 401  # DNS rebinding: still no credentials
    authorized = {"Authorization": basic_auth(stack.prefect.auth_string), "Content-Type": "application/json"}
    deployment_id = stack.prefect(f"/deployments/name/{DEPLOYMENT}")["id"]
    start = f"{stack.api}/deployments/{deployment_id}/create_flow_run"
    assert status_of(start, "POST", Origin="http://evil.example", **authorized)[0] == 403  # no CSRF token
    preflight = {"Access-Control-Request-Method": "POST"}
    _, foreign = status_of(start, "OPTIONS", Origin="http://evil.example", **preflight)
    _, own = status_of(start, "OPTIONS", Origin=stack.api.removesuffix("/api"), **preflight)
    assert "access-control-allow-origin" not in {key.lower() for key in foreign}, foreign
    assert {key.lower(): value for key, value in own.items()}["access-control-allow-origin"] == stack.api.removesuffix(
        "/api"
    )
    secret = stack.prefect.auth_string.split(":", 1)[1]
    serve_log = (stack.repo.parent / "serve.log").read_text()
    assert secret not in serve_log  # printed: where it is, not what
    assert "Starting temporary server" not in serve_log  # serve talks to its own server, the locked one


def test_the_prefect_ui_calls_the_api_on_the_port_the_server_runs_on(stack: Stack) -> None:
    """`make schedule PREFECT_PORT=...`: the UI's pages must call that port, not Prefect's default 4200."""
    with urllib.request.urlopen(stack.api.removesuffix("/api") + "/ui-settings", timeout=10) as response:
        settings = json.loads(response.read())
    assert settings["api_url"] == stack.api, settings


def test_a_run_cannot_point_the_pipeline_at_another_machine(stack: Stack) -> None:
    """Overrides through the API of keys that reach the network are refused before anything is written
    (this server was started without --allow-override); the "attacker's" rendezvous hears nothing."""
    with socket.socket() as attacker:
        attacker.bind(("127.0.0.1", 0))
        attacker.listen()
        attacker.setblocking(False)
        endpoint = f"127.0.0.1:{attacker.getsockname()[1]}"
        before = _files(stack.repo, "params.yaml", "dvc.lock")
        overrides = {"overrides": {"train.strategy": "ddp", "train.nnodes": 2, "train.rdzv_endpoint": endpoint}}
        flow_run_id, done = deployment_run(stack, DEPLOYMENT, "--params", json.dumps(overrides), check=False)
        assert done.returncode != 0
        state = stack.prefect(f"/flow_runs/{flow_run_id}")["state"]
        assert state["type"] == "FAILED", state
        assert "train.nnodes, train.rdzv_endpoint reach the network or other machines" in state["message"], state
        with pytest.raises(BlockingIOError):
            attacker.accept()
    assert _files(stack.repo, *before) == before


def _files(folder: Path, *names: str) -> dict[str, str | None]:
    return {name: (folder / name).read_text() if (folder / name).exists() else None for name in names}


def test_the_schedule_created_upcoming_runs(stack: Stack) -> None:
    deployment = api(stack, f"/deployments/name/{DEPLOYMENT}")
    assert [s["schedule"]["cron"] for s in deployment["schedules"]] == [CRON]
    assert deployment["parameters"] == {"reingest": True}
    upcoming = {"deployment_id": {"any_": [deployment["id"]]}, "state": {"type": {"any_": ["SCHEDULED"]}}}
    # The server's scheduler service creates the runs on its own loop, some seconds after the
    # deployment appears: when this test runs first, it must wait for that loop.
    deadline = time.monotonic() + SCHEDULER_WAIT_S
    while len(scheduled := api(stack, "/flow_runs/filter", {"flow_runs": upcoming})) < 3:
        if time.monotonic() > deadline:
            break
        time.sleep(1)
    starts = sorted(datetime.fromisoformat(r["expected_start_time"].replace("Z", "+00:00")) for r in scheduled)
    assert len(starts) >= 3, scheduled
    assert all((t.hour, t.minute, t.utcoffset().total_seconds()) == (int(CRON.split()[1]), 0, 0) for t in starts)
    assert starts[0] > datetime.now(starts[0].tzinfo)


def test_the_mlflow_ui_shows_the_pipeline_in_headless_chromium(
    stack: Stack, first_run: FirstRun, tmp_path: Path
) -> None:
    """The pages a person opens, as they draw in a browser; screenshots kept in test-artifacts/."""
    parent, children = executions(stack)[0]
    experiment, train, evaluate = parent.info.experiment_id, children["train"], children["evaluate"]
    table = runs_page(stack.mlflow, experiment)  # the link the pipeline prints at its end
    with devtools(tmp_path / "profile", width=2400, height=1100) as page:
        # the runs table in MLflow's model-training pages, the pipeline runs with their numbers and data
        page.open(table, "document.body.innerText.includes('shipped_test_accuracy')")
        page.screenshot(SCREENSHOTS / "mlflow-runs-table.png")
        text = page.evaluate("document.body.innerText")
        assert parent.info.run_name in text and "Token Usage" not in text  # not the GenAI overview
        assert str(parent.data.metrics["test_accuracy"])[:6] in text and "train.model" in text, text
        assert "imagefolder:digits-folder" in text  # the Dataset column
        # the training curves of every pipeline run, drawn without opening a run
        drawn = f"document.querySelectorAll('.js-plotly-plot .scatterlayer .trace').length >= {len(CURVES)}"
        page.resize(2400, 2600)  # the charts view draws only the charts in view: all of them, here
        page.open(table + "&compareRunsMode=CHART", drawn)  # (plotly's line traces, one per curve at least)
        assert "val_accuracy" in page.evaluate("document.body.innerText")
        page.screenshot(SCREENSHOTS / "mlflow-charts.png")
        page.resize(2400, 1100)
        # a stage's run page, and the train run's system metrics, in the model-training pages (the
        # GenAI ones list Judges and Prompts in their menu)
        page.open(
            f"{stack.mlflow}/{run_page(experiment, evaluate.info.run_id)}",
            "document.body.innerText.includes('test_accuracy')",
        )
        text = page.evaluate("document.body.innerText")
        assert f"{evaluate.data.metrics['test_accuracy']:.4g}"[:5] in text and "Judges" not in text, text
        page.screenshot(SCREENSHOTS / "mlflow-run-page.png")
        page.open(
            f"{stack.mlflow}/{run_page(experiment, train.info.run_id, '/system-metrics')}",
            # the charts in view drawn (CPU, disk, network, memory: two rows and more), not their spinners
            "document.body.innerText.includes('cpu_utilization_percentage') && "
            "document.querySelectorAll('.js-plotly-plot .scatterlayer .trace').length >= 6",
        )
        page.screenshot(SCREENSHOTS / "mlflow-system-metrics.png")
        # the registered version: what shipped, the decision, links to its card and runs
        page.open(
            f"{stack.mlflow}/#/models/lockstep-classifier/versions/1", "document.body.innerText.includes('model card')"
        )
        assert "promoted to champion" in page.evaluate("document.body.innerText")
        links = page.evaluate("[...document.querySelectorAll('a')].map(a => a.getAttribute('href'))")
        assert run_page(experiment, parent.info.run_id) in links, links
        page.screenshot(SCREENSHOTS / "mlflow-model-version.png")


def test_the_prefect_ui_lists_the_flow_run_and_its_task_runs(stack: Stack, first_run: FirstRun, tmp_path: Path) -> None:
    ui = stack.api.removesuffix("/api")
    with devtools(tmp_path / "profile", width=1600, height=1400) as page:
        # logged in as a person does on its login page: the UI keeps the auth string in the browser
        page.open(f"{ui}/api/health")
        page.evaluate(f"localStorage.setItem('prefect-password', btoa({json.dumps(stack.prefect.auth_string)}))")
        page.open(
            f"{ui}/runs/flow-run/{first_run.flow_run_id}?tab=Task+Runs", "document.body.innerText.includes('export')"
        )
        text = page.evaluate("document.body.innerText")
        name = stack.prefect(f"/flow_runs/{first_run.flow_run_id}")["name"]
        assert name in text and "Completed" in text, text[:2000]
        assert all(stage in text for stage in STAGES), text[:2000]
        assert not [f for f in page.failed if f.startswith(ui)], page.failed  # every call to its API answered
        page.screenshot(SCREENSHOTS / "prefect-flow-run.png")
        # its log, as training went: the train stage's epoch lines
        first_epoch = f"epoch 1/{TINY['train']['epochs']}: train_loss"
        page.open(
            f"{ui}/runs/flow-run/{first_run.flow_run_id}?tab=Logs", f"document.body.innerText.includes({first_epoch!r})"
        )
