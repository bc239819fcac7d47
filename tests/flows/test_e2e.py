"""End to end: the real pipeline through `dvc repro` and through the Prefect flow, in temporary
copies of the repository, checked through DVC's own commands and MLflow's client."""

from __future__ import annotations

import copy
import json
import re
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.core.config.params import NUMPY_STAGES, STAGES
from tasks.tracking.dashboard import run_page
from tests.conftest import TINY, PrefectServer, client_for, clone_project, run, sha256
from tests.support.first_run import TwoRuns

pytestmark = pytest.mark.slow

LINEAGE_TAGS = {
    "git.commit",
    "git.dirty",
    "data.md5",
    "dvc_lock.sha256",
    "version.torch",
    "version.torchvision",
    "device",
    "determinism.PYTHONHASHSEED",
    "determinism.cpu",
    "hw.cpu.mode",
    "hw.cpu.model",
    "hw.version.numpy",
}
# What the stages that compute with torch add: the data stages (numpy alone) never load it.
TORCH_TAGS = {
    "version.cuda",
    "version.cudnn",
    "determinism.cudnn.deterministic",
    "determinism.cudnn.benchmark",
    "determinism.deterministic_algorithms",
    "determinism.num_threads",
    "hw.cpu.capability",
    "hw.threads",
    "hw.version.mkl",
}
ARTIFACTS = {
    "download": {"receipt.json", "data.dvc"},
    "stats": {"stats.json"},
    "preprocess": {"preprocessed"},
    "train": {"checkpoints", "history.json", "train.json"},
    "evaluate": {"metrics.json", "per_class.json", "confusion_matrix.png"},
    "compress": {"metrics.json", "compression.csv", "compression.md", "finetune.json"},
    # (the ONNX models are MLflow "logged models", checked through the registry in test_compress_export.py)
    "export": {"model_card.md", "gates.json", "model.pt2"},
}
AFTER_DOWNLOAD = ["stats", "preprocess", "train", "evaluate", "compress", "export"]
EPOCHS = TINY["train"]["epochs"]
# Files whose bytes legitimately differ between two equal runs: measured latencies (and the
# files that quote them), the model card (it names the git commit) and TorchScript archives (a
# random serialization id). Everything else in dvc.lock must match.
MEASURED = {
    "artifacts/compress/metrics.json",
    "artifacts/compress/compression.md",
    "artifacts/compress/compression.csv",
    "artifacts/export/model_card.md",
    "artifacts/export/gates.json",  # its `shipped` section quotes compress's latencies
}


def comparable(lock: dict[str, Any]) -> dict[str, Any]:
    """dvc.lock without the hashes of MEASURED files."""
    stages = {}
    for name, stage in lock["stages"].items():
        stages[name] = {
            **stage,
            **{key: [e for e in stage.get(key, []) if e["path"] not in MEASURED] for key in ("deps", "outs")},
        }
    return stages


def ran_stages(output: str) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", output)


def pipeline_runs(repo: Path) -> list[tuple[Any, list[Any]]]:
    """(parent, children) for every pipeline execution, oldest first."""
    client = client_for(repo)
    experiment = client.get_experiment_by_name("lockstep")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    return [(p, [r for r in runs if r.data.tags.get("mlflow.parentRunId") == p.info.run_id]) for p in parents]


def check_stage_run(repo: Path, child: Any) -> None:
    stage = child.data.tags["lockstep.stage"]
    assert child.info.status == "FINISHED"
    assert LINEAGE_TAGS <= set(child.data.tags), stage
    if stage in NUMPY_STAGES:
        assert not TORCH_TAGS & set(child.data.tags), stage
        assert child.data.tags["determinism.torch"].startswith("not loaded"), stage
    else:
        assert TORCH_TAGS <= set(child.data.tags), stage
    assert len(child.data.tags["git.commit"]) == 40
    assert child.data.tags["data.md5"].endswith(".dir")
    assert child.data.params["seed"] == "42"
    artifacts = {a.path for a in client_for(repo).list_artifacts(child.info.run_id)}
    assert ARTIFACTS[stage] <= artifacts, (stage, artifacts)


