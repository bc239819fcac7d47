"""The download stage against a real HTTP server on 127.0.0.1 serving the published formats.

The archives are built by benchmarks/fakedata/ in the real formats (MNIST idx .gz, CIFAR python
.tar.gz, ImageFolder .tar.gz/.zip). For the torchvision sources only the catalogue differs from
what users get (the published URLs and md5s on torchvision's dataset classes point at the test
server and the test files); the code path is the one `python -m tasks download` runs.

Every failure case checks that data/ is exactly what it was before.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torchvision.datasets

from benchmarks.fakedata.archives import pack
from benchmarks.fakedata.cifar import cifar_archive
from benchmarks.fakedata.hostile_archives import tar_with_member, tar_with_symlink, zip_with_member, zip_with_symlink
from benchmarks.fakedata.imagefolder import imagefolder_tree
from benchmarks.fakedata.mnist import mnist_files
from benchmarks.httpserver import FileServer
from tasks.core.config.data import DataConfig, SplitConfig
from tasks.core.errors import ExpectedFailure
from tasks.core.fetch import Checksum, DownloadError, Retry, _exclusive, fetch
from tasks.data.download import download
from tasks.data.formats import open_raw, read_raw
from tasks.data.images import IMG_EXTENSIONS
from tasks.data.splits import split_indices
from tasks.data.stats import compute_stats
from tests.conftest import ROOT, copy_project, run, subprocess_env

FAST = Retry(attempts=4, backoff_s=0.05, timeout_s=2.0)  # real backoff, test-sized


@pytest.fixture
def server() -> Iterator[FileServer]:
    with FileServer(hang_s=30) as srv:
        yield srv


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A data/ that already holds a snapshot (digits), so failures can be checked to keep it."""
    out = tmp_path / "data"
    download(DataConfig(source="digits"), out, tmp_path / "cache")
    return out


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _folder_cfg(url: str, sha256: str, **extra: object) -> DataConfig:
    return DataConfig(source="imagefolder", url=url, sha256=sha256, **extra)


# --- success for each source -------------------------------------------------------------------


