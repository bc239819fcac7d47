"""Splits: a source's published test set is the test split, image for image; cut splits stay put.

The published-split tests run the real download (against a loopback HTTP server serving
benchmarks/fakedata/'s files in the published formats, or a local folder/archive), stats and preprocess
functions, then compare what preprocess wrote with the fake published files by content hash. Every
fake image is distinct (checked), so an image found in two splits can only mean a split that leaks.

The `split.assign` tests grow, shrink and duplicate snapshots of the real digits and follow each
image by its content digest: with `hash` no image ever changes split; `random` must give exactly the
indices it gave before `hash` existed.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torchvision.datasets
from PIL import Image

from benchmarks.fakedata.archives import pack
from benchmarks.fakedata.cifar import cifar_archive
from benchmarks.fakedata.imagefolder import imagefolder_tree
from benchmarks.fakedata.mnist import mnist_files
from benchmarks.httpserver import FileServer
from tasks.core.config.data import DataConfig, SplitConfig
from tasks.core.errors import ExpectedFailure
from tasks.core.fetch import Retry
from tasks.data.download import download
from tasks.data.formats import SPLITS, PublishedSplits, RawDataset, RawSnapshot, open_raw, read_raw, write_raw
from tasks.data.preprocess import load_split, preprocess
from tasks.data.splits import content_digests, split_indices
from tasks.data.stats import compute_stats

FAST = Retry(attempts=2, backoff_s=0.05, timeout_s=2.0)
SPLIT = SplitConfig(train=0.7, val=0.15, test=0.15)  # published: true, assign: hash, the defaults
RANDOM = SplitConfig(train=0.7, val=0.15, test=0.15, assign="random")
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


@pytest.mark.parametrize("assign", ["hash", "random"])
@pytest.mark.parametrize("source", ["mnist", "fashion_mnist", "cifar10", "cifar100"])
def test_test_split_is_exactly_the_published_test_set(
    source: str, assign: str, tmp_path: Path, server: FileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    train_images, train_labels, test_images, test_labels = _published(source, tmp_path, server, monkeypatch)
    published_train, published_test = _hashes(train_images), _hashes(test_images)
    assert len(set(published_train + published_test)) == len(train_images) + len(test_images)  # all distinct

    cfg = DataConfig(source=source, mirror=f"{server.url}/{source}/" if "cifar" in source else None)
    download(cfg, tmp_path / "data", tmp_path / "cache", FAST)
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    n_train = len(train_images)
    assert meta["published_splits"] == {"train": [0, n_train], "test": [n_train, n_train + len(test_images)]}
    split = SplitConfig(train=0.7, val=0.15, test=0.15, assign=assign)
    splits = _run_stages(tmp_path, split)

    test_hashes, got_test_labels = splits["test"]
    assert len(test_hashes) == len(test_images)
    assert sorted(test_hashes) == sorted(published_test)
    label_of = dict(zip(published_test, np.asarray(test_labels).tolist(), strict=True))
    assert [label_of[h] for h in test_hashes] == got_test_labels.tolist()
    _assert_disjoint(splits, len(train_images) + len(test_images))
    # val: a seeded val / (train + val) of the published train set: exact in every class when random,
    # about that share when by hash (which this fake data's size makes loose: 0.18 of 100 images)
    val_hashes, val_labels = splits["val"]
    assert set(val_hashes) <= set(published_train)
    share = split.val / (split.train + split.val)
    if assign == "random":
        per_class = Counter(np.asarray(train_labels).tolist())
        assert Counter(val_labels.tolist()) == {c: round(n * share) for c, n in per_class.items() if round(n * share)}
    else:
        assert abs(len(val_hashes) / n_train - share) < 0.1
    other = split_indices(open_raw(tmp_path / "data"), split, SEED + 1)  # seeded: another seed, another val
    raw = read_raw(tmp_path / "data")
    assert _hashes(np.asarray(raw.images[other["test"]])) == test_hashes
    assert _hashes(np.asarray(raw.images[other["val"]])) != val_hashes
    assert json.loads((tmp_path / "pre" / "meta.json").read_text())["split_assign"] == assign


@pytest.mark.parametrize("assign", ["hash", "random"])
def test_published_false_gives_the_seeded_split_of_all_images(
    assign: str, tmp_path: Path, server: FileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    train_images, _, test_images, _ = _published("mnist", tmp_path, server, monkeypatch)
    download(DataConfig(source="mnist"), tmp_path / "data", tmp_path / "cache", FAST)
    seeded = SplitConfig(published=False, train=0.7, val=0.15, test=0.15, assign=assign)

    splits = _run_stages(tmp_path, seeded)

    raw = read_raw(tmp_path / "data")
    # the snapshot keeps its published ranges; published: false must ignore them
    expected = split_indices(replace(open_raw(tmp_path / "data"), published_splits=None), seeded, SEED)
    for name in SPLITS:
        assert splits[name][0] == _hashes(np.asarray(raw.images[expected[name]]))
    if assign == "random":
        assert len(splits["test"][0]) == 10 * round(13 * 0.15)  # 13 images of each class over both parts
    assert set(splits["test"][0]) & set(_hashes(train_images)), "the seeded test split drew only published test"
    _assert_disjoint(splits, len(train_images) + len(test_images))
    meta = json.loads((tmp_path / "pre" / "meta.json").read_text())
    assert meta["published"] == [] and meta["split_assign"] == assign


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
    split = SplitConfig(published=published, train=0.6, val=0.25, test=0.15, assign="random")
    write_raw(RawDataset(np.zeros((500, 2, 2, 1), np.uint8), labels, [str(c) for c in range(7)], "x"), tmp_path)

    raw = open_raw(tmp_path)
    assert raw.published_splits is None and "published_splits" not in (tmp_path / "meta.json").read_text()
    got, old = split_indices(raw, split, 5), _old_split_indices(labels, split, 5)
    assert list(got) == list(SPLITS) and all(np.array_equal(got[name], old[name]) for name in SPLITS)


def _decoded(tree: dict[str, list[Path]]) -> list[str]:
    """Content hashes of an image folder's files, decoded as the download stage does (RGB)."""
    hashes = []
    for files in tree.values():
        for path in files:
            with Image.open(path) as image:
                hashes.append(_hash(np.asarray(image.convert("RGB")).transpose(2, 0, 1)))
    return hashes


