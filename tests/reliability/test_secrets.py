"""Secrets never reach MLflow: values of environment variables named like token/password/secret/key,
credentials in a param's URL and in the git remote's URL.

The project of `two_make_runs` (tests/reliability/conftest.py) ran the whole pipeline twice with
them; everything MLflow holds is searched for them: params, tags, every artifact file, the raw bytes
of the store.
"""

from __future__ import annotations

import urllib.parse
from pathlib import Path

import pytest

from tests.conftest import client_for
from tests.reliability.conftest import TwoRuns

pytestmark = pytest.mark.slow


def test_no_secret_reaches_mlflow(two_make_runs: TwoRuns) -> None:
    repo, secrets = two_make_runs.repo, two_make_runs.secrets
    client = client_for(repo)
    runs = client.search_runs([client.get_experiment_by_name("lockstep").experiment_id])
    assert len(runs) >= 9  # two pipeline runs, seven stage runs
    for r in runs:
        for where, values in (("params", r.data.params), ("tags", r.data.tags)):
            leaked = {k: v for k, v in values.items() if any(secret in v for secret in secrets.values())}
            assert not leaked, (r.info.run_name, where, leaked)
    # masked, not dropped: the param and the git remote are there, credentials replaced
    download = next(r for r in runs if r.data.tags.get("lockstep.stage") == "download")
    assert download.data.params["data.mirror"] == "https://***@mirror.invalid/datasets"
    train = next(r for r in runs if r.data.tags.get("lockstep.stage") == "train")
    assert train.data.tags["mlflow.source.git.repoURL"] in (
        "https://***@git.invalid/team/repo.git",
        "https://git.invalid/team/repo.git",
    )  # MLflow strips it too
    # every artifact file (the resolved params.yaml and dvc.lock carry data.mirror), and the store's bytes
    store = Path(urllib.parse.urlparse(client.get_experiment_by_name("lockstep").artifact_location).path)
    assert store == repo / "mlartifacts"
    files = [path for path in store.rglob("*") if path.is_file()]
    assert any(path.name == "params.yaml" and "https://***@mirror.invalid" in path.read_text() for path in files)
    for path in [*files, repo / "mlflow.db"]:
        data = path.read_bytes()
        assert not [where for where, secret in secrets.items() if secret.encode() in data], path
