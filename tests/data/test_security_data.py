"""Issue 18, the data side: hostile servers, archives, images and folders are refused, and download
credentials never reach a message, a log line or a file.

Each test plants the attack (a loopback server from benchmarks/httpserver.py, an archive or a folder
built here) and shows it refused: one line naming the file or URL, and nothing written (data/ as it
was, no extracted or partial file left). In-process, tiny inputs; two subprocesses show the exit
codes (1 for a bomb, 2 for an unbounded param). Credentials: test_security_credentials.py.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import sys
import tarfile
import time
import unicodedata
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

import tasks.data.folders
from benchmarks.fakedata.archives import pack
from benchmarks.fakedata.imagefolder import imagefolder_tree
from benchmarks.httpserver import FileServer
from tasks.core.config.base import ConfigError
from tasks.core.config.data import DataConfig
from tasks.core.config.yaml_io import load_params
from tasks.core.errors import ExpectedFailure
from tasks.core.fetch import DownloadError, Retry, fetch
from tasks.data.download import download
from tasks.data.formats import read_raw
from tests.conftest import ROOT, copy_project, run, write_params
from tests.support.untrusted_data import FAST, checksum, digests

pytestmark = pytest.mark.usefixtures("no_user_credentials")


def _only_locks(folder: Path) -> bool:
    """Nothing but lock files left under `folder`: no partial download, no extracted member."""
    return all(p.name.endswith(".lock") for p in folder.rglob("*") if p.is_file())


def _folder(path: Path, **extra: object) -> DataConfig:
    return DataConfig(source="imagefolder", path=str(path), **extra)


# --- 5. downloads: size cap, deadline, malformed Content-Length -------------------------------------


@pytest.mark.parametrize("behaviour", ["nolength", "ok"])
def test_a_download_larger_than_the_cap_is_refused(behaviour: str, tmp_path: Path, server: FileServer) -> None:
    """Counted while streaming (no Content-Length: the server may lie or send none), and from the header."""
    url = server.add("/big.bin", b"z" * 5000)
    server.fail("/big.bin", behaviour)
    with pytest.raises(DownloadError) as refused:
        fetch([url], tmp_path / "big.bin", checksum(b"z" * 5000), FAST, max_bytes=1000)
    message = str(refused.value)
    assert "big.bin" in message and "more than data.max_download_bytes (1000)" in message and "\n" not in message
    assert ("announced" in message) == (behaviour == "ok")
    assert not refused.value.transient and server.count("/big.bin") == 1  # not retried
    assert _only_locks(tmp_path)


@pytest.mark.parametrize("behaviour", ["drip", "dripheaders"])
def test_a_server_sending_a_byte_at_a_time_is_given_up_at_the_deadline(
    behaviour: str, tmp_path: Path, server: FileServer
) -> None:
    """Body or headers: each byte arrives well within the read timeout; at 20 bytes/s the whole takes 100 s."""
    payload = b"s" * 2000
    url = server.add("/slow.bin", payload)
    server.fail("/slow.bin", behaviour, behaviour, behaviour)
    started = time.monotonic()
    with pytest.raises(DownloadError, match=r"slow\.bin: .*not complete within data\.deadline_s \(1 s"):
        fetch([url], tmp_path / "slow.bin", checksum(payload), Retry(attempts=3, timeout_s=0.5, deadline_s=1.0))
    assert time.monotonic() - started < 5
    assert _only_locks(tmp_path)


def test_the_deadline_bounds_the_retries_too(tmp_path: Path, server: FileServer) -> None:
    url = server.add("/down.bin", b"d")
    server.fail("/down.bin", *["503"] * 10)
    started = time.monotonic()
    with pytest.raises(DownloadError, match="no time left for another attempt within data.deadline_s"):
        fetch([url], tmp_path / "down.bin", checksum(b"d"), Retry(attempts=10, backoff_s=0.4, deadline_s=1.0))
    assert time.monotonic() - started < 3 and server.count("/down.bin") < 10


@pytest.mark.parametrize("length", ["abc", "-5", "1_0", "9" * 30])
def test_a_malformed_content_length_is_one_line_not_a_traceback(
    length: str, tmp_path: Path, server: FileServer
) -> None:
    url = server.add("/f.bin", b"0123456789")
    server.fail("/f.bin", f"length:{length}")
    with pytest.raises(
        DownloadError, match=r"f\.bin: http://127\.0\.0\.1:\d+/f\.bin: the server sent an invalid Content-Length"
    ):
        fetch([url], tmp_path / "f.bin", checksum(b"0123456789"), FAST)
    assert _only_locks(tmp_path)


# --- 5. archives: bombs ---------------------------------------------------------------------------


def _tar_gz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


NOISE = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()  # does not compress
BOMBS = {
    # 8 MiB of zeros in ~8 KB: ~1000x, refused by the default ratio (100) long before 8 MiB are read
    "ratio": ({"cat/zeros.png": bytes(8 << 20), "dog/zeros.png": b"x"}, {}, "it expands more than 100 times"),
    "size": ({"cat/noise.png": NOISE, "dog/x.png": b"x"}, {"max_extracted_bytes": 2 << 20}, "more than 2097152 bytes"),
    "count": ({f"cat/{i}.png": b"x" for i in range(50)}, {"max_archive_files": 20}, "more than 20 members"),
}


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_archive_bombs_are_refused_before_anything_is_extracted(
    bomb: str, kind: str, tmp_path: Path, server: FileServer, data_dir: Path
) -> None:
    members, limits, reason = BOMBS[bomb]
    data = _tar_gz(members) if kind == "tar.gz" else _zip(members)
    url = server.add(f"/bomb.{kind}", data)
    before = digests(data_dir)
    cfg = DataConfig(source="imagefolder", url=url, sha256=hashlib.sha256(data).hexdigest(), **limits)
    with pytest.raises(ExpectedFailure, match=f"bomb.{kind}: refusing to extract, {reason}"):
        download(cfg, data_dir, tmp_path / "cache", FAST)
    assert digests(data_dir) == before
    extracted = [p for p in (tmp_path / "cache").rglob("*") if p.suffix == ".png"]
    assert extracted == []  # not one member written


# --- 5. images: pixel cap, no buffer sized before every size is checked, decoded-size cap ----------


def _big_png(path: Path, width: int = 9500, height: int = 9500) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("1", (width, height)).save(path)  # 1 bit per pixel: ~11 MB in memory, ~15 KB on disk
    return path


@pytest.mark.parametrize("image_size", [None, (8, 8)])
def test_a_decompression_bomb_image_is_refused_naming_it(
    image_size: tuple[int, int] | None, tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """9500x9500 was only a PIL warning (its limit is 89 M pixels); decoded, it takes 270 MB as RGB."""
    imagefolder_tree(tmp_path / "tree", per_class=1)
    bomb = _big_png(tmp_path / "tree" / "dog" / "huge.png")
    loaded: list[tuple[int, int]] = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loaded.append(self.size) or real_load(self))
    before = digests(data_dir)
    with warnings.catch_warnings(record=True) as warned, pytest.raises(ExpectedFailure) as refused:
        warnings.simplefilter("always")
        download(_folder(tmp_path / "tree", image_size=image_size), data_dir, tmp_path / "cache")
    assert str(refused.value) == f"{bomb}: 9500x9500 = 90250000 pixels, more than data.max_image_pixels (50000000)"
    assert (9500, 9500) not in loaded  # its pixels were never decoded
    assert not [w for w in warned if issubclass(w.category, Image.DecompressionBombWarning)]
    assert digests(data_dir) == before


def test_a_large_first_image_sizes_no_buffer_before_every_size_is_checked(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report: a first 9500x9500 image sized a 512x9500x9500x3 block (129 GiB) and died in a traceback."""
    imagefolder_tree(tmp_path / "tree", per_class=2, size=(12, 10))
    first = _big_png(tmp_path / "tree" / "cat" / "a_first.png", 4000, 4000)  # sorts first; within the pixel cap
    monkeypatch.setattr(tasks.data.folders, "decode", lambda *a: pytest.fail("decoded before the sizes were checked"))
    mismatch = rf"cat_0\.png: 12x10 pixels, but {re.escape(str(first))} is 4000x4000; set data\.image_size"
    with pytest.raises(ExpectedFailure, match=mismatch):
        download(_folder(tmp_path / "tree"), data_dir, tmp_path / "cache")
    cfg = _folder(tmp_path / "tree", image_size=(4000, 4000), max_dataset_bytes=100 << 20)
    too_big = r"7 images of 4000x4000x3 decode to 336000000 bytes, more than data\.max_dataset_bytes \(104857600\)"
    with pytest.raises(ExpectedFailure, match=too_big):
        download(cfg, data_dir, tmp_path / "cache")