@pytest.mark.parametrize("assign", ["hash", "random"])
@pytest.mark.parametrize("with_val", [True, False])
def test_imagefolder_train_val_test_folders_are_kept(with_val: bool, assign: str, tmp_path: Path) -> None:
    folders = ("train", "val", "test") if with_val else ("train", "test")
    trees = {
        name: imagefolder_tree(tmp_path / "tree" / name, per_class=8 if name == "train" else 3, seed=seed)
        for seed, name in enumerate(folders)
    }
    sha = pack(tmp_path / "tree", tmp_path / "pets.tar.gz", "tar.gz", prefix="pets")  # find_root unwraps pets/
    cfg = DataConfig(source="imagefolder", path=str(tmp_path / "pets.tar.gz"), sha256=sha)
    download(cfg, tmp_path / "data", tmp_path / "cache")

    splits = _run_stages(tmp_path, SplitConfig(train=0.7, val=0.15, test=0.15, assign=assign))

    for name in folders:
        if name != "train" or with_val:
            assert sorted(splits[name][0]) == sorted(_decoded(trees[name])), f"{name}/ was not kept"
    _assert_disjoint(splits, sum(len(_decoded(trees[name])) for name in folders))
    assert Counter(splits["test"][1].tolist()) == {0: 3, 1: 3, 2: 3}
    if not with_val:
        assert set(splits["val"][0]) <= set(_decoded(trees["train"]))
    if not with_val and assign == "random":  # 8 per class: round(8 * 0.15 / 0.85) = 1 of each class to val
        assert Counter(splits["val"][1].tolist()) == {0: 1, 1: 1, 2: 1}
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


@pytest.mark.parametrize("assign", ["hash", "random"])
def test_published_val_is_kept_and_published_false_ignores_it(assign: str, tmp_path: Path) -> None:
    labels = np.arange(20) % 2
    published = {"train": (0, 10), "val": (10, 14), "test": (14, 20)}
    snapshot = _snapshot(tmp_path / "data", np.arange(20, dtype=np.uint8).reshape(20, 1, 1, 1), labels, published)

    kept = split_indices(snapshot, SplitConfig(assign=assign), 1)
    seeded = split_indices(snapshot, SplitConfig(published=False, assign=assign), 1)

    assert [kept[name].tolist() for name in SPLITS] == [list(range(10)), list(range(10, 14)), list(range(14, 20))]
    assert sorted(np.concatenate(list(seeded.values())).tolist()) == list(range(20))
    if assign == "random":
        assert [seeded[name].tolist() for name in SPLITS] == [
            v.tolist() for v in _old_split_indices(labels, SplitConfig(published=False), 1).values()
        ]
    else:
        assert [seeded[name].tolist() for name in SPLITS] != [kept[name].tolist() for name in SPLITS]