def test_dvc_repro_runs_every_stage_and_tracks_them(dvc_repo: dict[str, Any]) -> None:
    repo = dvc_repo["repo"]
    assert ran_stages(dvc_repo["outputs"][0]) == ["download"]
    assert ran_stages(dvc_repo["outputs"][1]) == AFTER_DOWNLOAD
    # re-ingesting the same source leaves data.dvc byte-identical to the committed one
    assert (repo / "data.dvc").read_text() == dvc_repo["committed_data_dvc"]
    metrics = run(["dvc", "metrics", "show"], repo).stdout
    assert "artifacts/evaluate/metrics.json" in metrics and "accuracy" in metrics

    executions = pipeline_runs(repo)
    assert [sorted(c.data.tags["lockstep.stage"] for c in children) for _, children in executions] == [
        ["download"],
        sorted(AFTER_DOWNLOAD),
    ]
    for parent, children in executions:
        assert parent.data.tags["lockstep.entry_point"] == "dvc"
        assert parent.info.status == "FINISHED"
        for child in children:
            check_stage_run(repo, child)
    train_run = next(c for c in executions[1][1] if c.data.tags["lockstep.stage"] == "train")
    assert train_run.data.params["train.lr"] == "0.05" and train_run.data.params["train.epochs"] == str(EPOCHS)
    # only the params the stage reads: data.source (what `auto` resolves from), not the rest of `data`
    assert train_run.data.params["data.source"] == "digits" and "data.mirror" not in train_run.data.params
    history = client_for(repo).get_metric_history(train_run.info.run_id, "val_accuracy")
    assert [m.step for m in history] == list(range(1, EPOCHS + 1))
    for key in ("train_loss", "train_accuracy", "val_loss"):
        assert len(client_for(repo).get_metric_history(train_run.info.run_id, key)) == EPOCHS
    export_run = next(c for c in executions[1][1] if c.data.tags["lockstep.stage"] == "export")
    versions = client_for(repo).search_model_versions("name='lockstep-classifier'")
    assert [v.run_id for v in versions] == [export_run.info.run_id]  # the shipped ONNX, registered by export
    check_dashboard(repo, executions[1][0], "dvc: stats→export")
    assert executions[0][0].info.run_name.startswith("dvc: download · data ")
    # the version's description links its model card and the export, pipeline and train runs, each
    # opening in the UI's model-training pages
    description, experiment = versions[0].description, export_run.info.experiment_id
    for run_id in (export_run.info.run_id, executions[1][0].info.run_id, train_run.info.run_id):
        assert f"]({run_page(experiment, run_id)})" in description, description
    assert f"]({run_page(experiment, export_run.info.run_id, '/artifacts/model_card.md')})" in description
    assert "promoted to champion" in description and "test accuracy 0." in description
    # the machine's load while it trained (MLflow's system metrics; GPU ones where there is a GPU)
    system = client_for(repo).get_metric_history(train_run.info.run_id, "system/cpu_utilization_percentage")
    assert system and all(0 <= m.value <= 100 for m in system)
    assert "system/system_memory_usage_megabytes" in train_run.data.metrics
    assert [(d.dataset.name, d.dataset.digest) for d in train_run.inputs.dataset_inputs] == [
        ("digits", train_run.data.tags["data.md5"].removesuffix(".dir"))
    ]


def check_dashboard(repo: Path, parent: Any, doing: str) -> None:
    """A pipeline (parent) run as the MLflow UI's runs table shows it: named for what it did, with the
    headline numbers of the stages' outputs, the key params, the training data and its curves."""
    client = client_for(repo)
    md5 = parent.data.tags["data.md5"]
    assert parent.info.run_name == f"{doing} · data {md5[:8]}", parent.info.run_name
    gates = json.loads((repo / "artifacts/export/gates.json").read_text())
    evaluate = json.loads((repo / "artifacts/evaluate/metrics.json").read_text())
    shipped = json.loads((repo / "artifacts/compress/metrics.json").read_text())[gates["variant"]]
    assert parent.data.metrics["test_accuracy"] == evaluate["accuracy"]
    assert parent.data.metrics["shipped_test_accuracy"] == gates["accuracy"]
    assert parent.data.metrics["shipped_size_bytes"] == shipped["size_bytes"]
    assert parent.data.metrics["shipped_latency_b1_ms"] == shipped["latency_b1_ms"]
    assert parent.data.tags["export.shipped_variant"] == gates["variant"]
    assert parent.data.params["train.model"] == "small_cnn" and parent.data.params["train.epochs"] == str(EPOCHS)
    assert parent.data.params["export.candidates"] == '["static_int8", "fp32"]'
    assert [(d.dataset.name, d.dataset.digest) for d in parent.inputs.dataset_inputs] == [
        ("digits", md5.removesuffix(".dir"))
    ]
    curve = client.get_metric_history(parent.info.run_id, "val_accuracy")
    history = json.loads((repo / "artifacts/train/history.json").read_text())
    assert sorted((m.step, m.value) for m in curve) == [(row["epoch"], row["val_accuracy"]) for row in history]
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    view = json.loads(experiment.tags["mlflow.sharedViewState.lockstep"])  # the runs table's columns
    assert "metrics.`test_accuracy`" in view["selectedColumns"]


