"""`python -m tasks.tools.reproduce` against a planted record that names pretrained weights (issue 66, point 1):
reproduce downloads nothing a record names, reads no local file a record names, and sends no credential to a
host a record names. The rebuild's weights come only from a copy in the user's own download cache, verified
by its full sha256 and copied into the workspace's cache before the stages run; else the run is refused.

The attacker's host is a real HTTP server on loopback that records every request and its Authorization
header; the user has a token in the environment and a netrc entry for that host. Two tests run the real
stages (stats, preprocess, train on digits, the current tasks/ code) in the workspace; the others stop
after the workspace is prepared (tests/tools/test_reproduce_security.py's `cli`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save

from benchmarks.httpserver import FileServer
from tasks.core import layout
from tasks.core.config.data import DataConfig
from tasks.core.credentials import AUTH_ENV, TOKEN_ENV
from tasks.data.download import download
from tasks.tools.reproduce import ReproduceError, reproduce
from tasks.tools.reproduce import rebuild as reproduce_rebuild
from tasks.tools.reproduce import workspace as reproduce_workspace
from tasks.train.models import build_model
from tests.conftest import ROOT
from tests.support.published_weights import publish
from tests.tools.test_reproduce_security import STOPPED, _refused, cli, plant, project, store  # noqa: F401

SECRET = "s3cr3t-Bearer-66"
NETRC_SECRET = "n3trc-Passw0rd-66"
FAST_TRAIN = {"epochs": 1, "max_batches": 2, "num_workers": 0, "batch_size": 32}
TINY = {"train": {"model": "small_cnn", **FAST_TRAIN}, "determinism": {"num_threads": 1}}


@pytest.fixture
def attacker() -> Iterator[FileServer]:
    with FileServer() as server:
        yield server


@pytest.fixture
def credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, attacker: FileServer) -> None:
    """The user's credentials, as a user has them: a token in the environment and a netrc with an entry
    for the attacker's host (which happens to be one the user also downloads from) and a default."""
    netrc = tmp_path / "netrc"
    netrc.write_text(
        f"machine 127.0.0.1 login alice password {NETRC_SECRET}\ndefault login alice password {NETRC_SECRET}\n"
    )
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    monkeypatch.setenv(TOKEN_ENV, SECRET)
    monkeypatch.delenv(AUTH_ENV, raising=False)
    monkeypatch.delenv("LOCKSTEP_DOWNLOAD_CACHE", raising=False)


def _small_cnn_weights() -> bytes:
    """Weights that fit small_cnn on digits (8x8, one channel, ten classes), as safetensors."""
    torch.manual_seed(7)
    model = build_model("small_cnn", 10, [0.5], [0.25], [8, 8])
    return save({k: v.contiguous() for k, v in model.state_dict().items()})


@pytest.fixture
def rebuild(
    store: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    credentials: None,
) -> Iterator[Path]:
    """A project holding the current tasks/ (the planted commit is not in it: --use-current-code) and the
    user's download cache; the run's data comes as DVC would check it out (digits, built here)."""
    root = tmp_path / "project"
    shutil.copytree(ROOT / "tasks", root / "tasks", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store["uri"])
    monkeypatch.setattr(layout, "project_root", lambda: root)

    def data(_project: Path, workspace: Path, run_id: str, data_md5: str) -> str:
        download(DataConfig(source="digits"), workspace / layout.DATA_DIR, tmp_path / "digits-cache")
        return "the test's digits"

    monkeypatch.setattr(reproduce_workspace, "bring_data", data)
    yield root


def _rebuilt(store: dict[str, Any], run_id: str, project: Path, work: Path) -> Any:  # noqa: F811
    return reproduce(run_id, work, tracking_uri=store["uri"], project=project, log_run=False, use_current_code=True)


