"""Export's registration through the flow's helper process (tasks/tracking/registrar.py) records what the
export stage records when it registers in its own process, without MLflow loaded in the flow's process;
and a helper that dies is a one-line failure of the stage, with nothing registered."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import client_for, clone_project, run
from tests.tracking.test_sqlite_record import VOLATILE, _artifacts, _as_read

pytestmark = pytest.mark.slow

# The export stage in the project's own process, as the flow runs it: with a helper ("helped"), without
# ("here"), or with a helper that is killed before export asks it ("killed"). Last line: the verdict (or
# the error), whether MLflow was loaded in this process, and this process's children left at the end.
EXPORT = """
import contextlib, json, os, sys
from tasks.core.layout import ROOT
from tasks.determinism.bootstrap import bootstrap

os.chdir(ROOT)
params = bootstrap(ROOT / "params.yaml")
import psutil
from tasks.runner import run_stage
from tasks.tracking import registrar

mode = sys.argv[1]
with registrar.helping(params.tracking) if mode != "here" else contextlib.nullcontext():
    assert registrar.helped() == (mode != "here")
    if mode == "killed":
        registrar._helper._process.kill()
    try:
        outcome = run_stage("export", params)["promotion"]
    except registrar.RegistrationFailed as exc:
        outcome = f"failed: {exc}"
print(json.dumps([outcome, "mlflow" in sys.modules, len(psutil.Process().children(recursive=True))]))
"""
# What differs between two registrations of the same model one after the other: the version numbers
REGISTRY_VOLATILE = {"registry.version", "registry.champion_version_before", "registry.verdict"}


def _export(repo: Path, mode: str) -> tuple[str, bool, int]:
    done = run(["python", "-c", EXPORT, mode], repo)
    outcome, loaded, children = json.loads(done.stdout.strip().splitlines()[-1])
    return outcome, loaded, children


def _newest_export(client: Any) -> Any:
    experiment = client.get_experiment_by_name("lockstep").experiment_id
    return client.search_runs([experiment], filter_string="tags.`lockstep.stage` = 'export'", max_results=1)[0]


def _read(client: Any, run_id: str) -> dict[str, Any]:
    seen = _as_read(client, run_id)
    seen["tags"] = {k: "<v>" if k in VOLATILE | REGISTRY_VOLATILE else v for k, v in seen["tags"].items()}
    seen["artifacts"] = sorted(_artifacts(client, run_id))
    seen["models"] = sorted(
        client.get_logged_model(o.model_id).name for o in client.get_run(run_id).outputs.model_outputs
    )
    return seen


def test_a_helper_registers_what_export_registers_itself_without_mlflow_in_the_flow(
    dvc_repo: dict[str, Any], tmp_path: Path
) -> None:
    repo = clone_project(dvc_repo["repo"], tmp_path / "repo")  # its champion: the trained project's v1
    client = client_for(repo)
    verdicts, runs = {}, {}
    for mode in ("here", "helped"):
        verdicts[mode], loaded, children = _export(repo, mode)
        assert loaded == (mode == "here"), f"{mode}: MLflow loaded in the flow's process: {loaded}"
        assert children == 0, f"{mode}: {children} processes left"
        runs[mode] = _newest_export(client).info.run_id
    assert verdicts["here"].startswith("lockstep-classifier v2 promoted to champion"), verdicts
    assert verdicts["helped"].startswith("lockstep-classifier v3 promoted to champion"), verdicts
    helped, reference = _read(client, runs["helped"]), _read(client, runs["here"])
    assert helped == reference
    assert helped["info"][1] == "FINISHED" and helped["models"] == ["model", "model_fp32"]
    assert {"registry.paired_challenger_accuracy", "registry.mcnemar_p"} <= set(helped["metrics"])
    champion = client.get_model_version_by_alias("lockstep-classifier", "champion")
    assert (str(champion.version), champion.run_id) == ("3", runs["helped"])
    assert champion.description.startswith(f"**{helped['tags']['export.shipped_variant']}** (ONNX)")


def test_a_helper_that_died_fails_the_stage_in_one_line_and_registers_nothing(
    dvc_repo: dict[str, Any], tmp_path: Path
) -> None:
    repo = clone_project(dvc_repo["repo"], tmp_path / "repo")
    client = client_for(repo)
    versions = len(client.search_model_versions("name = 'lockstep-classifier'"))
    outcome, _loaded, children = _export(repo, "killed")
    assert outcome == (
        "failed: the model registration's helper process (tasks.tracking.registrar) exited with code -9 "
        "without an answer (its output is above)"
    )
    assert children == 0
    assert _newest_export(client).info.status == "FAILED"
    assert len(client.search_model_versions("name = 'lockstep-classifier'")) == versions
