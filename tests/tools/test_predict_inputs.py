"""What predict reads, and how the CSV names it, with a tiny model (tests/support/tiny_onnx.py): an
archive's images are named after the archive the user gave, even with ten inputs or more, and a FIFO
named like an image is a row with its error, never opened (opening it blocks for ever)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

from tests.conftest import ROOT, subprocess_env, write_params
from tests.support.tiny_onnx import tiny_model


def _png(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray((np.arange(64).reshape(8, 8) * 4).astype(np.uint8)).save(path)
    return path


def _predict(cwd: Path, *inputs: str) -> subprocess.CompletedProcess[str]:
    model = tiny_model(cwd / "model.onnx", ["cat", "dog"])
    params = write_params(cwd / "params.yaml", {})
    cmd = [sys.executable, "-m", "tasks.tools.predict", *inputs, "--model", str(model), "--params", str(params)]
    # a timeout, not a hang, should a FIFO be opened again
    done = subprocess.run(
        cmd, cwd=cwd, env=subprocess_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done


def _paths(cwd: Path) -> list[str]:
    with (cwd / "predictions.csv").open(newline="") as f:
        return [row["path"] for row in csv.DictReader(f)]


def test_an_archive_from_the_tenth_input_on_is_named_after_itself(tmp_path: Path) -> None:
    inputs = [_png(tmp_path / f"img{n}.png").name for n in range(11)]
    for n, archive, member in [(1, "first.tar.gz", "a.png"), (10, "second.tar.gz", "b.png")]:
        with tarfile.open(tmp_path / archive, "w:gz") as tar:
            tar.add(_png(tmp_path / "src" / member), arcname=member)
        inputs[n] = archive
    done = _predict(tmp_path, *inputs)
    assert "model.onnx: 11 of 11 images scored" in done.stdout, done.stdout
    expected = [f"img{n}.png" for n in range(11)]
    expected[1], expected[10] = "first.tar.gz!/a.png", "second.tar.gz!/b.png"  # not first.tar.gz!0/b.png
    assert _paths(tmp_path) == expected


def test_a_fifo_named_like_an_image_is_a_row_with_its_error_not_opened(tmp_path: Path) -> None:
    _png(tmp_path / "photos" / "a.png")
    os.mkfifo(tmp_path / "photos" / "b.png")
    os.mkfifo(tmp_path / "c.png")  # given by name, too
    done = _predict(tmp_path, "photos", "c.png")
    assert "1 of 3 images scored" in done.stdout, done.stdout
    assert _paths(tmp_path) == ["photos/a.png", "photos/b.png", "c.png"]
    for name in ("photos/b.png", "c.png"):
        assert f"unreadable: {name}: not a regular file (a FIFO, socket or device); not opened" in done.stderr
