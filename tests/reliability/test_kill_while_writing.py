"""SIGKILL during training and while an output is being written.

Rows "SIGKILL during training, then re-run" and "SIGKILL while a checkpoint or any output is being
written". The kill strikes half-way through a write (faults/sitecustomize.py), the worst moment: the
half-written bytes are on disk. Killing at arbitrary moments of a run (one process, DDP, a torchrun
restart) is in tests/train/test_ddp_resume.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tasks.train.checkpoints import load_checkpoint
from tests.conftest import run, write_params
from tests.reliability.conftest import Trained, checkpoint_epoch, clone, digests, stage

pytestmark = pytest.mark.slow


def _leftovers(repo: Path) -> list[Path]:
    return [p for p in (repo / "artifacts").rglob(".*.tmp*")]


def test_killed_while_writing_a_checkpoint_resumes_to_identical_weights(trained: Trained, tmp_path: Path) -> None:
    repo = clone(trained, tmp_path / "repo")
    # as if training had never finished: no outputs, nothing in dvc.lock or DVC's run cache to restore them from
    run(["rm", "-rf", "artifacts/train", "artifacts/train-resume", ".dvc/cache/runs"], repo)
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    del lock["stages"]["train"]
    (repo / "dvc.lock").write_text(yaml.safe_dump(lock, sort_keys=False))
    # killed half-way through writing the epoch-2 resume checkpoint
    killed = stage(repo, "train", "kill", "resume.safetensors", nth=2)
    assert killed.returncode == -9, killed.stderr
    resume = repo / "artifacts/train-resume/resume.safetensors"
    assert checkpoint_epoch(resume) == 1  # the previous checkpoint, whole
    [partial] = _leftovers(repo)  # the half-written one, under a temporary name nobody reads
    assert 0 < partial.stat().st_size < resume.stat().st_size
    # the re-run goes through the real pipeline: dvc repro resumes after epoch 1
    rerun = run(["dvc", "repro", "train"], repo)
    assert "resuming from artifacts/train-resume/resume.safetensors after epoch 1" in rerun.stdout + rerun.stderr
    for name in ("best.safetensors", "last.safetensors"):
        path = f"artifacts/train/{name}"
        assert digests(repo)[path] == trained.digests[path], f"{name} differs from the uninterrupted run's"
    assert not _leftovers(repo) and not resume.exists()  # the dead writer's temporary swept, the run finished


@pytest.mark.parametrize(
    ("name", "target", "nth"),
    [
        ("train", "best.safetensors", 1),  # a checkpoint (safetensors)
        ("train", "history.json", 1),  # a JSON output
        ("preprocess", "val_images.npy", 1),  # a directory output (artifacts/preprocessed/)
    ],
)
def test_killed_while_writing_an_output_leaves_the_previous_one(
    trained: Trained, tmp_path: Path, name: str, target: str, nth: int
) -> None:
    repo = clone(trained, tmp_path / "repo")
    # other params, so the new output would differ from the previous one
    write_params(repo / "params.yaml", {"seed": 7, "train": {"epochs": 1}}, base=repo / "params.yaml")
    killed = stage(repo, name, "kill", target, nth=nth)
    assert killed.returncode == -9, killed.stderr
    after = digests(repo)
    temporaries = {path for path in after if "/." in path}
    assert temporaries, "the kill did not strike during the write"
    # every output as it was (the killed run's own resume checkpoint aside: it is its state, not an output)
    outputs = {k: v for k, v in after.items() if k not in temporaries and not k.startswith("artifacts/train-resume/")}
    assert outputs == trained.digests
    # what the next stages read is whole and valid
    load_checkpoint(repo / "artifacts/train/best.safetensors")
    status = json.loads(run(["dvc", "status", "--json", name], repo).stdout)  # DVC: params changed, outputs not
    assert not [change for change in status.get(name, []) if "changed outs" in change], status
    # the next run of the stage completes, and sweeps the dead writer's temporary
    assert stage(repo, name).returncode == 0
    assert not _leftovers(repo)
