"""Malicious archives: members named to leave the extraction folder (``..``, absolute paths) or through a
symlink, for the tests of safe extraction. Reproducible like every archive in benchmarks.fakedata."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

from benchmarks.fakedata.archives import file_info, normalize_info, tar_gz, zip_info
from benchmarks.fakedata.files import sha256_bytes, write_file


def tar_with_member(archive: Path, name: str, data: bytes = b"x") -> str:
    """Write a .tar.gz with one regular file under the verbatim ``name`` (e.g. ``../evil.txt``, ``/tmp/evil.txt``)."""
    out = tar_gz([(file_info(name, len(data)), data)])
    write_file(Path(archive), out)
    return sha256_bytes(out)


def tar_with_symlink(
    archive: Path, link_name: str, target: str, then_file: str | None = None, data: bytes = b"x"
) -> str:
    """Write a .tar.gz with symlink ``link_name -> target``, then optionally a file ``then_file`` (e.g. through it)."""
    link = normalize_info(tarfile.TarInfo(link_name))
    link.type, link.linkname, link.mode = tarfile.SYMTYPE, target, 0o777
    entries: list[tuple[tarfile.TarInfo, bytes | None]] = [(link, None)]
    if then_file is not None:
        entries.append((file_info(then_file, len(data)), data))
    out = tar_gz(entries)
    write_file(Path(archive), out)
    return sha256_bytes(out)


def zip_with_member(archive: Path, name: str, data: bytes = b"x") -> str:
    """Write a zip with one member under the raw ``name`` (ZipInfo keeps ``..`` and leading ``/``)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(zip_info(name, 0o100644), data, zipfile.ZIP_STORED)
    write_file(Path(archive), buf.getvalue())
    return sha256_bytes(buf.getvalue())


def zip_with_symlink(archive: Path, link_name: str, target: str) -> str:
    """Write a zip whose member ``link_name`` is a Unix symlink to ``target`` (mode 0o120777, data = target)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(zip_info(link_name, 0o120777), target.encode(), zipfile.ZIP_STORED)
    write_file(Path(archive), buf.getvalue())
    return sha256_bytes(buf.getvalue())
