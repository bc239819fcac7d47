"""Corrupt preprocessed files, and checkpoints from another model or other data: a clear error naming
the file, and no silent re-use. (A resume checkpoint from another world size: tests/train/test_ddp_resume.py,
with a real 2-process one.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.conftest import run
from tests.reliability.conftest import Trained, clone, digests, stage
from tests.support.cli_errors import one_line_error

pytestmark = pytest.mark.slow


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _rewrite_metadata(path: Path, **changes: object) -> None:
    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads(handle.metadata()["lockstep"])
    save_file(load_file(str(path)), str(path), metadata={"lockstep": json.dumps({**meta, **changes})})


@pytest.mark.parametrize("damage", [_flip_a_byte, _truncate])
def test_corrupt_preprocessed_data_is_refused_by_a_stage_and_rebuilt_by_the_pipeline(
    trained: Trained, tmp_path: Path, damage
) -> None:
    repo = clone(trained, tmp_path / "repo")
    damage(repo / "artifacts/preprocessed/train_images.npy")
    error = one_line_error(stage(repo, "train"))
    assert "artifacts/preprocessed/train_images.npy: its sha256 does not match meta.json" in error, error
    # the pipeline does not re-use it either: DVC sees the output changed and restores the good copy
    # from its cache (or runs preprocess again when the cache does not have it)
    rerun = run(["dvc", "repro", "train"], repo)
    assert "Stage 'preprocess' is cached - skipping run, checking out outputs" in rerun.stdout, rerun.stdout
    for path in ("artifacts/preprocessed/train_images.npy", "artifacts/train/best.safetensors"):
        assert (repo / path).read_bytes() == (trained.repo / path).read_bytes()


@pytest.mark.parametrize(
    ("damage", "shown"),
    [
        (_truncate, "artifacts/train/best.safetensors: not a readable safetensors file"),
        (
            lambda path: _rewrite_metadata(path, model="resnet18"),
            "artifacts/train/best.safetensors: weights do not fit model 'resnet18'",
        ),
        (
            lambda path: _rewrite_metadata(path, classes=[f"class {i}" for i in range(10)]),
            "artifacts/train/best.safetensors: trained on other data (classes",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_is_refused(trained: Trained, tmp_path: Path, damage, shown: str) -> None:
    repo = clone(trained, tmp_path / "repo")
    damage(repo / "artifacts/train/best.safetensors")
    before = digests(repo, "artifacts/evaluate")
    error = one_line_error(stage(repo, "evaluate"))
    assert shown in error, error
    assert digests(repo, "artifacts/evaluate") == before  # the previous evaluation, as it was