def test_blocks_are_bounded_in_bytes_and_give_the_same_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    imagefolder_tree(tmp_path / "tree", per_class=3, size=(7, 5))
    download(_folder(tmp_path / "tree"), tmp_path / "a", tmp_path / "cache")
    monkeypatch.setattr(tasks.data.folders, "BLOCK_BYTES", 1)  # one image per block
    download(_folder(tmp_path / "tree"), tmp_path / "b", tmp_path / "cache")
    assert digests(tmp_path / "a") == digests(tmp_path / "b")


# --- 5/6. every numeric data key is bounded: a ConfigError (exit 2), not a traceback ----------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("timeout_s", 1e300),
        ("deadline_s", 1e300),
        ("retries", 10**9),
        ("max_download_bytes", 2**63),
        ("max_image_pixels", 10**9),
        ("max_compression_ratio", 0.5),
        ("max_archive_files", 0),
        ("image_size", [100_000, 100_000]),
        ("url", "https://x.org/" + "a" * 5000),
    ],
)
def test_data_keys_are_bounded(key: str, value: object, tmp_path: Path) -> None:
    extra = {"source": "imagefolder", "path": "p"} if key == "image_size" else {}
    path = write_params(tmp_path / "params.yaml", {"data": {**extra, key: value}})
    with pytest.raises(ConfigError, match=rf"params\.yaml: data\.{key}: "):
        load_params(path)


