"""The pipeline as a service, with real servers on loopback: the served deployment (`python -m
flows.deployments serve`, what `make schedule` runs, with its own Prefect server), a process work pool
with a real worker, an MLflow tracking server the runs log to over HTTP, and headless Chromium on the UIs.

One module-wide stack, like a user's week: a first run, new data (retrains, champion/challenger), a
shrunken source, a failing stage, a changed parameter, two overlapping runs on a worker (which find the
source unchanged: nothing retrains), the UIs. The data source is a local image folder (sklearn's digits
as PNGs), so that a test can change the data the way a real source changes. The server alone (what it
refuses, its schedule, crashed runs): tests/flows/test_served_deployment.py; stopping `serve` takes its
server down with it: tests/reliability/test_server_binds.py (`make schedule`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.core.config.params import STAGES
from tasks.core.lock import pipeline_lock
from tasks.tracking.dashboard import CURVES, run_page, runs_page
from tasks.tracking.orphans import FLOW_RUN_TAG
from tests.conftest import (
    ROOT,
    TINY,
    copy_project,
    free_port,
    run,
    seed_prefect_home,
    service,
    stop_prefect_worker,
    until_healthy,
)
from tests.support.chromium import devtools
from tests.support.digits import write_digits
from tests.support.prefect_client import PrefectAPI, cron_far_from_now
from tests.support.served import DEPLOYMENT, deployment_run, serving, until
from tests.support.webhook import WebhookReceiver

pytestmark = pytest.mark.slow

FIRST_IMAGES = 1634  # of digits' 1797; the other 163 (10%) arrive later as "new data"
SCREENSHOTS = ROOT / "test-artifacts"  # kept for a person to look at
CRON = cron_far_from_now()  # the nightly default would start a run of its own when a session spans 03:00 UTC
ALL_STAGES = {"download", "stats", "preprocess", "train", "evaluate", "compress", "export"}


@dataclass
class Stack:
    repo: Path
    images: Path
    mlflow: str  # MLflow tracking server
    prefect: PrefectAPI  # the API with serve's auth string, as a client uses it
    hook: WebhookReceiver  # the on-call webhook serve's runs notify (LOCKSTEP_NOTIFY_URL)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, prefect_database: Path) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp("service")
    images = base / "digits-folder"
    write_digits(images, range(FIRST_IMAGES))
    orchestration = {"notify": {"format": "generic"}, "cron": CRON}
    data = {"source": "imagefolder", "path": str(images), "channels": 1}
    compress = {"variants": ["static_int8"]}
    # ONNX alone: nothing here reads the pt2 copy, whose torch.export costs each of the four exports ~2.7 CPU-s
    export = {"formats": ["onnx"]}
    repo = copy_project(
        base / "repo", {"data": data, "compress": compress, "export": export, "orchestration": orchestration}
    )
    seed_prefect_home(repo / ".prefect", prefect_database)  # as the project's first `make run` leaves it
    mlflow = f"http://127.0.0.1:{free_port()}"
    mlflow_server = ["mlflow", "server", "--backend-store-uri", f"sqlite:///{base / 'mlflow-server.db'}"]
    mlflow_server += ["--artifacts-destination", str(base / "mlflow-artifacts"), "--host", "127.0.0.1"]
    mlflow_server += ["--port", mlflow.rsplit(":", 1)[1]]
    mlflow_env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    # the two servers start side by side (MLflow's ~10 s inside serve's ~20 s); runs need both. serve is
    # what `make schedule` runs: it starts its own Prefect server, then serves the deployment; an export
    # gate is not a key API runs may change unless allowed (test_a_failed_stage_... sets it)
    mlflow_log = base / "mlflow-server.log"
    with (
        service(mlflow_server, base, f"{mlflow}/health", mlflow_log, ready=False, **mlflow_env) as ml,
        WebhookReceiver() as hook,
    ):
        env = {"MLFLOW_TRACKING_URI": mlflow, "LOCKSTEP_NOTIFY_URL": hook.url()}
        with serving(repo, base / "serve.log", "export.max_abs_diff", **env) as (_, prefect):
            until_healthy(ml, f"{mlflow}/health", mlflow_log)
            yield Stack(repo, images, mlflow, prefect, hook)


@dataclass(frozen=True)
class FirstRun:
    flow_run_id: str
    output: str  # what `prefect deployment run --watch` printed
    seconds: float


@pytest.fixture(scope="module")
def first_run(stack: Stack) -> FirstRun:
    """The deployment's first run: a full pipeline, champion version 1. Every test that needs a trained
    service asks for it, so that it holds whichever test runs first, or alone; each test leaves the
    pipeline up to date (DVC) for the next."""
    started = time.monotonic()
    flow_run_id, done = deployment_run(stack.prefect, stack.repo)
    return FirstRun(flow_run_id, done.stdout, time.monotonic() - started)


def log_lines(stack: Stack, flow_run_id: str) -> list[str]:
    """The flow run's log in Prefect, oldest first (the API answers at most 200 lines a call)."""
    lines: list[str] = []
    while True:
        query = {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200, "offset": len(lines)}
        page = [entry["message"] for entry in stack.prefect("/logs/filter", {**query, "sort": "TIMESTAMP_ASC"})]
        lines += page
        if len(page) < 200:
            return lines