@pytest.mark.parametrize("source", ["mnist", "fashion_mnist"])
def test_mnist_sources_ingest_train_then_test(
    source: str, tmp_path: Path, server: FileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = torchvision.datasets.MNIST if source == "mnist" else torchvision.datasets.FashionMNIST
    files = mnist_files(tmp_path / "files", n_train=60, n_test=20)
    for name, _ in files.resources:
        server.add_file(f"/{source}/{name}", tmp_path / "files" / name)
    monkeypatch.setattr(cls, "resources", files.resources)
    # the first published mirror is down (404): the next one is tried, as torchvision does
    monkeypatch.setattr(cls, "mirrors", [f"{server.url}/gone/", f"{server.url}/{source}/"])

    result = download(DataConfig(source=source), tmp_path / "data", tmp_path / "cache", FAST)

    raw = read_raw(tmp_path / "data")
    assert raw.images.shape == (80, 28, 28, 1) and result.image_shape == (28, 28, 1)
    assert np.array_equal(raw.images[:60, ..., 0], files.train_images)
    assert np.array_equal(raw.images[60:, ..., 0], files.test_images)
    assert np.array_equal(raw.labels, np.concatenate([files.train_labels, files.test_labels]))
    assert raw.classes == list(cls.classes) and raw.source == source
    assert result.files == {name: f"md5:{md5}" for name, md5 in files.resources}


@pytest.mark.parametrize("variant", ["cifar10", "cifar100"])
def test_cifar_sources_ingest_rgb_with_exact_stats(
    variant: str, tmp_path: Path, server: FileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = cifar_archive(tmp_path / "files", variant)
    cls = torchvision.datasets.CIFAR10 if variant == "cifar10" else torchvision.datasets.CIFAR100
    server.add_file(f"/mirror/{archive.path.name}", archive.path)
    for name in ("tgz_md5", "train_list", "test_list", "meta"):
        monkeypatch.setattr(cls, name, getattr(archive, name))
    cfg = DataConfig(source=variant, mirror=f"{server.url}/mirror/")  # the air-gapped site's mirror

    download(cfg, tmp_path / "data", tmp_path / "cache", FAST)

    raw = read_raw(tmp_path / "data")
    assert raw.images.shape[1:] == (32, 32, 3)
    assert np.array_equal(raw.images, np.concatenate([archive.train_images, archive.test_images]))
    assert np.array_equal(raw.labels, np.concatenate([archive.train_labels, archive.test_labels]))
    assert raw.classes == list(archive.classes)
    # RGB stats of the ingested data against a float64 numpy reference over the whole split
    split = SplitConfig(train=0.6, val=0.2, test=0.2)
    stats = compute_stats(tmp_path / "data", split, seed=3, chunk_size=7)
    train = raw.images[split_indices(open_raw(tmp_path / "data"), split, 3)["train"]].astype(np.float64) / 255.0
    assert np.allclose(stats.mean, train.mean(axis=(0, 1, 2)), rtol=0, atol=1e-6)
    assert np.allclose(stats.std, train.std(axis=(0, 1, 2)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_imagefolder_archive_url_with_mixed_sizes_is_resized(kind: str, tmp_path: Path, server: FileServer) -> None:
    tree = imagefolder_tree(tmp_path / "tree", per_class=3, size=[(12, 10), (9, 14), (20, 20)])
    (tmp_path / "tree" / "cat" / "notes.txt").write_text("not an image")  # skipped and reported
    sha = pack(tmp_path / "tree", tmp_path / f"pets.{kind}", kind, prefix="pets")
    url = server.add_file(f"/pets.{kind}", tmp_path / f"pets.{kind}")

    result = download(_folder_cfg(url, sha, image_size=[8, 6]), tmp_path / "data", tmp_path / "cache", FAST)

    raw = read_raw(tmp_path / "data")
    assert raw.images.shape == (9, 8, 6, 3) and raw.classes == sorted(tree)
    assert raw.labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert result.skipped_files == 1 and result.files == {f"pets.{kind}": f"sha256:{sha}"}


def test_imagefolder_local_folder_greyscale_and_same_bytes_twice(tmp_path: Path) -> None:
    imagefolder_tree(tmp_path / "tree", per_class=2, size=(7, 5))
    cfg = DataConfig(source="imagefolder", path=str(tmp_path / "tree"), channels=1)
    download(cfg, tmp_path / "a", tmp_path / "cache")
    download(cfg, tmp_path / "b", tmp_path / "cache")
    assert read_raw(tmp_path / "a").images.shape == (6, 5, 7, 1)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")


def test_our_image_extensions_are_torchvisions() -> None:
    from torchvision.datasets.folder import IMG_EXTENSIONS as TORCHVISION

    assert tuple(IMG_EXTENSIONS) == tuple(TORCHVISION)


# --- robustness: retries, truncation, corruption, cache, lock ------------------------------------


def test_two_503s_then_success(tmp_path: Path, server: FileServer) -> None:
    payload = b"lockstep" * 5000
    url = server.add("/f.bin", payload)
    server.fail("/f.bin", "503", "503")
    path = fetch([url], tmp_path / "f.bin", Checksum("sha256", hashlib.sha256(payload).hexdigest()), FAST)
    assert path.read_bytes() == payload and server.count("/f.bin") == 3


def test_truncated_transfer_resumes_and_verifies(tmp_path: Path, server: FileServer) -> None:
    payload = bytes(range(256)) * 400
    url = server.add("/f.bin", payload)
    server.fail("/f.bin", "truncate")
    path = fetch([url], tmp_path / "f.bin", Checksum("sha256", hashlib.sha256(payload).hexdigest()), FAST)
    assert path.read_bytes() == payload and server.count("/f.bin") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin", "f.bin.lock"]  # no .part left


def test_hung_server_times_out_and_retries(tmp_path: Path, server: FileServer) -> None:
    payload = b"x" * 1000
    url = server.add("/f.bin", payload)
    server.fail("/f.bin", "hang")
    retry = Retry(attempts=2, backoff_s=0.01, timeout_s=0.5)
    started = time.monotonic()
    fetch([url], tmp_path / "f.bin", Checksum("sha256", hashlib.sha256(payload).hexdigest()), retry)
    assert time.monotonic() - started < 10 and server.count("/f.bin") == 2


def test_verified_file_in_cache_is_reused_without_network(tmp_path: Path, server: FileServer) -> None:
    payload = b"y" * 100
    url = server.add("/f.bin", payload)
    checksum = Checksum("sha256", hashlib.sha256(payload).hexdigest())
    fetch([url], tmp_path / "f.bin", checksum, FAST)
    fetch([url], tmp_path / "f.bin", checksum, FAST)
    assert server.count("/f.bin") == 1


def test_a_second_process_waits_for_the_downloader_then_reuses_its_file(tmp_path: Path, server: FileServer) -> None:
    """What DDP ranks (or two runs) sharing a cache do: one downloads, the others wait."""
    payload = b"z" * 4096
    url = server.add("/f.bin", payload)
    sha = hashlib.sha256(payload).hexdigest()
    code = (
        "import sys; from pathlib import Path; from tasks.core.fetch import Checksum, fetch; "
        f"fetch([{url!r}], Path(sys.argv[1]), Checksum('sha256', {sha!r}))"
    )
    with _exclusive(tmp_path / "f.bin"):  # this test process is "the downloader"
        waiter = subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "f.bin")],
            cwd=ROOT,
            env=subprocess_env(),
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(3)
        assert waiter.poll() is None  # still waiting for the lock
        (tmp_path / "f.bin").write_bytes(payload)
    _, stderr = waiter.communicate(timeout=60)
    assert waiter.returncode == 0, stderr
    assert "another process is downloading it; waiting" in stderr
    assert server.count("/f.bin") == 0  # the waiter reused the file instead of downloading it


def test_404_is_not_retried_and_names_the_url(tmp_path: Path, server: FileServer) -> None:
    with pytest.raises(DownloadError, match=r"f\.bin: http://127\.0\.0\.1:\d+/f\.bin: HTTP 404"):
        fetch([f"{server.url}/f.bin"], tmp_path / "f.bin", Checksum("sha256", "0" * 64), FAST)
    assert server.count("/f.bin") == 1


# --- each bad case: a clear error, and data/ exactly as before ----------------------------------


def test_corrupt_download_is_refused_with_both_checksums(
    tmp_path: Path, server: FileServer, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = cifar_archive(tmp_path / "files", "cifar10")
    corrupt = bytearray(archive.path.read_bytes())
    corrupt[len(corrupt) // 2] ^= 0xFF
    server.add("/cifar-10-python.tar.gz", bytes(corrupt))
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "tgz_md5", archive.tgz_md5)
    before = _digest(data_dir)
    got = hashlib.md5(corrupt).hexdigest()
    expected = f"checksum mismatch for cifar-10-python.tar.gz: expected {archive.tgz_md5}, got {got}"
    with pytest.raises(DownloadError, match=expected):
        download(DataConfig(source="cifar10", mirror=server.url), data_dir, tmp_path / "cache", FAST)
    assert _digest(data_dir) == before
    assert list((tmp_path / "cache" / "cifar10").glob("cifar-10-python.tar.gz*")) == [
        tmp_path / "cache" / "cifar10" / "cifar-10-python.tar.gz.lock"
    ]  # neither the corrupt file nor a .part is kept


def test_truncated_every_time_fails_after_the_retries(tmp_path: Path, server: FileServer, data_dir: Path) -> None:
    imagefolder_tree(tmp_path / "tree")
    tree_sha = pack(tmp_path / "tree", tmp_path / "a.tar.gz", "tar.gz")
    url = server.add_file("/a.tar.gz", tmp_path / "a.tar.gz")
    server.fail("/a.tar.gz", *["truncate"] * 4)
    before = _digest(data_dir)
    # each retry resumes where the last one stopped, so halving the rest 4 times cannot finish it
    failed = r"a\.tar\.gz: .* failed after 4 attempts: (truncated|transfer interrupted)"
    with pytest.raises(DownloadError, match=failed):
        download(_folder_cfg(url, tree_sha), data_dir, tmp_path / "cache", FAST)
    assert _digest(data_dir) == before and server.count("/a.tar.gz") == 4


UNSAFE = {
    "tar-dotdot": (lambda a: tar_with_member(a, "../evil.txt"), "has an absolute path or '..'"),
    "tar-absolute": (lambda a: tar_with_member(a, "/tmp/lockstep-evil.txt"), "has an absolute path or '..'"),
    "tar-symlink-out": (
        lambda a: tar_with_symlink(a, "imgs/link", "../../outside", then_file="imgs/link/evil.txt"),
        "link pointing outside",
    ),
    "tar-symlink-abs": (lambda a: tar_with_symlink(a, "imgs/etc", "/etc"), "link pointing outside"),
    "zip-dotdot": (lambda a: zip_with_member(a, "cat/../../evil.txt"), "has an absolute path or '..'"),
    "zip-symlink": (lambda a: zip_with_symlink(a, "cat/link", "/etc/passwd"), "symbolic link"),
}


@pytest.mark.parametrize("case", sorted(UNSAFE))
def test_unsafe_archives_are_refused_whole(case: str, tmp_path: Path, server: FileServer, data_dir: Path) -> None:
    build, reason = UNSAFE[case]
    archive = tmp_path / ("evil.zip" if case.startswith("zip") else "evil.tar.gz")
    sha = build(archive)
    url = server.add_file(f"/{archive.name}", archive)
    before = _digest(data_dir)
    with pytest.raises(ExpectedFailure, match=f"{archive.name}: refusing to extract, member .* {reason}"):
        download(_folder_cfg(url, sha), data_dir, tmp_path / "cache", FAST)
    assert _digest(data_dir) == before
    assert not (tmp_path / "evil.txt").exists() and not Path("/tmp/lockstep-evil.txt").exists()
    assert not list((tmp_path / "cache").rglob("evil.txt"))  # nothing extracted anywhere


def test_empty_class_folder_is_an_error_naming_it(tmp_path: Path, data_dir: Path) -> None:
    imagefolder_tree(tmp_path / "tree")
    (tmp_path / "tree" / "zebra").mkdir()
    before = _digest(data_dir)
    with pytest.raises(ExpectedFailure, match=r"tree/zebra: class folder has no images"):
        download(DataConfig(source="imagefolder", path=str(tmp_path / "tree")), data_dir, tmp_path / "cache")
    assert _digest(data_dir) == before


def test_corrupt_image_is_an_error_naming_it(tmp_path: Path, data_dir: Path) -> None:
    files = imagefolder_tree(tmp_path / "tree")
    bad = files["dog"][1]
    bad.write_bytes(bad.read_bytes()[:40])  # a PNG cut short
    before = _digest(data_dir)
    with pytest.raises(ExpectedFailure, match=f"{bad}: not a readable image"):
        download(DataConfig(source="imagefolder", path=str(tmp_path / "tree")), data_dir, tmp_path / "cache")
    assert _digest(data_dir) == before


def test_mixed_sizes_without_image_size_say_how_to_fix(tmp_path: Path, data_dir: Path) -> None:
    imagefolder_tree(tmp_path / "tree", size=[(12, 10), (9, 14)])
    with pytest.raises(ExpectedFailure, match=r"set data.image_size: \[height, width\]"):
        download(DataConfig(source="imagefolder", path=str(tmp_path / "tree")), data_dir, tmp_path / "cache")


def test_stage_command_prints_one_line_and_exits_1(tmp_path: Path, server: FileServer) -> None:
    project = copy_project(
        tmp_path / "p",
        {"data": {"source": "imagefolder", "url": f"{server.url}/missing.zip", "sha256": "0" * 64, "retries": 0}},
    )
    done = run(
        [sys.executable, "-m", "tasks", "download"],
        project,
        check=False,
        LOCKSTEP_DOWNLOAD_CACHE=str(tmp_path / "cache"),
    )
    assert done.returncode == 1
    assert "error: download: missing.zip: http://127.0.0.1" in done.stderr and "HTTP 404" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (project / "data").exists()
