"""Two pipeline runs started at once: `make run` twice, at the same moment, in one project.

The second waits for the project's pipeline lock (tasks/pipeline_lock.py), then finds everything up
to date. Refusal after `orchestration.lock_wait_s`, and `dvc repro` against a running flow, are in
tests/test_pipeline_lock.py; two overlapping deployment runs on a worker in tests/test_service.py.
"""

from __future__ import annotations

import pytest

from tests.conftest import client_for, run
from tests.reliability.conftest import TwoRuns

pytestmark = pytest.mark.slow


def test_one_run_waits_for_the_other_and_the_project_stays_consistent(two_make_runs: TwoRuns) -> None:
    repo, runs = two_make_runs.repo, two_make_runs.runs
    for done in runs:
        assert done.returncode == 0, done.stdout[-5000:]
    outputs = [done.stdout for done in runs]
    ran_all = [
        out for out in outputs if "stages run: download, stats, preprocess, train, evaluate, compress, export" in out
    ]
    waited = [out for out in outputs if "stages run: none (everything up to date)" in out]
    assert len(ran_all) == 1 and len(waited) == 1, outputs
    assert "waiting up to 3600 s for the pipeline run in progress: Prefect flow run" in waited[0]
    # DVC: data.dvc, dvc.lock and every output agree
    assert "Data and pipelines are up to date" in run(["dvc", "status"], repo).stdout
    # MLflow: two finished pipeline runs, the stages once, one model version; nothing left running
    client = client_for(repo)
    runs_logged = client.search_runs([client.get_experiment_by_name("lockstep").experiment_id])
    parents = [r for r in runs_logged if "lockstep.stage" not in r.data.tags]
    stages = [r for r in runs_logged if "lockstep.stage" in r.data.tags]
    assert [r.info.status for r in parents] == ["FINISHED", "FINISHED"]
    assert sorted(r.data.tags["lockstep.stage"] for r in stages) == sorted(
        ["download", "stats", "preprocess", "train", "evaluate", "compress", "export"]
    )
    assert {r.info.status for r in stages} == {"FINISHED"}
    assert {r.data.tags["mlflow.parentRunId"] for r in stages} < {r.info.run_id for r in parents}
    assert len(client.search_model_versions("name = 'lockstep-classifier'")) == 1