def notifications(stack: Stack, flow_run_id: str, expected: int) -> list[dict[str, Any]]:
    """The on-call messages about one flow run, once `expected` arrived (and a moment for a duplicate)."""

    def mine() -> list[dict[str, Any]]:
        return [m for m in stack.hook.messages if m.get("flow_run_id") == flow_run_id]

    until(
        lambda: len(mine()) >= expected, f"{expected} message(s) expected", time.monotonic() + 30, stack.hook.messages
    )
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


def says(text: str) -> str:
    """JavaScript: the page shows `text`."""
    return f"document.body.innerText.includes({text!r})"


# --------------------------------------------------------------------------- the tests, in order


def test_deployment_run_completes_and_logs_to_the_mlflow_server(stack: Stack, first_run: FirstRun) -> None:
    assert "Completed" in first_run.output
    parent, children = executions(stack)[0]
    assert set(children) == ALL_STAGES
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
    messages = log_lines(stack, first_run.flow_run_id)
    assert any(m.startswith("train: best_val_accuracy 0.") for m in messages), messages
    epochs = [m.split(":")[0] for m in messages if m.startswith("epoch ")]  # the train stage's, as it trained
    assert epochs == [f"epoch {n}/{TINY['train']['epochs']}" for n in range(1, TINY["train"]["epochs"] + 1)], messages
    print(f"prefect deployment run -> completed pipeline: {first_run.seconds:.1f} s")


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
    flow_run_id, _ = deployment_run(stack.prefect, stack.repo)
    parent, children = executions(stack)[-1]
    assert set(children) == ALL_STAGES
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
        flow_run_id, done = deployment_run(stack.prefect, stack.repo, check=False)
    finally:  # the same files back, byte for byte: later tests see the data the pipeline has
        write_digits(stack.images, [int(path.stem) for path in gone])
    assert done.returncode != 0 and "Failed" in done.stdout, done.stdout
    messages = log_lines(stack, flow_run_id)
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
        flow_run_id, done = deployment_run(stack.prefect, stack.repo, "--params", json.dumps(impossible), check=False)
    finally:  # the override is written into params.yaml: put it back, leaving the pipeline up to date
        (stack.repo / "params.yaml").write_text(params_before)
    assert done.returncode != 0 and "Failed" in done.stdout, done.stdout
    task_runs = stack.prefect("/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
    states = {t["name"]: t["state"]["type"] for t in task_runs}
    assert states["export"] == "FAILED", states
    assert states["compress"] == "COMPLETED"
    messages = log_lines(stack, flow_run_id)
    assert any("export parity gate(s) failed" in m and "allowed 1e-12" in m for m in messages), messages
    assert executions(stack)[-1][1]["export"].info.status == "FAILED"
    (message,) = notifications(stack, flow_run_id, 1)
    assert (message["event"], message["state"], message["stage"]) == ("failed", "Failed", "export")
    assert "export parity gate(s) failed" in message["error"] and "allowed 1e-12" in message["error"]


def test_a_changed_parameter_reruns_from_the_stage_that_reads_it(stack: Stack, first_run: FirstRun) -> None:
    # a value the flow's signature does not accept is refused by Prefect before any run starts
    maybe = ["prefect", "deployment", "run", DEPLOYMENT, "--param", "force=maybe"]
    refused = run(maybe, stack.repo, check=False, **stack.prefect.client_env)
    assert refused.returncode != 0 and "force" in refused.stdout + refused.stderr
    before = len(executions(stack))
    assert yaml.safe_load((stack.repo / "params.yaml").read_text())["train"]["lr"] == "auto"  # 0.05 on digits
    lr = 0.03  # a value not run before
    overrides = {"overrides": {"train.lr": lr}}
    deployment_run(stack.prefect, stack.repo, "--params", json.dumps(overrides))
    assert len(executions(stack)) == before + 1  # the refused run never started
    parent, children = executions(stack)[-1]
    assert set(children) == {"download", "train", "evaluate", "compress", "export"}
    assert float(children["train"].data.params["train.lr"]) == lr
    # written into params.yaml like `dvc exp run -S`, comments kept; DVC agrees the pipeline is done
    params_text = (stack.repo / "params.yaml").read_text()
    assert yaml.safe_load(params_text)["train"]["lr"] == lr
    status = run(["dvc", "status"], stack.repo).stdout
    assert "Data and pipelines are up to date" in status, status


@dataclass(frozen=True)
class WorkerRuns:
    ids: list[str]  # the two flow runs
    final: list[str]  # their final state types
    lock_before: str  # dvc.lock before they started
    lock_after: str  # and once both were over (later tests may change it)
    worker_log: str


@pytest.fixture(scope="module")
def worker_runs(stack: Stack, first_run: FirstRun) -> WorkerRuns:
    """Two runs of a work pool's deployment at once on a real process worker, while a third party (this
    fixture) holds the pipeline lock, so that they overlap for sure: both wait, then run one after the
    other. The source has not changed since the last run: they are also the scheduled re-read of an
    unchanged source (the deployment's reingest=true), one pair of flow runs for two tests."""
    deploy = [sys.executable, "-m", "flows.deployments", "deploy", "--pool", "lockstep-test", "--name", "pooled"]
    deployed = run(deploy, stack.repo, MLFLOW_TRACKING_URI=stack.mlflow, **stack.prefect.client_env)
    assert "lockstep-pipeline/pooled" in deployed.stdout
    log = stack.repo.parent / "worker.log"
    worker = ["prefect", "worker", "start", "--pool", "lockstep-test", "--type", "process"]
    # the on-call webhook too, so that a message a no-op run must not send would be seen
    env = {"MLFLOW_TRACKING_URI": stack.mlflow, "LOCKSTEP_NOTIFY_URL": stack.hook.url()}
    with service(worker, stack.repo, "", log, ready=False, stop=stop_prefect_worker, **env, **stack.prefect.client_env):
        with pipeline_lock("the test", wait_s=0, root=stack.repo):
            lock_before = (stack.repo / "dvc.lock").read_text()
            pooled = {"name": "lockstep-pipeline/pooled", "watch": False}
            ids = [deployment_run(stack.prefect, stack.repo, **pooled)[0] for _ in range(2)]
            until(lambda: all(_waits(stack, i) for i in ids), "not both waiting", time.monotonic() + 180, poll_s=1)
        done = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")
        until(lambda: all(_state(stack, i) in done for i in ids), "not both over", time.monotonic() + 300, poll_s=2)
    lock_after = (stack.repo / "dvc.lock").read_text()
    return WorkerRuns(ids, [_state(stack, i) for i in ids], lock_before, lock_after, log.read_text()[-3000:])


def _waits(stack: Stack, flow_run_id: str) -> list[str]:
    return [line for line in log_lines(stack, flow_run_id) if "waiting up to" in line]


def _state(stack: Stack, flow_run_id: str) -> str:
    return stack.prefect(f"/flow_runs/{flow_run_id}")["state"]["type"]


def _says_unchanged(stack: Stack, flow_run_id: str) -> bool:
    return any("data unchanged" in m and "nothing retrained" in m for m in log_lines(stack, flow_run_id))


def _executions_of(stack: Stack, flow_run_ids: list[str]) -> list[tuple[Any, dict[str, Any]]]:
    found = {parent.data.tags.get(FLOW_RUN_TAG): (parent, children) for parent, children in executions(stack)}
    return [found[i] for i in flow_run_ids]


def test_overlapping_runs_on_a_process_worker_wait_for_each_other(stack: Stack, worker_runs: WorkerRuns) -> None:
    assert worker_runs.final == ["COMPLETED", "COMPLETED"], (worker_runs.final, worker_runs.worker_log)
    holders = [_waits(stack, i) for i in worker_runs.ids]
    assert all("the test (pid" in waits[0] for waits in holders), holders
    # one after the other: neither MLflow execution overlaps the other
    first, second = sorted((p for p, _ in _executions_of(stack, worker_runs.ids)), key=lambda p: p.info.start_time)
    assert second.info.start_time >= first.info.end_time
    assert "Data and pipelines are up to date" in run(["dvc", "status"], stack.repo).stdout


def test_unchanged_source_retrains_nothing_and_says_so(stack: Stack, first_run: FirstRun) -> None:
    lock_before = (stack.repo / "dvc.lock").read_text()
    flow_run_id, _ = deployment_run(stack.prefect, stack.repo)  # the deployment's reingest=true: read again
    parent, children = executions(stack)[-1]
    # the source is read again and gives data/ byte for byte: no stage runs, not even download
    assert children == {} and parent.data.tags["lockstep.retrained"] == "false"
    assert parent.data.tags[FLOW_RUN_TAG] == flow_run_id
    assert "stages run: none; source re-read, data unchanged" in parent.data.tags["lockstep.summary"]
    assert _says_unchanged(stack, flow_run_id), log_lines(stack, flow_run_id)
    time.sleep(2)  # nothing to tell: no failure, no promotion decision
    assert not [m for m in stack.hook.messages if m.get("flow_run_id") == flow_run_id]
    # the same entries (compared as data: DVC may write a null differently after a params.yaml
    # that the flow itself rewrote, as an earlier test's override does)
    assert yaml.safe_load((stack.repo / "dvc.lock").read_text()) == yaml.safe_load(lock_before)


def test_overlapping_runs_of_an_unchanged_source_on_a_worker_retrain_nothing(
    stack: Stack, worker_runs: WorkerRuns
) -> None:
    """The worker's two runs (the scheduled re-read of a source that has not changed): each retrained
    nothing, told on-call nothing, and left dvc.lock as it was."""
    for parent, children in _executions_of(stack, worker_runs.ids):
        assert children == {} and parent.data.tags["lockstep.retrained"] == "false"
        assert "source re-read, data unchanged" in parent.data.tags["lockstep.summary"]
    time.sleep(2)  # nothing to tell: no failure, no promotion decision
    assert not [m for m in stack.hook.messages if m.get("flow_run_id") in worker_runs.ids]
    assert yaml.safe_load(worker_runs.lock_after) == yaml.safe_load(worker_runs.lock_before)


def test_the_mlflow_ui_shows_the_pipeline_in_headless_chromium(
    stack: Stack, first_run: FirstRun, tmp_path: Path
) -> None:
    """The pages a person opens, as they draw in a browser; screenshots kept in test-artifacts/."""
    parent, children = executions(stack)[0]
    experiment, train, evaluate = parent.info.experiment_id, children["train"], children["evaluate"]
    table = runs_page(stack.mlflow, experiment)  # the link the pipeline prints at its end
    with devtools(tmp_path / "profile", width=2400, height=1100) as page:
        # the runs table in MLflow's model-training pages, the pipeline runs with their numbers and data
        page.open(table, says("shipped_test_accuracy"))
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
        page.open(f"{stack.mlflow}/{run_page(experiment, evaluate.info.run_id)}", says("test_accuracy"))
        text = page.evaluate("document.body.innerText")
        assert f"{evaluate.data.metrics['test_accuracy']:.4g}"[:5] in text and "Judges" not in text, text
        page.screenshot(SCREENSHOTS / "mlflow-run-page.png")
        page.open(
            f"{stack.mlflow}/{run_page(experiment, train.info.run_id, '/system-metrics')}",
            # the charts in view drawn (CPU, disk, network, memory: two rows and more), not their spinners
            says("cpu_utilization_percentage") + " && "
            "document.querySelectorAll('.js-plotly-plot .scatterlayer .trace').length >= 6",
        )
        page.screenshot(SCREENSHOTS / "mlflow-system-metrics.png")
        # the registered version: what shipped, the decision, links to its card and runs
        page.open(f"{stack.mlflow}/#/models/lockstep-classifier/versions/1", says("model card"))
        assert "promoted to champion" in page.evaluate("document.body.innerText")
        links = page.evaluate("[...document.querySelectorAll('a')].map(a => a.getAttribute('href'))")
        assert run_page(experiment, parent.info.run_id) in links, links
        page.screenshot(SCREENSHOTS / "mlflow-model-version.png")


def test_the_prefect_ui_lists_the_flow_run_and_its_task_runs(stack: Stack, first_run: FirstRun, tmp_path: Path) -> None:
    ui = stack.prefect.url.removesuffix("/api")
    with devtools(tmp_path / "profile", width=1600, height=1400) as page:
        # logged in as a person does on its login page: the UI keeps the auth string in the browser
        page.open(f"{ui}/api/health")
        page.evaluate(f"localStorage.setItem('prefect-password', btoa({json.dumps(stack.prefect.auth_string)}))")
        page.open(f"{ui}/runs/flow-run/{first_run.flow_run_id}?tab=Task+Runs", says("export"))
        text = page.evaluate("document.body.innerText")
        name = stack.prefect(f"/flow_runs/{first_run.flow_run_id}")["name"]
        assert name in text and "Completed" in text, text[:2000]
        assert all(stage in text for stage in STAGES), text[:2000]
        assert not [f for f in page.failed if f.startswith(ui)], page.failed  # every call to its API answered
        page.screenshot(SCREENSHOTS / "prefect-flow-run.png")
        # its log, as training went: the train stage's epoch lines
        first_epoch = f"epoch 1/{TINY['train']['epochs']}: train_loss"
        page.open(f"{ui}/runs/flow-run/{first_run.flow_run_id}?tab=Logs", says(first_epoch))