def test_an_unbounded_param_exits_2_with_one_line_and_writes_nothing(tmp_path: Path) -> None:
    write_params(tmp_path / "params.yaml", {"data": {"timeout_s": 1e300}})
    done = run([sys.executable, "-m", "tasks", "download"], tmp_path, check=False, PYTHONPATH=str(ROOT))
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.strip().count("\n") == 0
        and "data.timeout_s: Input should be less than or equal to 3600" in done.stderr
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


def test_a_bomb_through_the_stage_command_is_one_line_exit_1_nothing_left(tmp_path: Path, server: FileServer) -> None:
    data = _zip(BOMBS["ratio"][0])
    url = server.add("/pets.zip", data)
    data_params = {"source": "imagefolder", "url": url, "sha256": hashlib.sha256(data).hexdigest()}
    project = copy_project(tmp_path / "p", {"data": data_params, "tracking": {"enabled": False}})  # MLflow: +15 s
    cache = tmp_path / "cache"
    done = run([sys.executable, "-m", "tasks", "download"], project, check=False, LOCKSTEP_DOWNLOAD_CACHE=str(cache))
    assert done.returncode == 3
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("error: download: pets.zip: refusing to extract, it expands more than 100 times (")
    assert "Traceback" not in done.stderr
    assert not (project / "data").exists() and not [p for p in cache.rglob("*.png")]


# --- 7. datasets: links, special files, names, class names ----------------------------------------


def test_a_symlink_inside_an_archive_is_refused(tmp_path: Path, server: FileServer, data_dir: Path) -> None:
    imagefolder_tree(tmp_path / "tree", classes=("dog", "fish"), per_class=1)
    os.symlink(".", tmp_path / "tree" / "cat")  # every image a second time, under "cat"
    sha = pack(tmp_path / "tree", tmp_path / "pets.tar.gz", "tar.gz")
    url = server.add_file("/pets.tar.gz", tmp_path / "pets.tar.gz")
    before = digests(data_dir)
    with pytest.raises(ExpectedFailure, match=r"pets\.tar\.gz: refusing to extract, member 'cat' is a link \('\.'\)"):
        download(DataConfig(source="imagefolder", url=url, sha256=sha), data_dir, tmp_path / "cache", FAST)
    assert digests(data_dir) == before


