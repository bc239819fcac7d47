"""The check datasets of our own making (benchmarks/synthetic_images/): deterministic, balanced, varied,
shapes not told apart by colour, and written in the ImageFolder layout the imagefolder source reads."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from benchmarks.synthetic_images.cli import main
from benchmarks.synthetic_images.datasets import DATASETS, generate
from benchmarks.synthetic_images.writers import write_imagefolder

SHAPES = {"glyphs": (28, 28, 1), "shapes": (32, 32, 3), "shapes100": (32, 32, 3), "garments": (28, 28, 1)}


def test_every_dataset_is_listed() -> None:
    assert set(DATASETS) == set(SHAPES)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_generate_is_deterministic_balanced_and_typed(name: str) -> None:
    images, labels, classes = generate(name, 4, seed=7)
    again, again_labels, _ = generate(name, 4, seed=7)
    assert hashlib.sha256(images.tobytes()).digest() == hashlib.sha256(again.tobytes()).digest()
    assert np.array_equal(labels, again_labels)
    assert images.shape == (4 * len(classes), *SHAPES[name]) and images.dtype == np.uint8
    k = len(classes)
    assert labels.dtype == np.int64 and np.bincount(labels).tolist() == [4] * k
    assert k == (100 if name == "shapes100" else 10) and classes == sorted(classes), "ImageFolder sorts its folders"
    assert not np.array_equal(generate(name, 4, seed=8)[0], images)
    assert images.std() > 20, "images, not blank frames"


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_an_image_depends_on_its_number_not_on_what_was_generated_before(name: str) -> None:
    images, _, classes = generate(name, 3, seed=1)
    later, labels, _ = generate(name, 2, seed=1, start=1)  # numbers 1 and 2 of each class
    assert np.array_equal(later, images[len(classes) :])
    assert np.array_equal(labels, np.tile(np.arange(len(classes)), 2))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_no_two_images_are_identical(name: str) -> None:
    images, _, _ = generate(name, 12, seed=0)
    assert len({image.tobytes() for image in images}) == len(images)


def test_colour_does_not_tell_the_shapes_apart() -> None:
    images, labels, _ = generate("shapes", 40, seed=3)
    colour = images.reshape(len(images), -1, 3).mean(axis=1)  # each image's mean colour
    per_class = np.stack([colour[labels == k].mean(axis=0) for k in range(10)])
    # 40 images a class: a class mean's standard error is ~35/sqrt(40) ~ 6 grey levels per channel.
    assert np.abs(per_class - colour.mean(axis=0)).max() < 20, per_class.round(1)
    # Nearest class mean, fitted on half, tried on the other half: chance (10%), not better.
    fit, held = slice(0, 200), slice(200, 400)
    centroids = np.stack([colour[fit][labels[fit] == k].mean(axis=0) for k in range(10)])
    guess = np.argmin(((colour[held, None, :] - centroids[None]) ** 2).sum(-1), axis=1)
    assert (guess == labels[held]).mean() < 0.25


def _tree(folder: Path) -> dict[str, list[str]]:
    return {str(d.relative_to(folder)): sorted(f.name for f in d.iterdir()) for d in folder.rglob("*") if d.is_dir()}


def test_imagefolder_without_splits(tmp_path: Path) -> None:
    out = write_imagefolder(tmp_path / "glyphs", "glyphs", 3, seed=5)
    images, labels, classes = generate("glyphs", 3, seed=5)
    assert sorted(p.name for p in out.iterdir()) == classes
    assert _tree(out) == {c: ["00000.png", "00001.png", "00002.png"] for c in classes}
    decoded = np.asarray(Image.open(out / "7" / "00002.png"))
    assert np.array_equal(decoded, images[(labels == 7).nonzero()[0][2], ..., 0])
    assert [p.name for p in tmp_path.iterdir()] == ["glyphs"], "no staging folder left beside it"


def test_imagefolder_with_splits_takes_disjoint_numbers_and_replaces_the_old_tree(tmp_path: Path) -> None:
    target = tmp_path / "shapes"
    write_imagefolder(target, "glyphs", 1)
    write_imagefolder(target, "shapes", seed=2, splits={"train": 3, "test": 2})
    test_images, test_labels, classes = generate("shapes", 2, seed=2, start=3)
    tree = _tree(target)
    assert sorted(p.name for p in target.iterdir()) == ["test", "train"]
    for cls in classes:
        assert tree[f"train/{cls}"] == ["00000.png", "00001.png", "00002.png"]
        assert tree[f"test/{cls}"] == ["00003.png", "00004.png"]
    decoded = np.asarray(Image.open(target / "test" / classes[4] / "00004.png").convert("RGB"))
    assert np.array_equal(decoded, test_images[(test_labels == 4).nonzero()[0][1]])
    with pytest.raises(ValueError, match="sum"):
        write_imagefolder(target, "shapes", 4, splits={"train": 3, "test": 2})


def test_cli_writes_splits_and_a_preview(tmp_path: Path) -> None:
    assert (
        main(["garments", str(tmp_path / "g"), "--splits", "train=1,test=1", "--preview", str(tmp_path / "p.png")]) == 0
    )
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == ["test", "train"]
    preview = Image.open(tmp_path / "p.png")
    assert preview.height == 10 * (28 * 3 + 2) and preview.width > 12 * 28 * 3


@pytest.mark.parametrize("source", ["mnist", "fashion_mnist", "cifar10", "cifar100", "imagefolder"])
def test_the_check_data_downloads_in_its_sources_published_format(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What benchmarks/sources.py measures is the check data itself, split as published."""
    from benchmarks.httpserver import FileServer
    from benchmarks.sources import DATASET, publish
    from tasks.core.config.data import DataConfig
    from tasks.data.download import download
    from tasks.data.formats import read_raw

    with FileServer() as server:
        k = len(DATASETS[DATASET[source]].classes)
        data, tables = publish(source, tmp_path / "served", server.url, train_images=3 * k, test_images=2 * k)
        for path in (tmp_path / "served").glob("*.*"):
            server.add_file(f"/{path.name}", path)
        for cls, attributes in tables.items():
            for key, value in attributes.items():
                monkeypatch.setattr(cls, key, value)
        download(DataConfig(**data), tmp_path / "data", tmp_path / "cache")
    raw = read_raw(tmp_path / "data")
    train, train_labels, classes = generate(DATASET[source], 3, seed=0)
    test, test_labels, _ = generate(DATASET[source], 2, seed=0, start=3)
    assert raw.published_splits == {"train": (0, 3 * k), "test": (3 * k, 5 * k)}
    if source == "imagefolder":  # read back folder by folder: sorted by class, then by file name
        order = np.argsort(train_labels, kind="stable"), np.argsort(test_labels, kind="stable")
        train, train_labels, test, test_labels = (
            train[order[0]],
            train_labels[order[0]],
            test[order[1]],
            test_labels[order[1]],
        )
        assert raw.classes == classes
    assert np.array_equal(raw.images, np.concatenate([train, test]))
    assert np.array_equal(raw.labels, np.concatenate([train_labels, test_labels]))