def test_second_repro_does_nothing_and_a_changed_param_reruns_what_reads_it(
    dvc_repo: dict[str, Any], tmp_path: Path
) -> None:
    repo = clone_project(dvc_repo["repo"], tmp_path / "repo")  # changed here: the session's copy stays as built
    before = len(pipeline_runs(repo))
    noop = run(["dvc", "repro"], repo)
    assert ran_stages(noop.stdout) == [] and "Data and pipelines are up to date" in noop.stdout
    assert len(pipeline_runs(repo)) == before  # nothing ran, nothing logged

    # a param only the last stage reads re-runs that stage alone, here as an experiment (`dvc exp run -S`
    # writes params.yaml, then reproduces; a params.yaml edited by hand and `dvc repro`:
    # tests/flows/test_dvc_data.py; a train param re-runs train and all after it: tests/flows/test_service.py,
    # through the flow; every stage's params: tests/flows/test_dvc_yaml.py)
    experiment = run(["dvc", "exp", "run", "-S", "export.min_top1_agreement=0.93"], repo)
    assert ran_stages(experiment.stdout) == ["export"]
    shown = run(["dvc", "exp", "show", "--no-pager", "--csv"], repo).stdout
    assert "0.93" in shown and "accuracy" in shown


# `python -m flows.pipeline` under CPython's audit hooks: the modules it imported and the programs it
# started, printed as JSON on its last line of stderr once it ends.
AUDITED = """
import atexit, json, runpy, sys
started = []
sys.addaudithook(lambda event, args: started.append(str(args[1][0])) if event == "subprocess.Popen" else None)
atexit.register(lambda: print("AUDIT " + json.dumps({"modules": sorted(sys.modules), "started": started}),
                              file=sys.stderr))
sys.argv = ["flows.pipeline", *sys.argv[1:]]
runpy.run_module("flows.pipeline", run_name="__main__", alter_sys=True)
"""
# What a run with nothing stale must not pay for (it did, 16-23 s on 2 cores; B3-flow in benchmarks/):
# Prefect (its import, and the server it would start), the stages' torch, ONNX and torchvision.
NOT_IMPORTED_WHEN_NOTHING_IS_STALE = {"prefect", "torch", "torchvision", "onnx", "onnxruntime", "onnxscript"}


# The same against a team's Prefect server (PREFECT_API_URL): the flow runs, recorded there with its
# seven tasks up to date, but still without the stages' code, or MLflow's client (the run is recorded
# through its SQLite file: tasks/tracking/sqlite_record.py).
NOT_IMPORTED_BY_A_FLOW_RUN_WITH_NOTHING_STALE = {"torch", "torchvision", "onnx", "onnxruntime", "onnxscript", "mlflow"}


def audited_noop_run(
    repo: Path, not_imported: set[str] = NOT_IMPORTED_WHEN_NOTHING_IS_STALE, *args: str, **env: str
) -> dict[str, Any]:
    """A `make run ARGS="<args>"` that finds nothing stale: what it printed, imported and started, checked here."""
    done = run(["python", "-c", AUDITED, *args], repo, **env)
    audit = json.loads(done.stderr.split("AUDIT ")[-1])
    imported = {name.split(".")[0] for name in audit["modules"]}
    assert not not_imported & imported, sorted(not_imported & imported)
    # git alone, for the run's lineage tags (commit, dirty): no Prefect server, no stage process
    assert {Path(program).name for program in audit["started"]} <= {"git"}, audit["started"]
    return {"stdout": done.stdout, **audit}


