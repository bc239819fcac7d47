"""Predict with the champion: `python -m tasks.tools.predict` on the test split of a project the whole
pipeline ran in (`dvc_repo`), written out as image files. Serving it over HTTP: tests/ship/test_serve.py."""

from __future__ import annotations

import csv
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.conftest import run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def split_pngs(dvc_repo: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_split_pngs(dvc_repo["repo"], tmp_path_factory.mktemp("test-split"))


def write_split_pngs(repo: Path, folder: Path) -> Path:
    """The project's test split as PNG files, <folder>/<class>/<row>.png (PNG: the same pixels back)."""
    from tasks.data.preprocess import load_split

    test = load_split(repo / "artifacts/preprocessed", "test")
    for row, (image, label) in enumerate(zip(test.images, test.labels, strict=True)):
        path = folder / test.classes[label] / f"{row:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image[0] if image.shape[0] == 1 else image.transpose(1, 2, 0)).save(path)
    return folder


def predict(repo: Path, *args: str, check: bool = True, **env: str) -> Any:
    return run(["python", "-m", "tasks.tools.predict", *args], repo, check=check, **env)


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def accuracy(scored: list[dict[str, str]]) -> float:
    return float(np.mean([Path(r["path"]).parent.name == r["class"] for r in scored]))


def test_the_champion_scores_the_test_split_as_export_did(
    dvc_repo: dict[str, Any], split_pngs: Path, tmp_path: Path
) -> None:
    repo = dvc_repo["repo"]
    done = predict(repo, str(split_pngs), "--out", str(tmp_path / "champion.csv"))
    assert "lockstep-classifier v1: 271 of 271 images scored" in done.stdout, done.stdout
    champion = rows(tmp_path / "champion.csv")
    assert list(champion[0]) == ["path", "class", "probability", "top_k", "error"]
    # The champion is the shipped model, possibly int8 (gates.json's `variant`): its accuracy is the one
    # export measured for that file in the same runtime (gates.json `shipped`), not evaluate's fp32 one.
    gates = json.loads((repo / "artifacts/export/gates.json").read_text())
    assert accuracy(champion) == gates["shipped"]["accuracy"]
    top = champion[0]["top_k"].split()
    assert len(top) == 3 and top[0].startswith(champion[0]["class"] + ":"), champion[0]
    # the fp32 file gives evaluate's (torch's) accuracy, and its very answer on each image
    predict(repo, str(split_pngs), "--model", "artifacts/export/model_fp32.onnx", "--out", str(tmp_path / "fp32.csv"))
    fp32 = rows(tmp_path / "fp32.csv")
    evaluated = json.loads((repo / "artifacts/evaluate/metrics.json").read_text())
    assert accuracy(fp32) == evaluated["accuracy"]
    with (repo / "artifacts/evaluate/predictions.csv").open(newline="") as f:
        per_image = [r["predicted"] for r in csv.DictReader(f)]  # in the split's order: the files' names
    assert [r["class"] for r in fp32] == [per_image[int(Path(r["path"]).stem)] for r in fp32]
    # a version by number: the champion is v1
    predict(repo, str(split_pngs), "--version", "1", "--out", str(tmp_path / "v1.csv"))
    assert rows(tmp_path / "v1.csv") == champion


def test_unreadable_images_are_listed_and_archives_are_read(
    dvc_repo: dict[str, Any], split_pngs: Path, tmp_path: Path
) -> None:
    repo = dvc_repo["repo"]
    (tmp_path / "broken.png").write_bytes(b"not an image")
    with tarfile.open(tmp_path / "some.tar.gz", "w:gz") as archive:
        archive.add(split_pngs / "3", arcname="threes")
    out = tmp_path / "out.csv"
    done = predict(
        repo,
        str(tmp_path / "broken.png"),
        str(tmp_path / "some.tar.gz"),
        "--model",
        "artifacts/export/model.onnx",
        "--out",
        str(out),
    )
    scored = rows(out)
    threes = len(list((split_pngs / "3").iterdir()))
    assert f"{threes} of {threes + 1} images scored" in done.stdout, done.stdout
    broken = scored[0]
    assert broken["path"].endswith("broken.png") and broken["class"] == "" and "not a readable image" in broken["error"]
    assert "unreadable: " in done.stderr and "broken.png" in done.stderr
    # archive members are named inside the archive the user gave, not in a temporary folder
    assert all(r["path"].startswith(f"{tmp_path / 'some.tar.gz'}!/threes/") for r in scored[1:]), scored[1]
    assert np.mean([r["class"] == "3" for r in scored[1:]]) > 0.8


def test_no_champion_or_no_image_is_one_line_and_the_csv_is_left_as_it_was(
    dvc_repo: dict[str, Any], split_pngs: Path, tmp_path: Path
) -> None:
    repo, out = dvc_repo["repo"], tmp_path / "kept.csv"
    out.write_text("earlier results\n")
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    done = predict(repo, str(split_pngs), "--out", str(out), check=False, MLFLOW_TRACKING_URI=empty)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "no @champion in the registry" in done.stderr and "Traceback" not in done.stderr
    done = predict(repo, str(split_pngs), "--version", "99", "--out", str(out), check=False)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "lockstep-classifier: no version 99 in the registry" in done.stderr, done.stderr
    (tmp_path / "junk.png").write_bytes(b"junk")
    done = predict(
        repo, str(tmp_path / "junk.png"), "--model", "artifacts/export/model.onnx", "--out", str(out), check=False
    )
    assert done.returncode == 1, done.stderr
    assert out.read_text() == "earlier results\n"
    # a model without lockstep's class names is refused, naming what is missing
    import onnx

    bare = onnx.load(str(repo / "artifacts/export/model.onnx"))
    del bare.metadata_props[:]
    onnx.save(bare, str(tmp_path / "bare.onnx"))
    done = predict(repo, str(split_pngs), "--model", str(tmp_path / "bare.onnx"), "--out", str(out), check=False)
    assert done.returncode == 1 and "lockstep.classes" in done.stderr, done.stderr
    # written whole or not at all (tasks/core/atomic.py): the old file, and no temporary beside it
    assert out.read_text() == "earlier results\n" and not list(tmp_path.glob(".kept.csv.tmp*"))
    predict(repo, str(split_pngs), "--model", "artifacts/export/model.onnx", "--out", str(out))
    assert len(rows(out)) == len(list(split_pngs.rglob("*.png"))) and not list(tmp_path.glob(".kept.csv.tmp*"))
