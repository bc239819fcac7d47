"""Tar headers that are bombs of their own (tasks/core/tar.py BoundedTarInfo, tasks/data/archive.py):
tarfile reads a GNU long name/link or a pax header whole, and recurses once per header, before the
member reaches the archive's size limits. Each is refused before it is read, naming the archive, and
nothing is extracted; ordinary long names, pax and global headers still extract."""

from __future__ import annotations

import gzip
import io
import tarfile
import time
import tracemalloc
from pathlib import Path

import pytest

import tasks.core.tar
from tasks.core.errors import ExpectedFailure
from tasks.data.archive import ArchiveLimits, UnsafeArchiveError, extract

LIMITS = ArchiveLimits(max_bytes=10 << 20, max_ratio=100, max_files=1000)
DECLARED = 16 << 20  # a header's payload: read whole, 16 MiB in memory, before the fix


def _member(name: str, data: bytes) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info.tobuf(tarfile.USTAR_FORMAT) + data + bytes(-len(data) % 512)


def _header(kind: bytes, size: int) -> bytes:
    info = tarfile.TarInfo("././@LongLink" if kind in b"LK" else "././@PaxHeader")
    info.size, info.type = size, kind
    return info.tobuf(tarfile.USTAR_FORMAT)


def _pax(records: dict[str, str], kind: bytes = tarfile.XHDTYPE) -> bytes:
    body = b"".join(_record(k, v) for k, v in records.items())
    return _header(kind, len(body)) + body + bytes(-len(body) % 512)


def _record(keyword: str, value: str) -> bytes:
    line = f" {keyword}={value}\n".encode()
    n = len(line)
    while n != len(line) + len(str(n)):  # the length counts its own digits
        n = len(line) + len(str(n))
    return str(n).encode() + line


def _write(path: Path, raw: bytes) -> Path:
    end = bytes(1024)  # two zero blocks
    path.write_bytes(gzip.compress(raw + end, mtime=0) if path.name.endswith(".gz") else raw + end)
    return path


def _refused(archive: Path, reason: str, error: type[Exception] = UnsafeArchiveError) -> ExpectedFailure:
    with pytest.raises(error, match=f"^{archive.name}: {reason}") as caught:
        extract(archive, archive.parent / "out", LIMITS)
    assert not (archive.parent / "out").exists()  # nothing half-written
    assert len(str(caught.value)) < 500
    return caught.value


@pytest.mark.parametrize("kind", [b"L", b"K", b"x", b"g"])
def test_a_huge_extended_header_is_refused_before_it_is_read(kind: bytes, tmp_path: Path) -> None:
    # 16 MiB of payload in ~16 KB of gzip; the fix never reads it (the reviewer's 256 MiB one took 2 GiB)
    raw = _header(kind, DECLARED) + b"a" * DECLARED + _member("cat/a.png", b"x")
    archive = _write(tmp_path / "bomb.tar.gz", raw)
    tracemalloc.start()
    try:
        _refused(archive, f"refusing to extract, a .* header of {DECLARED} bytes")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak


def test_a_huge_header_in_a_plain_tar_is_refused_too(tmp_path: Path) -> None:
    archive = _write(tmp_path / "bomb.tar", _header(b"L", (1 << 33) - 1) + _member("cat/a.png", b"x"))  # 8 GiB declared
    _refused(archive, "refusing to extract, a GNU long name or link header of 8589934591 bytes")


def test_a_chain_of_extended_headers_is_refused_not_a_recursion_error(tmp_path: Path) -> None:
    raw = _pax({"comment": "x"}) * 3000 + _member("cat/a.png", b"x")  # 1.5 MB, 12 KB of gzip
    started = time.monotonic()
    _refused(_write(tmp_path / "chain.tar.gz", raw), "refusing to extract, more than 8 extended headers")
    assert time.monotonic() - started < 10


def test_a_recursion_error_is_one_line_naming_the_archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasks.core.tar, "MAX_EXTENDED_CHAIN", 1 << 30)  # the backstop behind the count
    raw = _pax({"comment": "x"}) * 3000 + _member("cat/a.png", b"x")
    archive = _write(tmp_path / "chain.tar.gz", raw)
    _refused(archive, "not a readable tar archive: headers nested too deep", ExpectedFailure)


def test_a_global_header_setting_many_keywords_is_refused(tmp_path: Path) -> None:
    raw = _pax({f"k{i}": "v" for i in range(100)}, tarfile.XGLTYPE) + _member("cat/a.png", b"x")
    _refused(_write(tmp_path / "global.tar", raw), "refusing to extract, global pax headers setting more than 64")


def test_extended_headers_count_toward_the_size_limit(tmp_path: Path) -> None:
    # 40 members with 60 KiB of pax comment each: 2.4 MB held in memory by tarfile, and nothing on disk
    raw = b"".join(_pax({"comment": "c" * (60 << 10)}) + _member(f"cat/{i}.png", b"x") for i in range(40))
    archive = _write(tmp_path / "padded.tar", raw)
    with pytest.raises(UnsafeArchiveError, match="^padded.tar: refusing to extract, more than 1048576 bytes"):
        extract(archive, tmp_path / "out", ArchiveLimits(max_bytes=1 << 20, max_ratio=100, max_files=1000))


def test_a_long_member_name_is_cut_short_in_the_message(tmp_path: Path) -> None:
    name = "/" + "a" * 60_000  # absolute: refused; a 60 KB name within the header cap
    raw = _pax({"path": name}) + _member("x", b"x")
    error = _refused(_write(tmp_path / "long.tar", raw), "refusing to extract, member '/aaa")
    assert "aaa... has an absolute path or '..'" in str(error)


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_ordinary_long_names_and_global_headers_still_extract(fmt: int, tmp_path: Path) -> None:
    names = ["cat/" + "n" * 150 + ".png", "dog/é" + "d" * 120 + ".png", "dog/b.png"]
    buffer = io.BytesIO()
    comment = {"comment": "0123456789abcdef0123456789abcdef01234567"}  # git archive's global header
    with tarfile.open(fileobj=buffer, mode="w", format=fmt, pax_headers=comment) as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    archive = tmp_path / "fine.tar"
    archive.write_bytes(buffer.getvalue())
    out = extract(archive, tmp_path / "out", LIMITS)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png")) == sorted(names)
