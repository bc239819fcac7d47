"""download, stats and preprocess on the real default dataset (scikit-learn's digits)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tasks.core.config.data import DataConfig, SplitConfig
from tasks.core.config.params import NUMPY_STAGES
from tasks.core.config.yaml_io import load_params
from tasks.core.errors import ExpectedFailure
from tasks.data.download import download, source_unchanged
from tasks.data.formats import FORMAT, RawDataset, open_raw, read_raw, write_raw
from tasks.data.preprocess import load_split, preprocess
from tasks.data.splits import split_indices
from tasks.data.stats import channel_stats, compute_stats
from tests.conftest import client_for, copy_project, run

SPLIT = SplitConfig(train=0.7, val=0.15, test=0.15)  # assign: hash, the default (tests/data/test_splits.py)
RANDOM = SplitConfig(train=0.7, val=0.15, test=0.15, assign="random")


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("raw") / "data"
    download(DataConfig(source="digits"), out, out.parent / "cache")
    return out


def test_download_writes_the_documented_format(raw_dir: Path) -> None:
    meta = json.loads((raw_dir / "meta.json").read_text())
    assert meta == {
        "format": FORMAT,
        "source": "digits",
        "classes": [str(i) for i in range(10)],
        "num_images": 1797,
        "image_shape": [8, 8, 1],
    }
    raw = read_raw(raw_dir)
    assert raw.images.dtype == np.uint8 and raw.images.shape == (1797, 8, 8, 1)
    assert raw.images.max() == 255 and raw.images.min() == 0
    assert raw.labels.dtype == np.int64 and set(np.unique(raw.labels)) == set(range(10))
    assert sorted(p.name for p in raw_dir.iterdir()) == ["images.npy", "labels.npy", "meta.json"]


def test_digits_are_scikit_learns_load_digits_rescaled(raw_dir: Path) -> None:
    from sklearn.datasets import load_digits  # what the source reads its file as, without importing it

    bunch = load_digits()
    raw = read_raw(raw_dir)
    np.testing.assert_array_equal(raw.images[..., 0], np.rint(bunch.images * (255.0 / 16.0)).astype(np.uint8))
    np.testing.assert_array_equal(raw.labels, bunch.target)
    assert json.loads((raw_dir / "meta.json").read_text())["classes"] == [str(n) for n in bunch.target_names]


def test_reingesting_gives_identical_bytes(raw_dir: Path, tmp_path: Path) -> None:
    again = tmp_path / "data"
    download(DataConfig(source="digits"), again, tmp_path / "cache")
    assert _digest(again) == _digest(raw_dir)
    download(DataConfig(source="digits"), again, tmp_path / "cache")  # over an existing snapshot: replaced whole
    assert _digest(again) == _digest(raw_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "data"]  # no staging directories left behind


def _stat(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def test_a_source_read_again_is_unchanged_only_if_it_gives_the_snapshot_byte_for_byte(
    raw_dir: Path, tmp_path: Path
) -> None:
    """The scheduled re-read's question (flows/pipeline_flow.py): asked of a copy of the snapshot, which it
    only reads; any file added, missing or with other bytes is a change; nothing is left in the cache."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    download(DataConfig(source="digits"), data, cache)
    before, listed = _stat(data), sorted(p.name for p in cache.rglob("*"))
    assert source_unchanged(DataConfig(source="digits"), data, cache)
    assert _stat(data) == before  # not replaced, not rewritten
    assert sorted(p.name for p in cache.rglob("*")) == listed  # its staging folder is gone

    labels = data / "labels.npy"
    original = labels.read_bytes()
    labels.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # one bit of one label
    assert not source_unchanged(DataConfig(source="digits"), data, cache)
    labels.write_bytes(original)
    (data / "extra.txt").write_text("a file the source does not give\n")
    assert not source_unchanged(DataConfig(source="digits"), data, cache)
    (data / "extra.txt").unlink()
    meta = (data / "meta.json").read_bytes()
    (data / "meta.json").unlink()
    assert not source_unchanged(DataConfig(source="digits"), data, cache)
    (data / "meta.json").write_bytes(meta)
    assert not source_unchanged(DataConfig(source="digits"), tmp_path / "never-downloaded", cache)

    # a re-read killed mid-way left its staging folder (its pid in the name): the next one removes it
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = cache / "digits" / f".reread.tmp{int(dead.stdout)}.x"
    (left / "images.npy").parent.mkdir()
    (left / "images.npy").write_bytes(b"a partial copy")
    assert source_unchanged(DataConfig(source="digits"), data, cache)
    assert not left.exists() and sorted(p.name for p in cache.rglob("*")) == listed


def test_a_folder_source_with_one_more_image_is_changed(tmp_path: Path) -> None:
    from benchmarks.fakedata.imagefolder import imagefolder_tree  # PIL: only for this test's images

    photos = tmp_path / "photos"
    imagefolder_tree(photos, classes=("a", "b"), per_class=6, size=(8, 8), mode="L")
    cfg = DataConfig(source="imagefolder", path=str(photos), channels=1)
    data, cache = tmp_path / "data", tmp_path / "cache"
    download(cfg, data, cache)
    assert source_unchanged(cfg, data, cache)
    first = next((photos / "a").iterdir())
    first.with_name("copy-" + first.name).write_bytes(first.read_bytes())
    assert not source_unchanged(cfg, data, cache)
    assert read_raw(data).labels.shape == (12,)  # data/ is still the snapshot before