def _flow_runs(repo: Path) -> list[Any]:
    database = repo / ".prefect/prefect.db"
    with closing(sqlite3.connect(database)) as db:
        return db.execute("select id from flow_run").fetchall()


def check_console(output: str) -> None:
    """What a person reads after `python -m flows.pipeline`: each event once, no warning that is not
    theirs to act on, and one closing summary."""
    for message in ("Updating lock file", "To track the changes with git", "Generating lock file"):
        assert output.count(message) <= 1, (message, output)
    for noise in ("FutureWarning", "DeprecationWarning", "WARNING mlflow", "INFO mlflow"):
        assert noise not in output, (noise, output)
    summary = output[output.index("done in ") :]
    assert re.search(r"test accuracy 0\.\d{4} \(fp32", summary), summary
    assert re.search(r"shipped (static_int8|fp32): test accuracy 0\.\d{4}, \d+ KiB, [\d.]+ ms per image", summary)
    assert "registry: lockstep-classifier v1 promoted to champion" in summary
    assert "?viewStateShareKey=lockstep&workflowType=machine_learning" in summary, summary


def _without_mirror(lock: dict[str, Any]) -> dict[str, Any]:
    """dvc.lock without `data.mirror` among the download stage's params (the first runs' project sets one)."""
    lock = copy.deepcopy(lock)
    lock["stages"]["download"]["params"]["params.yaml"]["data"].pop("mirror", None)
    return lock


def test_a_flow_run_with_nothing_stale_on_a_team_server_loads_no_stage_code(
    first_make_runs: TwoRuns, prefect_server: PrefectServer, tmp_path: Path
) -> None:
    """`make run` with PREFECT_API_URL set (a team's server: no shortcut past Prefect, flows/noop.py)
    in a clone where nothing is stale: one flow run on that server, every task up to date, and none of
    the stages' code or MLflow's client loaded (a worker's flow run is this run without the command)."""
    repo = clone_project(first_make_runs.repo, tmp_path / "repo")
    database = prefect_server.home / "prefect.db"
    with closing(sqlite3.connect(database)) as db:
        before = db.execute("select count(*) from flow_run").fetchone()[0]
    audit = audited_noop_run(repo, NOT_IMPORTED_BY_A_FLOW_RUN_WITH_NOTHING_STALE, **prefect_server.env)
    assert "stages run: none (everything up to date)" in audit["stdout"], audit["stdout"]
    with closing(sqlite3.connect(database)) as db:
        runs = db.execute("select state_type from flow_run order by created").fetchall()
    assert len(runs) == before + 1 and runs[-1] == ("COMPLETED",), runs

    # The scheduled re-read (a deployment's reingest: true) of a source that has not changed: the same, with
    # the source read again and data/ left as it was, recorded as a run in which no stage ran.
    data = {path: path.stat().st_mtime_ns for path in (repo / "data").rglob("*")}
    audit = audited_noop_run(repo, NOT_IMPORTED_BY_A_FLOW_RUN_WITH_NOTHING_STALE, "--reingest", **prefect_server.env)
    assert "stages run: none; source re-read, data unchanged" in audit["stdout"], audit["stdout"]
    assert {path: path.stat().st_mtime_ns for path in (repo / "data").rglob("*")} == data
    assert not list((repo / ".cache" / "downloads").rglob(".reread*"))  # its staging folder is gone
    parent, children = pipeline_runs(repo)[-1]
    assert children == [] and parent.data.tags["lockstep.retrained"] == "false", children
    assert parent.data.tags["lockstep.summary"].startswith("stages run: none; source re-read, data unchanged")
    assert "Data and pipelines are up to date" in run(["dvc", "status"], repo).stdout


