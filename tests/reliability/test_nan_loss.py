"""A NaN or infinite loss: training stops with a clear error naming epoch and step; nothing is
registered or promoted; the previous model stays the champion."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import client_for, clone_project, run, sha256, write_params
from tests.reliability.conftest import Trained, clone, stage
from tests.support.cli_errors import one_line_error

pytestmark = pytest.mark.slow
DIVERGING = "1.0e+10"  # train.lr: the loss is NaN within a few steps


def test_a_diverging_run_of_the_pipeline_stops_and_registers_nothing(dvc_repo: dict[str, Any], tmp_path: Path) -> None:
    repo = clone_project(dvc_repo["repo"], tmp_path / "repo")  # a finished pipeline: version 1 is the champion
    client = client_for(repo)
    champion = client.get_model_version_by_alias("lockstep-classifier", "champion")
    before = {"best": sha256(repo / "artifacts/train/best.safetensors"), "lock": (repo / "dvc.lock").read_text()}
    params = (repo / "params.yaml").read_text()
    try:
        done = run([sys.executable, "-m", "flows.pipeline", "--set", f"train.lr={DIVERGING}"], repo, check=False)
    finally:
        (repo / "params.yaml").write_text(params)
    error = one_line_error(done, launcher_log=True)
    assert "error: training diverged: the loss is not finite (nan) at epoch 1, step" in error, error
    # nothing registered or promoted; the outputs and dvc.lock as they were
    versions = client.search_model_versions("name = 'lockstep-classifier'")
    assert [v.version for v in versions] == [champion.version]
    assert client.get_model_version_by_alias("lockstep-classifier", "champion").version == champion.version
    assert sha256(repo / "artifacts/train/best.safetensors") == before["best"]
    assert (repo / "dvc.lock").read_text() == before["lock"]
    # the failed stage is visible in MLflow as failed, with the lr that diverged
    experiment = client.get_experiment_by_name("lockstep").experiment_id
    runs = client.search_runs([experiment], "tags.`lockstep.stage` = 'train'", order_by=["start_time DESC"])
    assert runs[0].info.status == "FAILED" and float(runs[0].data.params["train.lr"]) == float(DIVERGING)
    assert sorted(r.info.status for r in runs) == ["FAILED", "FINISHED"]


def test_ddp_ranks_stop_together_on_a_nan_loss(trained: Trained, tmp_path: Path) -> None:
    repo = clone(trained, tmp_path / "repo")
    write_params(
        repo / "params.yaml",
        {"train": {"lr": float(DIVERGING), "strategy": "ddp", "nproc_per_node": 2}},
        base=repo / "params.yaml",
    )
    # every rank raises at the same step (a collective check): none waits forever for the others
    error = one_line_error(stage(repo, "train"), launcher_log=True)
    assert "error: train: training diverged: the loss is not finite" in error and "at epoch 1, step" in error, error
    assert yaml.safe_load((repo / "params.yaml").read_text())["train"]["strategy"] == "ddp"