def test_a_record_copying_a_real_digest_with_a_foreign_url_is_rebuilt_from_the_users_copy_alone(
    store: dict[str, Any],  # noqa: F811
    rebuild: Path,
    attacker: FileServer,
    tmp_path: Path,
) -> None:
    """The issue's variant: the guard found the file in the project's cache, the rebuild downloaded into the
    workspace's own cache, from the record's URL, with the user's token. Now the verified copy is placed in
    the workspace's cache and the record's hosts (its pretrained_url and its data.mirror) hear nothing."""
    weights = _small_cnn_weights()
    digest = hashlib.sha256(weights).hexdigest()
    cached = rebuild / ".cache" / "downloads" / "weights" / digest
    cached.parent.mkdir(parents=True)
    cached.write_bytes(weights)
    url = attacker.add("/w.safetensors", weights)  # the same bytes: a fetch would succeed, silently
    params = {
        **TINY,
        "data": {"source": "digits", "mirror": attacker.url_for("/data")},
        "train": {**TINY["train"], "pretrained_url": url, "pretrained_sha256": digest},
    }
    run_id = plant(store, "f" * 40, params)
    report = _rebuilt(store, run_id, rebuild, tmp_path / "work")
    assert attacker.requests == [] and attacker.authorizations("/w.safetensors") == []
    assert report.failed_stage is None, report.failure_tail
    lineage = json.loads((tmp_path / "work" / "workspace" / layout.TRAIN_DIR / "train.json").read_text())
    assert lineage["pretrained"]["pretrained.sha256"] == digest  # the user's copy was loaded
    assert cached.read_bytes() == weights  # and left as it was


def test_a_record_naming_torchvision_weights_through_its_mirror_is_refused_and_its_host_hears_nothing(
    store: dict[str, Any],  # noqa: F811
    rebuild: Path,
    attacker: FileServer,
    tmp_path: Path,
) -> None:
    """The issue's attack: `train.pretrained` with `train.pretrained_mirror` at the attacker's host; the rebuilt
    train stage fetched <mirror>/resnet18-f37072fd.pth with `Authorization: Bearer $LOCKSTEP_DATA_TOKEN`."""
    attacker.add("/models/resnet18-f37072fd.pth", b"forged")
    digest = "f37072fd" + "0" * 56  # what a planted record claims
    train = {**TINY["train"], "model": "resnet18", "pretrained": "IMAGENET1K_V1"}
    train |= {"pretrained_mirror": attacker.url_for("/models"), "pretrained_sha256": digest}
    run_id = plant(store, "f" * 40, {**TINY, "train": train})
    refused: ReproduceError | None = None
    try:
        _rebuilt(store, run_id, rebuild, tmp_path / "work")
    except ReproduceError as exc:
        refused = exc
    assert attacker.authorizations("/models/resnet18-f37072fd.pth") == [] and attacker.requests == []
    where = rebuild / ".cache" / "downloads" / "weights" / "resnet18-f37072fd.pth"
    assert str(refused) == (
        f"run {run_id}: its params load train.pretrained IMAGENET1K_V1 of resnet18 (sha256 {digest}): reproduce "
        f"downloads nothing a run names; put the file with that sha256 at {where} and run again"
    )
    assert not (tmp_path / "work" / "workspace").exists()  # refused before anything was checked out


