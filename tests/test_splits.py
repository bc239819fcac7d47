"""Official splits: a source's published test set is the test split, image for image.

Each test runs the real download (against a loopback HTTP server serving tests/fakedata.py's files
in the published formats, or a local folder/archive), stats and preprocess functions, then compares
what preprocess wrote with the fake published files by content hash. Every fake image is distinct
(checked), so an image found in two splits can only mean a split that leaks.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torchvision.datasets
from PIL import Image

from tasks.config import DataConfig, SplitConfig
from tasks.data_format import SPLITS, RawDataset, open_raw, read_raw, split_indices, write_raw
from tasks.download import download
from tasks.errors import ExpectedFailure
from tasks.fetch import Retry
from tasks.preprocess import load_split, preprocess
from tasks.stats import compute_stats
from tests.fakedata import cifar_archive, imagefolder_tree, mnist_files, pack
from tests.httpserver import FileServer

FAST = Retry(attempts=2, backoff_s=0.05, timeout_s=2.0)
SPLIT = SplitConfig(train=0.7, val=0.15, test=0.15)  # published: true, the default
SEED = 42
TORCHVISION = {
    "mnist": torchvision.datasets.MNIST,
    "fashion_mnist": torchvision.datasets.FashionMNIST,
    "cifar10": torchvision.datasets.CIFAR10,
    "cifar100": torchvision.datasets.CIFAR100,
}


def _hash(chw: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(chw).tobytes()).hexdigest()


def _hashes(images_hwc: np.ndarray) -> list[str]:
    """Content hashes of (N, H, W[, C]) images, as preprocess stores them (channels first)."""
    images = images_hwc if images_hwc.ndim == 4 else images_hwc[..., np.newaxis]
    return [_hash(image.transpose(2, 0, 1)) for image in images]


def _published(
    source: str, work: Path, server: FileServer, monkeypatch: pytest.MonkeyPatch
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Serve fake published files of `source`; returns (train images, train labels, test images, test labels)."""
    cls = TORCHVISION[source]
    if source in ("mnist", "fashion_mnist"):
        files = mnist_files(work / "files", n_train=100, n_test=30, seed=1)
        for name, _ in files.resources:
            server.add_file(f"/{source}/{name}", work / "files" / name)
        monkeypatch.setattr(cls, "resources", files.resources)
        monkeypatch.setattr(cls, "mirrors", [f"{server.url}/{source}/"])
        return files.train_images, files.train_labels, files.test_images, files.test_labels
    # enough images of each class for a stratified val of at least one per class
    sizes = {"n_train": 100, "n_test": 30} if source == "cifar10" else {"n_train": 600, "n_test": 100}
    archive = cifar_archive(work / "files", source, seed=1, **sizes)
    server.add_file(f"/{source}/{archive.path.name}", archive.path)
    for name in ("tgz_md5", "train_list", "test_list", "meta"):
        monkeypatch.setattr(cls, name, getattr(archive, name))
    labels = (np.asarray(archive.train_labels), np.asarray(archive.test_labels))
    return archive.train_images, labels[0], archive.test_images, labels[1]


def _run_stages(work: Path, split: SplitConfig) -> dict[str, tuple[list[str], np.ndarray]]:
    """stats + preprocess on work/data; returns each split's (image hashes, labels) as preprocess wrote them."""
    stats = compute_stats(work / "data", split, SEED, chunk_size=16)
    preprocess(work / "data", stats, split, SEED, work / "pre")
    loaded = {name: load_split(work / "pre", name) for name in SPLITS}
    train = loaded["train"].images.astype(np.float64) / 255.0
    # stats describe exactly the training images that preprocess wrote
    assert stats.num_images == len(train)
    assert np.allclose(stats.mean, train.mean(axis=(0, 2, 3)), rtol=0, atol=1e-9)
    return {name: ([_hash(image) for image in part.images], part.labels) for name, part in loaded.items()}


def _assert_disjoint(splits: dict[str, tuple[list[str], np.ndarray]], total: int) -> None:
    everything = [h for hashes, _ in splits.values() for h in hashes]
    assert len(everything) == total and len(set(everything)) == total, "an image is in two splits, or missing"


@pytest.fixture
def server() -> Iterator[FileServer]:
    with FileServer() as srv:
        yield srv