@pytest.mark.parametrize("link", ["class", "file", "outside"])
def test_links_in_a_local_folder_are_not_followed(link: str, tmp_path: Path, data_dir: Path) -> None:
    files = imagefolder_tree(tmp_path / "tree", per_class=1)
    secret = tmp_path / "secret.png"
    secret.write_bytes(files["cat"][0].read_bytes())
    planted = {
        "class": (tmp_path / "tree" / "wolf", tmp_path / "tree" / "dog"),
        "file": (tmp_path / "tree" / "cat" / "b.png", files["dog"][0]),
        "outside": (tmp_path / "tree" / "cat" / "c.png", secret),
    }
    path, target = planted[link]
    os.symlink(target, path)
    before = digests(data_dir)
    with pytest.raises(ExpectedFailure, match=rf"^{re.escape(str(path))}: a symbolic link; links are not followed"):
        download(_folder(tmp_path / "tree"), data_dir, tmp_path / "cache")
    assert digests(data_dir) == before


def test_a_fifo_named_like_an_image_is_refused_not_opened(tmp_path: Path, data_dir: Path) -> None:
    imagefolder_tree(tmp_path / "tree", per_class=1)
    os.mkfifo(tmp_path / "tree" / "cat" / "pipe.png")  # opening it would block forever
    with pytest.raises(ExpectedFailure, match=r"cat/pipe\.png: not a regular file or folder"):
        download(_folder(tmp_path / "tree"), data_dir, tmp_path / "cache")


@pytest.mark.parametrize(
    ("where", "name", "shown"),
    [
        ("cat", "a\nINFO tasks.train.stage: forged.png", r"a\nINFO tasks.train.stage: forged.png"),
        ("cat", "evil\u202egnp.png", r"evil\u202egnp.png"),
        ("", "cr\rclass", r"cr\rclass"),
        ("dog", "\x1b[2Jclear.png", r"\x1b[2Jclear.png"),
    ],
)
def test_names_with_control_characters_are_refused_on_one_line(
    where: str, name: str, shown: str, tmp_path: Path, data_dir: Path
) -> None:
    imagefolder_tree(tmp_path / "tree", per_class=1)
    planted = tmp_path / "tree" / where / name
    if where:
        planted.write_bytes((tmp_path / "tree" / "cat" / "cat_0.png").read_bytes())
    else:
        planted.mkdir()  # a class folder
    before = digests(data_dir)
    with pytest.raises(ExpectedFailure) as refused:
        download(_folder(tmp_path / "tree"), data_dir, tmp_path / "cache")
    expected = os.path.join(tmp_path / "tree", where, shown)
    assert str(refused.value) == f"{expected}: name holds a control character; rename it (it would forge log lines)"
    assert digests(data_dir) == before


def test_a_class_name_that_is_not_utf8_is_refused_before_training(tmp_path: Path, data_dir: Path) -> None:
    imagefolder_tree(tmp_path / "tree", per_class=1)
    tree = os.fsencode(tmp_path / "tree")
    os.rename(tree + b"/dog", tree + b"/d\xf6g")  # Latin-1, as old tar files have it
    with pytest.raises(ExpectedFailure) as refused:
        download(_folder(tmp_path / "tree"), data_dir, tmp_path / "cache")
    assert (
        str(refused.value)
        == f"{tmp_path / 'tree'}/d\\xf6g: name is not valid UTF-8; rename it (names reach logs and the model)"
    )


@pytest.mark.parametrize(
    "pair", [("Cat", "cat"), (unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "CAFÉ"))]
)
def test_class_names_that_differ_only_in_case_or_unicode_form_are_refused(
    pair: tuple[str, str], tmp_path: Path, data_dir: Path
) -> None:
    imagefolder_tree(tmp_path / "tree", classes=(*pair, "dog"), per_class=1)
    first, second = sorted(pair)
    with pytest.raises(
        ExpectedFailure, match=f"class folders {first!r} and {second!r} differ only in case or Unicode form"
    ):
        download(_folder(tmp_path / "tree"), data_dir, tmp_path / "cache")
    assert read_raw(data_dir).classes == ["a", "b"]  # the previous snapshot