@pytest.mark.parametrize("path", ["/dev/zero", "secret"])
def test_a_record_naming_a_local_weights_file_is_refused_unread(
    path: str,
    project: dict[str, Any],  # noqa: F811
    store: dict[str, Any],  # noqa: F811
    cli: Any,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`pretrained_path` in someone else's record: /dev/zero (memory), or a file of the user's whose sha256
    the mismatch line would have logged back to the shared server (a digest oracle)."""
    if path == "secret":
        (tmp_path / "secret").write_bytes(b"the user's private file")
        path = str(tmp_path / "secret")
    train = {"model": "small_cnn", "pretrained_path": path, "pretrained_sha256": "ab" * 32}
    run_id = plant(store, project["commits"]["branch"], {"train": train})
    error = _refused(*cli(run_id, "--workdir", str(tmp_path / "work"), capsys=capsys))
    assert error == (
        f"error: run {run_id}: its params read pretrained weights from the local file train.pretrained_path {path}: "
        "reproduce reads no file a run names; rebuild it by hand (python -m tasks train) with that file"
    )
    assert not (tmp_path / "work" / "workspace").exists()


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, str]:
    """mobilenet_v3_small weights published under a torchvision-style name (tests/support/published_weights.py)."""
    return publish(monkeypatch, "https://download.invalid/models")


def test_weights_by_name_come_from_the_users_verified_copy_into_the_workspace_cache(
    published: tuple[bytes, str],
    project: dict[str, Any],  # noqa: F811
    store: dict[str, Any],  # noqa: F811
    cli: Any,  # noqa: F811
    attacker: FileServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data, name = published
    digest = hashlib.sha256(data).hexdigest()
    user_cache = project["repo"] / ".cache" / "downloads" / "weights"
    user_cache.mkdir(parents=True, exist_ok=True)
    (user_cache / name).write_bytes(data)
    train = {"model": "mobilenet_v3_small", "pretrained": "IMAGENET1K_V1", "pretrained_mirror": attacker.url}
    try:
        run_id = plant(store, project["commits"]["branch"], {"train": {**train, "pretrained_sha256": digest}})
        assert _refused(*cli(run_id, "--workdir", str(tmp_path / "work"), capsys=capsys)).endswith(STOPPED)
        placed = tmp_path / "work" / "workspace" / ".cache" / "downloads" / "weights" / name
        assert placed.read_bytes() == data

        # the user's file is not the one the record pins: refused, and its digest is not shown (no oracle)
        (user_cache / name).write_bytes(data + b"changed")
        error = _refused(*cli(run_id, "--workdir", str(tmp_path / "other"), capsys=capsys))
        assert "put the file with that sha256 at" in error
        assert hashlib.sha256(data + b"changed").hexdigest() not in error

        # a pin that contradicts the name's published prefix cannot be the published file
        other = "0" * 64
        run_id = plant(store, project["commits"]["branch"], {"train": {**train, "pretrained_sha256": other}})
        error = _refused(*cli(run_id, "--workdir", str(tmp_path / "third"), capsys=capsys))
        assert error == (
            f"error: run {run_id}: its params pin train.pretrained_sha256 {other}, but torchvision publishes "
            f"{name} as sha256 {name[-12:-4]}...: not that file"
        )
    finally:
        shutil.rmtree(project["repo"] / ".cache", ignore_errors=True)
    assert attacker.requests == []


_REQUEST = """
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=5).read()
except OSError as exc:
    print("failed:", exc)
"""


def test_the_rebuild_environment_carries_no_credentials_and_reaches_no_host(
    attacker: FileServer, credentials: None, tmp_path: Path
) -> None:
    """Whatever the rebuilt stages (the run's commit's code) would fetch: no token, no netrc, and HTTP goes
    to a closed port on loopback, not to the host the record named."""
    url = attacker.add("/anything", b"x")
    others = {  # what else a user's shell may hold: cloud and database logins, the team stack's addresses
        "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI-K7MDENG",
        "PGPASSWORD": "pg-Passw0rd",
        "MLFLOW_TRACKING_PASSWORD": "ml-Passw0rd",
        "PREFECT_API_AUTH_STRING": "admin:pf-Passw0rd",
        "LOCKSTEP_SWEEP_STORAGE": "postgresql://sweep:pw@db.example/optuna",
        "MLFLOW_TRACKING_URI": "https://user:pw@mlflow.example",
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in others.items():
            patch.setenv(name, value)
        env = reproduce_rebuild._stage_env()
    assert TOKEN_ENV not in env and AUTH_ENV not in env and env["NETRC"] == os.devnull
    assert not set(others) & set(env), sorted(set(others) & set(env))
    assert env["PATH"] == os.environ["PATH"]  # the rest of the environment is the user's
    done = subprocess.run([sys.executable, "-c", _REQUEST, url], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("failed:"), done.stdout + done.stderr
    assert attacker.requests == []
