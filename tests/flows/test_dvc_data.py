"""Data versioning with DVC: re-ingesting updates data.dvc, and a fresh clone with `dvc pull` from
a remote (a local directory here; S3 and others work the same, see the README) reproduces the
same weights."""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.fakedata.imagefolder import imagefolder_tree
from tasks.data.formats import read_raw
from tests.conftest import clone_project, run, write_params

pytestmark = pytest.mark.slow

GIT = ["git", "-c", "user.name=lockstep-tests", "-c", "user.email=tests@lockstep.invalid"]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _data_md5(repo: Path) -> str:
    return yaml.safe_load((repo / "data.dvc").read_text())["outs"][0]["md5"]


def _ran(output: str) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", output)


def test_push_pull_round_trip_reproduces_weights_and_reingest_updates_data_dvc(
    dvc_repo: dict[str, Any], tmp_path: Path
) -> None:
    repo = clone_project(dvc_repo["repo"], tmp_path / "origin")  # the session's trained project
    write_params(repo / "params.yaml", {"tracking": {"enabled": False}}, base=repo / "params.yaml")  # tested elsewhere
    run(["dvc", "remote", "add", "-d", "storage", str(tmp_path / "remote")], repo)
    weights = _sha(repo / "artifacts/train/best.safetensors")
    run(["dvc", "push"], repo)
    run([*GIT, "add", "dvc.lock", "data.dvc", ".dvc/config", "params.yaml"], repo)
    run([*GIT, "commit", "-q", "-m", "pipeline run"], repo)

    # 1. a fresh clone restores everything from the remote: nothing left to run
    restored = tmp_path / "restored"
    run(["git", "clone", "-q", str(repo), str(restored)], tmp_path)
    run(["dvc", "pull", "--with-deps", "evaluate"], restored)
    assert _ran(run(["dvc", "repro", "evaluate"], restored).stdout) == []
    assert _sha(restored / "artifacts/train/best.safetensors") == weights

    # 2. a fresh clone that pulls only the data rebuilds every later stage, without downloading,
    #    and gets byte-identical weights
    rebuilt = tmp_path / "rebuilt"
    run(["git", "clone", "-q", str(repo), str(rebuilt)], tmp_path)
    run(["dvc", "pull", "data.dvc", "download"], rebuilt)
    assert _ran(run(["dvc", "repro", "evaluate"], rebuilt).stdout) == ["stats", "preprocess", "train", "evaluate"]
    assert _sha(rebuilt / "artifacts/train/best.safetensors") == weights

    # 3. new data: re-ingesting rewrites data.dvc and retrains on it
    before = _data_md5(repo)
    imagefolder_tree(tmp_path / "photos", classes=("a", "b", "c"), per_class=20, size=(8, 8), mode="L")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["data"].update(source="imagefolder", path=str(tmp_path / "photos"), channels=1)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = run(["dvc", "repro", "evaluate"], repo).stdout
    assert _ran(out) == ["download", "stats", "preprocess", "train", "evaluate"]
    assert _data_md5(repo) != before
    assert yaml.safe_load((repo / "data" / "meta.json").read_text())["classes"] == ["a", "b", "c"]
    run(["dvc", "push"], repo)  # the new version goes to the remote like the first
    assert "are in sync" in run(["dvc", "status", "--cloud", "--with-deps", "evaluate"], repo).stdout

    # 4. `make run ARGS=--reingest` (no Prefect server of the user's) on the folder: unchanged, it is read
    #    again and nothing runs, before Prefect starts; with one more image, the flow ingests and retrains,
    #    and does not read the folder a second time to decide so (flows/noop.py `source_unchanged`)
    run([sys.executable, "-m", "flows.pipeline"], repo)  # compress and export: nothing is stale after it
    same = run([sys.executable, "-m", "flows.pipeline", "--reingest"], repo).stdout
    assert "stages run: none; source re-read, data unchanged" in same and "Prefect" not in same, same
    before = _data_md5(repo)
    imagefolder_tree(tmp_path / "more", classes=("a",), per_class=1, size=(8, 8), mode="L", seed=1)
    (tmp_path / "more/a/a_0.png").rename(tmp_path / "photos/a/new.png")
    grown = run([sys.executable, "-m", "flows.pipeline", "--reingest"], repo)
    output = grown.stdout + grown.stderr
    assert "stages run: download, stats, preprocess, train, evaluate, compress, export" in grown.stdout, output
    assert "download: source re-read before the flow started, data changed: ingesting it" in output, output
    assert _data_md5(repo) != before and read_raw(repo / "data").labels.shape == (61,)
