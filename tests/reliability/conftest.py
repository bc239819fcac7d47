"""The reliability suite: each fault of issue 8 injected into the real pipeline (README, "Reliability").

Faults are injected into real processes (`python -m tasks <stage>`, `dvc repro`, `make run`): SIGKILL
from outside, or from inside through `faults/sitecustomize.py` (a kill or a full disk half-way
through writing a chosen file).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import clone_project, run, write_params

FAULTS = Path(__file__).parent / "faults"


@dataclass(frozen=True)
class Trained:
    """A project after `dvc repro train`: data, preprocessed splits, checkpoints (tracking off)."""

    repo: Path
    digests: dict[str, str]  # every file under artifacts/ -> sha256


def digests(repo: Path, under: str = "artifacts") -> dict[str, str]:
    """sha256 of every file under `repo/under`, temporaries included (so a leftover shows)."""
    return {
        str(p.relative_to(repo)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((repo / under).rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="session")
def trained(dvc_repo: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """The session's trained project (tests/conftest.py `dvc_repo`) with tracking off; each test breaks
    a clone of it. (`tracking` is read by no stage: DVC still finds the pipeline up to date.)"""
    repo = clone_project(dvc_repo["repo"], tmp_path_factory.mktemp("trained") / "repo")
    write_params(repo / "params.yaml", {"tracking": {"enabled": False}}, base=repo / "params.yaml")
    return Trained(repo, digests(repo))


def clone(trained: Trained, dest: Path) -> Path:
    """A copy of the trained project to break (the session's one stays as it was)."""
    return clone_project(trained.repo, dest)


def stage(
    repo: Path, name: str, fault: str | None = None, path: str = "", nth: int = 1, **env: str
) -> subprocess.CompletedProcess[str]:
    """`python -m tasks <name>` (what `dvc repro` runs) in `repo`, with a fault injected if asked."""
    if fault:
        env.update(PYTHONPATH=str(FAULTS), LOCKSTEP_FAULT=fault, LOCKSTEP_FAULT_PATH=path, LOCKSTEP_FAULT_NTH=str(nth))
    return run([sys.executable, "-m", "tasks", name], repo, check=False, **env)


def checkpoint_epoch(path: Path) -> int:
    """The epoch recorded in a safetensors checkpoint's metadata."""
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
    return json.loads(header["__metadata__"]["lockstep"])["epoch"]
