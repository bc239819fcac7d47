"""`make run` twice at the same moment in one project, by a user with secrets in the environment, in a
git remote URL and in a param: one run waits for the other, and no secret reaches MLflow.

The second run waits for the project's pipeline lock (tasks/core/lock.py), then finds everything
up to date. Refusal after `orchestration.lock_wait_s`, and `dvc repro` against a running flow, are in
tests/core/test_lock.py; two overlapping deployment runs on a worker in tests/flows/test_service.py.
Secrets: values of environment variables named like token/password/secret/key, credentials in a
param's URL and in the git remote's URL; everything MLflow holds is searched for them: params, tags,
every artifact file, the raw bytes of the store. The two runs are made once per test run
(tests/support/first_run.py), and serve tests/flows/test_e2e.py too.
"""

from __future__ import annotations

import urllib.parse
from pathlib import Path

import pytest

from tests.conftest import client_for, run
from tests.support.first_run import ALL_STAGES, TwoRuns

pytestmark = pytest.mark.slow


def test_one_run_waits_for_the_other_and_the_project_stays_consistent(first_make_runs: TwoRuns) -> None:
    repo, runs = first_make_runs.repo, first_make_runs.runs
    for done in runs:
        assert done.returncode == 0, done.stdout[-5000:]
    outputs = [done.stdout for done in runs]
    ran_all = [out for out in outputs if ALL_STAGES in out]
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


def test_no_secret_reaches_mlflow(first_make_runs: TwoRuns) -> None:
    repo, secrets = first_make_runs.repo, first_make_runs.secrets
    client = client_for(repo)
    runs = client.search_runs([client.get_experiment_by_name("lockstep").experiment_id])
    assert len(runs) >= 9  # two pipeline runs, seven stage runs
    for r in runs:
        for where, values in (("params", r.data.params), ("tags", r.data.tags)):
            leaked = {k: v for k, v in values.items() if any(secret in v for secret in secrets.values())}
            assert not leaked, (r.info.run_name, where, leaked)
    # masked, not dropped: the param and the git remote are there, credentials replaced
    download = next(r for r in runs if r.data.tags.get("lockstep.stage") == "download")
    assert download.data.params["data.mirror"] == "https://mirror.invalid/token/***/datasets"
    train = next(r for r in runs if r.data.tags.get("lockstep.stage") == "train")
    assert train.data.tags["mlflow.source.git.repoURL"] in (
        "https://***@git.invalid/team/repo.git",
        "https://git.invalid/team/repo.git",
    )  # MLflow strips it too
    # every artifact file (the resolved params.yaml and dvc.lock carry data.mirror), and the store's bytes
    store = Path(urllib.parse.urlparse(client.get_experiment_by_name("lockstep").artifact_location).path)
    assert store == repo / "mlartifacts"
    files = [path for path in store.rglob("*") if path.is_file()]
    assert any(path.name == "params.yaml" and "https://mirror.invalid/token/***/" in path.read_text() for path in files)
    for path in [*files, repo / "mlflow.db"]:
        data = path.read_bytes()
        assert not [where for where, secret in secrets.items() if secret.encode() in data], path
    # nor any output, nor Prefect's database (its logs and flow-run records), nor the console
    prefect_db = list((repo / ".prefect").rglob("*.db"))
    assert prefect_db, "make run's Prefect database is not in the project's .prefect/"
    for path in [*(repo / "artifacts").rglob("*"), *prefect_db]:
        if path.is_file():
            data = path.read_bytes()
            assert not [where for where, secret in secrets.items() if secret.encode() in data], path
    card = (repo / "artifacts" / "export" / "model_card.md").read_text()
    assert '"mirror": "https://mirror.invalid/token/***/datasets"' in card
    for text in [card, *(done.stdout for done in first_make_runs.runs)]:
        assert not [where for where, secret in secrets.items() if secret in text]
