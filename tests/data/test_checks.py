"""Data checks before retraining (tasks/data/checks.py): each check against its threshold, and the download
stage refusing a snapshot with one line, leaving data/, data.dvc and the trained profile as they were.

The end-to-end cases run `python -m tasks download` (the stage as dvc.yaml runs it, MLflow on) in a
project copy whose source is an image folder the test changes, the way a real source changes. The
train stage is what records the trained snapshot's profile; here the test copies it as that stage
does (tests/flows/test_service.py runs the whole chain through a Prefect deployment).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from benchmarks.fakedata.imagefolder import imagefolder_tree
from tasks.core.config.data import ChecksConfig
from tasks.core.errors import DataRefused
from tasks.data.checks import Profile, check_snapshot, duplicates_across_splits, refuse_if_failed
from tests.conftest import client_for, copy_project, run

BASE = Profile(
    num_images=1000,
    image_shape=[8, 8, 1],
    classes=["a", "b", "c", "d"],
    class_counts=[250, 250, 250, 250],
    mean=[0.4],
    std=[0.2],
    duplicate_images=0,
)
CFG = ChecksConfig()


def statuses(new: Profile, reference: Profile | None = BASE, cfg: ChecksConfig = CFG, dup: int = 0) -> dict:
    report = check_snapshot(new, reference, cfg, dup, 150)
    return {check.name: check.status for check in report.checks}


def test_an_unchanged_snapshot_passes_every_check() -> None:
    report = check_snapshot(BASE, BASE, CFG, 0, 150)
    assert {c.name for c in report.checks} == {
        "class_imbalance",
        "duplicates_across_splits",
        "image_drop",
        "missing_classes",
        "new_classes",
        "label_psi",
        "mean_shift",
        "std_ratio",
    }
    assert all(c.status == "pass" for c in report.checks), report.checks
    refuse_if_failed(report)  # nothing raised
    assert report.metrics()["checks.label_psi"] == 0.0


def test_an_image_drop_beyond_the_threshold_is_refused_with_its_numbers() -> None:
    assert statuses(replace(BASE, num_images=905, class_counts=[230, 225, 225, 225]))["image_drop"] == "pass"
    smaller = replace(BASE, num_images=880, class_counts=[220, 220, 220, 220])
    report = check_snapshot(smaller, BASE, CFG, 0, 150)
    with pytest.raises(DataRefused) as refused:
        refuse_if_failed(report)
    line = str(refused.value)
    assert "image_drop: 880 images vs 1000 last trained (12.0% fewer, allowed 10.0%)" in line, line
    assert "\n" not in line and refused.value.report["refused"] is True


def test_missing_classes_refuse_and_new_classes_warn_by_default() -> None:
    fewer = replace(BASE, classes=["a", "b", "c"], class_counts=[330, 330, 340])
    assert statuses(fewer)["missing_classes"] == "refuse"
    more = replace(BASE, num_images=1200, classes=["a", "b", "c", "d", "e"], class_counts=[240] * 5)
    assert statuses(more)["new_classes"] == "warn"
    strict = ChecksConfig(new_classes="refuse", missing_classes="warn")
    assert statuses(more, cfg=strict)["new_classes"] == "refuse"
    assert statuses(fewer, cfg=strict)["missing_classes"] == "warn"


def test_class_imbalance_and_label_psi() -> None:
    skewed = replace(BASE, class_counts=[700, 200, 90, 10])
    found = statuses(skewed)
    assert found["class_imbalance"] == "refuse" and found["label_psi"] == "refuse"
    # PSI by hand: sum (p - q) ln(p / q) over the classes
    p, q = np.array([700, 200, 90, 10]) / 1000, np.full(4, 0.25)
    psi = check_snapshot(skewed, BASE, CFG, 0, 150).metrics()["checks.label_psi"]
    assert math.isclose(psi, float(np.sum((p - q) * np.log(p / q))), rel_tol=1e-12)
    mild = replace(BASE, class_counts=[270, 250, 240, 240])
    assert statuses(mild)["label_psi"] == "pass"


def test_pixel_drift_in_mean_or_spread() -> None:
    assert statuses(replace(BASE, mean=[0.45]))["mean_shift"] == "pass"  # 0.25 stds
    assert statuses(replace(BASE, mean=[0.55]))["mean_shift"] == "refuse"  # 0.75 stds
    assert statuses(replace(BASE, std=[0.35]))["std_ratio"] == "refuse"  # 1.75x
    assert statuses(replace(BASE, std=[0.1]))["std_ratio"] == "refuse"  # 2x narrower
    rgb = replace(BASE, image_shape=[8, 8, 3], mean=[0.9] * 3, std=[0.01] * 3)
    report = check_snapshot(rgb, BASE, CFG, 0, 150)
    assert "mean_shift" not in {c.name for c in report.checks}
    assert any("channels changed (1 -> 3)" in note for note in report.notes)


def test_first_run_checks_what_needs_no_reference() -> None:
    report = check_snapshot(BASE, None, CFG, 0, 150)
    assert {c.name for c in report.checks} == {"class_imbalance", "duplicates_across_splits"}
    assert "no trained snapshot" in report.notes[0]


def test_data_pointed_elsewhere_on_purpose_is_not_compared() -> None:
    from tasks.core.config.data import DataConfig
    from tasks.data.checks import data_origin

    digits, folder = DataConfig(), DataConfig(source="imagefolder", path="/datasets/shapes", channels=3)
    assert data_origin(digits) != data_origin(folder)
    # a new archive version of the same URL is the same data, grown: compared
    url = {"source": "imagefolder", "url": "https://example.org/s.tar.gz"}
    assert data_origin(DataConfig(**url, sha256="a" * 64)) == data_origin(DataConfig(**url, sha256="b" * 64))
    other = replace(BASE, num_images=60, classes=["x"], class_counts=[60], origin=data_origin(folder))
    report = check_snapshot(other, replace(BASE, origin=data_origin(digits)), CFG, 0, 150)
    assert {c.name for c in report.checks} == {"class_imbalance", "duplicates_across_splits"}
    assert "another source than the one trained on" in report.notes[0]


def test_duplicates_across_splits_are_counted_by_content() -> None:
    digests = np.array([[i % 5] * 16 for i in range(10)], dtype=np.uint8)  # rows i and i+5 are copies
    splits = {"train": np.array([0, 1, 2]), "val": np.array([3]), "test": np.array([5, 6, 9])}
    assert duplicates_across_splits(digests, splits) == 2  # 5 (of 0) and 6 (of 1); 9's copy 4 is nowhere
    assert statuses(BASE, dup=2)["duplicates_across_splits"] == "refuse"  # 2 of 150 > 1%
    assert statuses(BASE, dup=1)["duplicates_across_splits"] == "pass"


# ----------------------------------------------------------------------------- the download stage


def _folder(root: Path, per_class: int = 30) -> Path:
    imagefolder_tree(root, classes=("cat", "dog", "fish"), per_class=per_class, size=(8, 8), mode="L")
    return root


def _download(repo: Path, check: bool = True) -> object:
    return run(["python", "-m", "tasks", "download"], repo, check=check)


def _snapshot_files(repo: Path) -> dict[str, bytes]:
    files = [repo / "data.dvc", *sorted((repo / "data").iterdir())]
    return {str(path.relative_to(repo)): path.read_bytes() for path in files}


@pytest.fixture
def folder_project(tmp_path: Path) -> tuple[Path, Path]:
    images = _folder(tmp_path / "images")
    repo = copy_project(tmp_path / "repo", {"data": {"source": "imagefolder", "path": str(images), "channels": 1}})
    _download(repo)
    # what the train stage does after training: the data it trained on becomes the reference
    (repo / "artifacts/train").mkdir(parents=True)
    shutil.copy(repo / "artifacts/download/profile.json", repo / "artifacts/train/data_profile.json")
    return repo, images


@pytest.mark.slow  # a stage process or two (~10 s each)
def test_a_refused_snapshot_changes_nothing_and_says_why_in_one_line(folder_project: tuple[Path, Path]) -> None:
    repo, images = folder_project
    before = _snapshot_files(repo)
    profile_before = (repo / "artifacts/download/profile.json").read_bytes()
    for path in sorted(images.glob("dog/*.png"))[:12]:  # 12 of 90 images gone: 13.3% > 10%
        path.unlink()
    done = _download(repo, check=False)
    assert done.returncode == 3
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert lines == [
        "error: download: data check(s) refused the new snapshot, nothing retrained: image_drop: 78 images vs 90 last "
        "trained (13.3% fewer, allowed 10.0%)"
    ], done.stderr
    assert _snapshot_files(repo) == before  # data/ and data.dvc as they were
    assert (repo / "artifacts/download/profile.json").read_bytes() == profile_before
    report = json.loads((repo / "artifacts/checks/report.json").read_text())
    assert report["refused"] is True and report["profile"]["num_images"] == 78
    # recorded on the stage's MLflow run, which failed
    client = client_for(repo)
    (stage,) = client.search_runs(
        [client.get_experiment_by_name("lockstep").experiment_id],
        filter_string="tags.`lockstep.stage` = 'download' and attributes.status = 'FAILED'",
    )
    assert stage.data.tags["checks.verdict"] == "refused" and stage.data.tags["checks.failed"] == "image_drop"
    assert math.isclose(stage.data.metrics["checks.image_drop"], 12 / 90)
    assert [a.path for a in client.list_artifacts(stage.info.run_id, "checks")] == ["checks/report.json"]


@pytest.mark.slow  # a stage process or two (~10 s each)
def test_an_accepted_snapshot_with_a_warning_replaces_the_data(folder_project: tuple[Path, Path]) -> None:
    repo, images = folder_project
    imagefolder_tree(images, classes=("owl",), per_class=30, size=(8, 8), mode="L", seed=1)  # a new class
    done = _download(repo)
    assert "data check new_classes: 1 new class(es): 'owl'" in done.stderr, done.stderr
    profile = json.loads((repo / "artifacts/download/profile.json").read_text())
    assert profile["classes"] == ["cat", "dog", "fish", "owl"] and profile["num_images"] == 120
    report = json.loads((repo / "artifacts/checks/report.json").read_text())
    assert report["refused"] is False
    assert {c["name"]: c["status"] for c in report["checks"]}["new_classes"] == "warn"


@pytest.mark.slow  # a stage process or two (~10 s each)
def test_copies_of_test_images_in_training_are_refused_under_a_random_split(tmp_path: Path) -> None:
    images = _folder(tmp_path / "images", per_class=40)
    for path in sorted(images.glob("*/*.png")):  # every image twice: with a random split, copies straddle splits
        Image.open(path).save(path.with_name(path.stem + "_copy.png"))
    repo = copy_project(
        tmp_path / "repo",
        {"data": {"source": "imagefolder", "path": str(images), "channels": 1}, "split": {"assign": "random"}},
    )
    done = _download(repo, check=False)
    assert done.returncode == 3 and "duplicates_across_splits:" in done.stderr, done.stderr
    assert not (repo / "data").exists()  # a first download refused: nothing written
    # the content hash split keeps every copy in its original's split
    (repo / "params.yaml").write_text((repo / "params.yaml").read_text().replace("assign: random", "assign: hash"))
    _download(repo)
    report = json.loads((repo / "artifacts/checks/report.json").read_text())
    assert report["duplicates_across_splits"] == 0 and report["profile"]["duplicate_images"] == 120