@pytest.mark.parametrize("source", ["mnist", "fashion_mnist", "cifar10", "cifar100"])
def test_test_split_is_exactly_the_published_test_set(
    source: str, tmp_path: Path, server: FileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    train_images, train_labels, test_images, test_labels = _published(source, tmp_path, server, monkeypatch)
    published_train, published_test = _hashes(train_images), _hashes(test_images)
    assert len(set(published_train + published_test)) == len(train_images) + len(test_images)  # all distinct

    cfg = DataConfig(source=source, mirror=f"{server.url}/{source}/" if "cifar" in source else None)
    download(cfg, tmp_path / "data", tmp_path / "cache", FAST)
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    n_train = len(train_images)
    assert meta["published_splits"] == {"train": [0, n_train], "test": [n_train, n_train + len(test_images)]}
    splits = _run_stages(tmp_path, SPLIT)

    test_hashes, got_test_labels = splits["test"]
    assert len(test_hashes) == len(test_images)
    assert sorted(test_hashes) == sorted(published_test)
    label_of = dict(zip(published_test, np.asarray(test_labels).tolist(), strict=True))
    assert [label_of[h] for h in test_hashes] == got_test_labels.tolist()
    _assert_disjoint(splits, len(train_images) + len(test_images))
    # val: a seeded, stratified val / (train + val) of every class of the published train set
    val_hashes, val_labels = splits["val"]
    assert set(val_hashes) <= set(published_train)
    share = SPLIT.val / (SPLIT.train + SPLIT.val)
    per_class = Counter(np.asarray(train_labels).tolist())
    assert Counter(val_labels.tolist()) == {c: round(n * share) for c, n in per_class.items() if round(n * share)}
    raw = read_raw(tmp_path / "data")
    other = split_indices(raw.labels, SPLIT, SEED + 1, raw.published_splits)  # seeded: another seed, another val
    assert _hashes(np.asarray(raw.images[other["test"]])) == test_hashes
    assert _hashes(np.asarray(raw.images[other["val"]])) != val_hashes


def test_published_false_gives_the_seeded_split_of_all_images(
    tmp_path: Path, server: FileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    train_images, _, test_images, _ = _published("mnist", tmp_path, server, monkeypatch)
    download(DataConfig(source="mnist"), tmp_path / "data", tmp_path / "cache", FAST)
    seeded = SplitConfig(published=False, train=0.7, val=0.15, test=0.15)

    splits = _run_stages(tmp_path, seeded)

    raw = read_raw(tmp_path / "data")
    expected = split_indices(raw.labels, seeded, SEED)  # no published splits passed: the plain seeded cut
    for name in SPLITS:
        assert splits[name][0] == _hashes(np.asarray(raw.images[expected[name]]))
    assert len(splits["test"][0]) == 10 * round(13 * 0.15)  # 13 images of each class over both parts
    assert set(splits["test"][0]) & set(_hashes(train_images)), "the seeded test split drew only published test"
    _assert_disjoint(splits, len(train_images) + len(test_images))
    assert json.loads((tmp_path / "pre" / "meta.json").read_text())["published"] == []


def _old_split_indices(labels: np.ndarray, split: SplitConfig, seed: int) -> dict[str, np.ndarray]:
    """split_indices as it was before published splits existed, verbatim: the seeded split must not move."""
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in SPLITS}
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        n_test = int(round(len(members) * split.test))
        n_val = int(round(len(members) * split.val))
        parts["test"].append(members[:n_test])
        parts["val"].append(members[n_test : n_test + n_val])
        parts["train"].append(members[n_test + n_val :])
    return {name: np.sort(np.concatenate(chunks)) for name, chunks in parts.items()}


@pytest.mark.parametrize("published", [True, False])
def test_sources_without_published_splits_keep_the_seeded_split_and_bytes(published: bool, tmp_path: Path) -> None:
    labels = np.random.default_rng(0).integers(0, 7, size=500)
    split = SplitConfig(published=published, train=0.6, val=0.25, test=0.15)
    write_raw(RawDataset(np.zeros((500, 2, 2, 1), np.uint8), labels, [str(c) for c in range(7)], "x"), tmp_path)

    raw = open_raw(tmp_path)
    assert raw.published_splits is None and "published_splits" not in (tmp_path / "meta.json").read_text()
    got, old = split_indices(raw.labels, split, 5, raw.published_splits), _old_split_indices(labels, split, 5)
    assert list(got) == list(SPLITS) and all(np.array_equal(got[name], old[name]) for name in SPLITS)


def _decoded(tree: dict[str, list[Path]]) -> list[str]:
    """Content hashes of an image folder's files, decoded as the download stage does (RGB)."""
    hashes = []
    for files in tree.values():
        for path in files:
            with Image.open(path) as image:
                hashes.append(_hash(np.asarray(image.convert("RGB")).transpose(2, 0, 1)))
    return hashes


@pytest.mark.parametrize("with_val", [True, False])
def test_imagefolder_train_val_test_folders_are_kept(with_val: bool, tmp_path: Path) -> None:
    folders = ("train", "val", "test") if with_val else ("train", "test")
    trees = {
        name: imagefolder_tree(tmp_path / "tree" / name, per_class=8 if name == "train" else 3, seed=seed)
        for seed, name in enumerate(folders)
    }
    sha = pack(tmp_path / "tree", tmp_path / "pets.tar.gz", "tar.gz", prefix="pets")  # find_root unwraps pets/
    cfg = DataConfig(source="imagefolder", path=str(tmp_path / "pets.tar.gz"), sha256=sha)
    download(cfg, tmp_path / "data", tmp_path / "cache")

    splits = _run_stages(tmp_path, SPLIT)

    for name in folders:
        if name != "train" or with_val:
            assert sorted(splits[name][0]) == sorted(_decoded(trees[name])), f"{name}/ was not kept"
    _assert_disjoint(splits, sum(len(_decoded(trees[name])) for name in folders))
    assert Counter(splits["test"][1].tolist()) == {0: 3, 1: 3, 2: 3}
    if not with_val:  # 8 per class: round(8 * 0.15 / 0.85) = 1 of each class to val
        assert set(splits["val"][0]) <= set(_decoded(trees["train"])) and Counter(splits["val"][1].tolist()) == {
            0: 1,
            1: 1,
            2: 1,
        }
    published = json.loads((tmp_path / "pre" / "meta.json").read_text())["published"]
    assert published == (["train", "val", "test"] if with_val else ["test"])


def test_split_folders_with_different_classes_are_refused(tmp_path: Path) -> None:
    imagefolder_tree(tmp_path / "tree" / "train", classes=("cat", "dog", "fish"), per_class=2)
    imagefolder_tree(tmp_path / "tree" / "test", classes=("bird", "cat", "dog"), per_class=1, seed=1)
    cfg = DataConfig(source="imagefolder", path=str(tmp_path / "tree"))

    with pytest.raises(
        ExpectedFailure, match=r"tree/test: class folders differ from train/'s \(missing \['fish'\], extra \['bird'\]\)"
    ):
        download(cfg, tmp_path / "data", tmp_path / "cache")
    assert not (tmp_path / "data").exists()


def test_split_folders_without_a_test_folder_are_refused(tmp_path: Path) -> None:
    for seed, name in enumerate(("train", "val")):
        imagefolder_tree(tmp_path / "tree" / name, per_class=2, seed=seed)

    with pytest.raises(ExpectedFailure, match=r"tree: split folders \['train', 'val'\] need both train/ and test/"):
        download(DataConfig(source="imagefolder", path=str(tmp_path / "tree")), tmp_path / "data", tmp_path / "cache")


@pytest.mark.parametrize(
    "ranges",
    [
        {"train": [0, 6], "test": [5, 10]},  # overlap: an image in train and test
        {"train": [0, 5], "test": [6, 10]},  # a gap: row 5 in no split
        {"train": [0, 6], "test": [6, 11]},  # past the last row
        {"train": [0, 6], "test": [6, 9]},  # rows left out at the end
        {"test": [0, 10]},  # no train
        {"train": [0, 6], "test": [6, "10"]},  # not an integer
        {"train": [0, 4], "val": [4, 6], "test": [6, 10], "extra": [10, 10]},  # unknown split
        [[0, 6], [6, 10]],  # not a mapping
    ],
)
def test_bad_published_ranges_in_meta_are_refused(ranges: object, tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_raw(RawDataset(np.zeros((10, 2, 2, 1), np.uint8), np.arange(10) % 2, ["a", "b"], "x", None), data)
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "published_splits": ranges}))

    with pytest.raises(ExpectedFailure, match="data/meta.json: published_splits") as failure:
        open_raw(data)
    assert repr(ranges) in str(failure.value)


def test_published_val_is_kept_and_published_false_ignores_it() -> None:
    labels = np.arange(20) % 2
    published = {"train": (0, 10), "val": (10, 14), "test": (14, 20)}

    kept = split_indices(labels, SPLIT, 1, published)
    seeded = split_indices(labels, SplitConfig(published=False), 1, published)

    assert [kept[name].tolist() for name in SPLITS] == [list(range(10)), list(range(10, 14)), list(range(14, 20))]
    assert [seeded[name].tolist() for name in SPLITS] == [
        v.tolist() for v in _old_split_indices(labels, SplitConfig(published=False), 1).values()
    ]