# --- split.assign: hash (stable as the data changes) and random (as before hash existed) ---------------------


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> tuple[np.ndarray, np.ndarray]:
    """The default dataset as the download stage ingests it: (1797, 8, 8, 1) uint8 images, labels."""
    out = tmp_path_factory.mktemp("digits")
    download(DataConfig(source="digits"), out / "data", out / "cache")
    raw = read_raw(out / "data")
    images = np.array(raw.images)
    assert len(np.unique(images.reshape(len(images), -1), axis=0)) == len(images)  # all distinct: a sound baseline
    return images, raw.labels


def _snapshot(
    folder: Path, images: np.ndarray, labels: np.ndarray, published: PublishedSplits | None = None
) -> RawSnapshot:
    write_raw(RawDataset(images, labels, [str(c) for c in range(10)], "test", published), folder)
    return open_raw(folder)


def _split_by_content(snapshot: RawSnapshot, split: SplitConfig, seed: int = SEED) -> dict[bytes, str]:
    """Each image content (its digest) -> the split holding it; fails if a content is in two splits."""
    digests = content_digests(snapshot.rows, chunk_size=100)
    where: dict[bytes, str] = {}
    parts = split_indices(snapshot, split, seed)
    assert sorted(np.concatenate(list(parts.values())).tolist()) == list(range(len(digests)))  # each row once
    for name, rows in parts.items():
        for digest in digests[rows]:
            assert where.setdefault(digest.tobytes(), name) == name, (
                f"one image content in {where[digest.tobytes()]} and {name}"
            )
    return where