def test_bad_dataset_is_refused_and_previous_snapshot_kept(raw_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "data"
    download(DataConfig(source="digits"), target, tmp_path / "cache")
    before = _digest(target)
    bad = RawDataset(images=np.zeros((3, 8, 8, 2), np.uint8), labels=np.zeros(3, np.int64), classes=["a"], source="x")
    with pytest.raises(ValueError, match="C in \\(1, 3\\)"):
        write_raw(bad, target)
    assert _digest(target) == before


def test_random_split_is_stratified_seeded_disjoint_and_complete(raw_dir: Path) -> None:
    raw = open_raw(raw_dir)
    labels = raw.labels
    parts = split_indices(raw, RANDOM, seed=7)
    joined = np.concatenate(list(parts.values()))
    assert len(joined) == len(labels) and len(np.unique(joined)) == len(labels)
    for name, fraction in (("train", 0.7), ("val", 0.15), ("test", 0.15)):
        counts = np.bincount(labels[parts[name]], minlength=10)
        expected = np.bincount(labels, minlength=10) * fraction
        assert np.all(np.abs(counts - expected) <= 1), name  # every class in proportion
    again = split_indices(raw, RANDOM, seed=7)
    assert all(np.array_equal(parts[k], again[k]) for k in parts)
    other = split_indices(raw, RANDOM, seed=8)
    assert not np.array_equal(parts["test"], other["test"])


def test_stats_match_numpy_over_the_whole_training_array(raw_dir: Path) -> None:
    raw = read_raw(raw_dir)
    train_idx = split_indices(open_raw(raw_dir), SPLIT, seed=42)["train"]
    train = np.asarray(raw.images[train_idx], dtype=np.float64) / 255.0
    stats = compute_stats(raw_dir, SPLIT, seed=42, chunk_size=100)  # many chunks
    assert np.allclose(stats.mean, train.mean(axis=(0, 1, 2)), rtol=0, atol=1e-6)
    assert np.allclose(stats.std, train.std(axis=(0, 1, 2)), rtol=0, atol=1e-6)
    assert stats.num_images == len(train)


def test_rgb_stats_are_exact_and_differ_from_the_mean_of_batch_stds() -> None:
    rng = np.random.default_rng(0)
    # channels with different brightness per image, so per-batch stds miss between-batch spread
    images = (rng.integers(0, 120, (500, 6, 5, 3)) + rng.integers(0, 135, (500, 1, 1, 1))).astype(np.uint8)
    stats = channel_stats(images[i : i + 64] for i in range(0, 500, 64))
    reference = images.astype(np.float64) / 255.0
    assert np.allclose(stats.mean, reference.mean(axis=(0, 1, 2)), atol=1e-6, rtol=0)
    assert np.allclose(stats.std, reference.std(axis=(0, 1, 2)), atol=1e-6, rtol=0)
    batch_stds = np.mean([reference[i : i + 64].std(axis=(0, 1, 2)) for i in range(0, 500, 64)], axis=0)
    assert np.all(np.abs(batch_stds - np.array(stats.std)) > 1e-3)  # the common recipe is wrong


def test_preprocess_writes_uint8_splits_with_the_stats(raw_dir: Path, tmp_path: Path) -> None:
    stats = compute_stats(raw_dir, SPLIT, seed=42, chunk_size=512)
    out = tmp_path / "preprocessed"
    result = preprocess(raw_dir, stats, SPLIT, 42, out)
    raw = read_raw(raw_dir)
    parts = split_indices(open_raw(raw_dir), SPLIT, seed=42)
    for name in ("train", "val", "test"):
        split = load_split(out, name)
        assert split.images.dtype == np.uint8 and split.images.shape[1:] == (1, 8, 8)
        assert np.array_equal(split.images, raw.images[parts[name]].transpose(0, 3, 1, 2))
        assert np.array_equal(split.labels, raw.labels[parts[name]])
        assert split.mean == stats.mean and split.std == stats.std
    assert sum(result.split_sizes.values()) == 1797
    assert json.loads((out / "meta.json").read_text())["split_assign"] == "hash"
    first = _digest(out)
    preprocess(raw_dir, stats, SPLIT, 42, out)
    assert _digest(out) == first  # deterministic bytes


def test_missing_inputs_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ExpectedFailure, match="data/meta.json: missing"):
        read_raw(tmp_path / "data")
    with pytest.raises(ExpectedFailure, match="preprocessed/meta.json: missing; run the preprocess stage"):
        load_split(tmp_path / "preprocessed", "train")


@pytest.mark.slow
def test_the_data_stages_run_as_commands_without_loading_torch(tmp_path: Path) -> None:
    """`python -m tasks download|stats|preprocess` (dvc.yaml's commands) in a fresh project never load
    torch (seconds of each of their processes), and their runs still record what they were pinned by."""
    repo = copy_project(tmp_path / "repo")
    for stage in NUMPY_STAGES:
        done = run([sys.executable, "-X", "importtime", "-m", "tasks", stage], repo)
        loaded = {
            line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")
        }
        assert "numpy" in loaded and not {"torch", "torchvision"} & loaded, stage
    client = client_for(repo)
    runs = client.search_runs([client.get_experiment_by_name("lockstep").experiment_id])
    tags = {r.data.tags["lockstep.stage"]: r.data.tags for r in runs if "lockstep.stage" in r.data.tags}
    assert set(tags) == set(NUMPY_STAGES)
    for stage, tagged in tags.items():
        assert tagged["determinism.PYTHONHASHSEED"] == str(load_params(repo / "params.yaml").seed), stage
        assert tagged["determinism.torch"] == "not loaded: the stage computes with numpy alone", stage
        assert tagged["determinism.cpu"] == tagged["hw.cpu.mode"] and tagged["hw.version.numpy"] == np.__version__
        assert "hw.version.torch" not in tagged and "hw.cpu.model" in tagged, stage