def test_prefect_flow_shares_dvc_cache_and_gives_the_same_weights(
    dvc_repo: dict[str, Any], first_make_runs: TwoRuns, tmp_path: Path
) -> None:
    """A fresh copy's first `make run` (the flow; started twice at once, tests/support/first_run.py: one
    of the two ran every stage) leaves what `dvc repro` leaves in another copy, and each respects the other's work."""
    source, first = first_make_runs.repo, first_make_runs.ran_all()
    # recorded in the project's Prefect database by the server the command started for itself
    with closing(sqlite3.connect(source / ".prefect/prefect.db")) as db:
        assert db.execute("select state_type from flow_run").fetchall() == [("COMPLETED",)] * 2
        tasks = db.execute("select flow_run_id, name from task_run where state_type = 'COMPLETED'").fetchall()
        logged = db.execute("select message from log").fetchall()
    by_run: dict[str, list[str]] = {}
    for flow_run, name in tasks:
        by_run.setdefault(flow_run, []).append(name)
    assert sorted(sorted(names) for names in by_run.values()) == [sorted(STAGES)] * 2  # a task per stage, each run
    assert any("train: best_val_accuracy 0." in message for (message,) in logged), logged[-5:]
    check_console(first)
    # the same dvc.lock entries and the same weights and models as `dvc repro` in the other copy
    lock = yaml.safe_load((source / "dvc.lock").read_text())
    assert comparable(_without_mirror(lock)) == comparable(_without_mirror(dvc_repo["lock"]))
    assert sha256(source / "artifacts/train/last.safetensors") == dvc_repo["weights"]
    # what the flow reproduced, DVC considers done ...
    repo = clone_project(source, tmp_path / "repo")
    status = run(["dvc", "status"], repo).stdout
    assert "Data and pipelines are up to date" in status, status
    assert ran_stages(run(["dvc", "repro"], repo).stdout) == []
    # ... and what DVC reproduced, the flow does not redo
    run(["dvc", "repro", "--force", "evaluate", "--single-item"], repo)
    flow_runs_before = _flow_runs(repo)
    again = audited_noop_run(repo)
    assert "stages run: none (everything up to date)" in again["stdout"], again["stdout"]
    assert _flow_runs(repo) == flow_runs_before  # decided before Prefect (flows/noop.py)

    executions = pipeline_runs(repo)
    entries = [(p.data.tags["lockstep.entry_point"], len(c)) for p, c in executions]
    assert sorted(entries[:2]) == [("prefect", 0), ("prefect", len(STAGES))], entries  # the two first runs
    assert entries[2:] == [("dvc", 1), ("prefect", 0)], entries
    flow_parent, children = next((p, c) for p, c in executions if len(c) == len(STAGES))
    assert flow_parent.info.status == "FINISHED"
    check_dashboard(repo, flow_parent, "prefect: all stages")
    assert flow_parent.data.tags["registry.version"] == "1"
    noop_run = executions[3][0]
    assert noop_run.info.run_name.startswith("prefect: nothing stale · data ")
    assert noop_run.info.status == "FINISHED" and noop_run.data.tags["lockstep.retrained"] == "false"
    assert noop_run.data.tags["lockstep.summary"] == "stages run: none (everything up to date): nothing retrained"
    assert noop_run.data.tags["lockstep.flow_run"].startswith("none: nothing was stale")
    # the same dashboard row as the flow run that trained (less its registry decision): lineage, owner,
    # key params, headline numbers and curves, dataset
    assert set(noop_run.data.tags) == set(flow_parent.data.tags) - {"registry.version", "registry.decision"}
    assert len(flow_parent.data.tags["lockstep.flow_run"]) == 36  # the Prefect flow run's id
    assert noop_run.data.params == flow_parent.data.params
    assert set(noop_run.data.metrics) == set(flow_parent.data.metrics)
    assert [d.dataset.digest for d in noop_run.inputs.dataset_inputs] == [
        d.dataset.digest for d in flow_parent.inputs.dataset_inputs
    ]
    assert sorted(c.data.tags["lockstep.stage"] for c in children) == sorted(STAGES)
    for child in children:
        check_stage_run(repo, child)

    # `make run ARGS=--reingest` on a source that has not changed: read again, compared with data/, and
    # recorded as a run in which no stage ran, still before Prefect (its no-op path, flows/noop.py)
    reread = audited_noop_run(repo, NOT_IMPORTED_WHEN_NOTHING_IS_STALE, "--reingest")
    assert "s; stages run: none; source re-read, data unchanged" in reread["stdout"], reread["stdout"]
    assert _flow_runs(repo) == flow_runs_before
    parent, reread_children = pipeline_runs(repo)[-1]
    assert reread_children == [] and parent.data.tags["lockstep.flow_run"].startswith("none: nothing was stale")
    assert parent.data.tags["lockstep.summary"].startswith("stages run: none; source re-read, data unchanged (md5 ")