def test_hash_split_keeps_every_image_in_its_split_as_images_are_added_or_removed(
    digits: tuple[np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    images, labels = digits
    rng = np.random.default_rng(0)
    base = rng.permutation(len(labels))[:1630]
    added = np.setdiff1d(np.arange(len(labels)), base)  # 167 images (10% more), none of them in base
    before = _split_by_content(_snapshot(tmp_path / "a", images[base], labels[base]), SPLIT)

    grown = rng.permutation(np.concatenate([base, added]))  # new images land anywhere in the row order
    after = _split_by_content(_snapshot(tmp_path / "b", images[grown], labels[grown]), SPLIT)
    assert len(after) == len(grown) and {digest: after[digest] for digest in before} == before
    assert set(Counter(after[d] for d in set(after) - set(before))) == set(SPLITS)  # the new ones go everywhere

    kept = base[rng.permutation(len(base))[:1467]]  # 10% removed
    shrunk = _split_by_content(_snapshot(tmp_path / "c", images[kept], labels[kept]), SPLIT)
    assert len(shrunk) == len(kept) and shrunk == {digest: before[digest] for digest in shrunk}

    # the contrast: a seeded shuffle reshuffles everything when images are added
    before, after = (
        _split_by_content(_snapshot(tmp_path / name, images[rows], labels[rows]), RANDOM)
        for name, rows in (("d", base), ("e", grown))
    )
    assert sum(after[digest] != where for digest, where in before.items()) > len(base) // 10


def test_copies_of_an_image_share_a_split_whatever_their_labels(
    digits: tuple[np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    images, labels = digits
    rng = np.random.default_rng(1)
    copied = rng.choice(len(labels), 300, replace=False)
    relabelled = (labels[copied] + rng.integers(1, 10, len(copied))) % 10  # same bytes, another label
    order = rng.permutation(len(labels) + len(copied))
    all_images, all_labels = (
        np.concatenate([images, images[copied]])[order],
        np.concatenate([labels, relabelled])[order],
    )

    where = _split_by_content(_snapshot(tmp_path / "a", all_images, all_labels), SPLIT)  # fails on a split copy

    assert len(where) == len(labels)
    with pytest.raises(AssertionError, match="one image content in"):  # a shuffle does separate copies
        _split_by_content(_snapshot(tmp_path / "b", all_images, all_labels), RANDOM)


def test_hash_split_is_seeded_deterministic_and_near_the_fractions(
    digits: tuple[np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    images, labels = digits
    snapshot = _snapshot(tmp_path / "a", images, labels)

    first, again, other = (split_indices(snapshot, SPLIT, seed) for seed in (7, 7, 8))

    assert all(np.array_equal(first[name], again[name]) for name in SPLITS)
    assert not np.array_equal(first["test"], other["test"])
    assert all(np.all(np.diff(first[name]) > 0) for name in SPLITS)  # sorted: chunked reads stay sequential
    digests = content_digests(snapshot.rows)
    assert all(np.array_equal(split_indices(snapshot, SPLIT, 7, digests)[name], first[name]) for name in SPLITS)
    # read a block at a time, blocks of any size (the last one short) give the same split
    for chunk_size in (100, 1000):
        chunked = split_indices(snapshot, SPLIT, 7, chunk_size=chunk_size)
        assert all(np.array_equal(chunked[name], first[name]) for name in SPLITS), chunk_size
    per_class = np.bincount(labels, minlength=10)
    for name, fraction in (("train", 0.7), ("val", 0.15), ("test", 0.15)):
        # binomial: about 0.15 +- 0.008 of all 1797 images, +- 0.027 of each class's ~180
        assert abs(len(first[name]) / len(labels) - fraction) < 0.03, name
        shares = np.bincount(labels[first[name]], minlength=10) / per_class
        assert np.all(np.abs(shares - fraction) < 0.1), (name, shares)


@pytest.mark.parametrize("assign", ["hash", "random"])
def test_carved_val_by_hash_stays_put_as_the_published_train_set_grows(
    assign: str, digits: tuple[np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    images, labels = digits
    split = SplitConfig(train=0.7, val=0.15, test=0.15, assign=assign)
    train, added, test = np.arange(1200), np.arange(1200, 1320), np.arange(1320, len(labels))

    def published_snapshot(folder: str, train_rows: np.ndarray) -> tuple[RawSnapshot, np.ndarray]:
        rows = np.concatenate([train_rows, test])
        ranges = {"train": (0, len(train_rows)), "test": (len(train_rows), len(rows))}
        return _snapshot(tmp_path / folder, images[rows], labels[rows], ranges), rows

    (small, small_rows), (grown, grown_rows) = (
        published_snapshot("a", train),
        published_snapshot("b", np.random.default_rng(2).permutation(np.concatenate([train, added]))),
    )
    parts_before, parts_after = split_indices(small, split, SEED), split_indices(grown, split, SEED)

    for parts, rows in ((parts_before, small_rows), (parts_after, grown_rows)):
        assert np.array_equal(rows[parts["test"]], test)  # exactly the published test set, in its order
    before = {name: set(small_rows[parts_before[name]].tolist()) for name in ("train", "val")}
    after = {name: set(grown_rows[parts_after[name]].tolist()) for name in ("train", "val")}
    stable = all(before[name] <= after[name] for name in ("train", "val"))
    assert stable == (assign == "hash")  # by hash every carved image stays put; a reshuffle moves some


def _indices_sha256(parts: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in SPLITS:
        digest.update(name.encode() + np.asarray(parts[name], dtype="<i8").tobytes())
    return digest.hexdigest()


def test_random_assign_gives_the_indices_it_gave_before_hash_existed(
    digits: tuple[np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    """Recorded with split_indices as it was before `split.assign` (its seeded stratified cut)."""
    images, labels = digits
    whole = split_indices(_snapshot(tmp_path / "a", images, labels), RANDOM, SEED)
    assert _indices_sha256(whole) == "a73ddf867575c9fab77c2093be3672c741051816759cf2cd2d0be6e9c04f2f7a"

    carve_labels = np.arange(300) % 7
    carve = _snapshot(
        tmp_path / "b", np.zeros((300, 1, 1, 1), np.uint8), carve_labels, {"train": (0, 200), "test": (200, 300)}
    )
    assert _indices_sha256(split_indices(carve, RANDOM, 3)) == (
        "50fbd4d1efb176577e753c7e290973b9ce47b6edd2d138cc7099651bebd31988"
    )
