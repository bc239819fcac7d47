"""Reproducible archives: a folder packed into a tar.gz or zip, and the tar and zip entries they are made of.

Every timestamp and owner field is zeroed (tar ``mtime=0``, ``uid/gid=0``, empty user/group names; zip dates
fixed at 1980-01-01) and members are added in sorted order, so the same folder always packs to the same bytes.
"""

from __future__ import annotations

import io
import os
import tarfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from benchmarks.fakedata.files import gzip_bytes, sha256_bytes, write_file

# The zip format cannot represent dates before 1980; this is the conventional "no date" value.
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


def normalize_info(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """``info`` with no time, owner or group: the same entry whoever packs it, whenever."""
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def file_info(name: str, size: int, mode: int = 0o644) -> tarfile.TarInfo:
    """The tar entry of a regular file ``name`` of ``size`` bytes."""
    info = tarfile.TarInfo(name)
    info.size, info.mode = size, mode
    return normalize_info(info)


def dir_info(name: str) -> tuple[tarfile.TarInfo, None]:
    """The tar entry of a directory ``name``, with no data (ready for :func:`tar_gz`)."""
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    return normalize_info(info), None


def tar_gz(entries: Sequence[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    """Serialize members in the given order (names kept verbatim: no stripping of ``/`` or ``..``), then gzip."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    # Compress separately: tarfile's own "w:gz" stamps the current time into the gzip header.
    return gzip_bytes(buf.getvalue())


def zip_info(name: str, mode: int) -> zipfile.ZipInfo:
    """The zip entry of ``name`` with Unix ``mode`` (file type bits included), dated :data:`ZIP_EPOCH`."""
    info = zipfile.ZipInfo(name, date_time=ZIP_EPOCH)
    info.create_system = 3  # Unix, so extractors interpret the mode bits in external_attr
    info.external_attr = mode << 16
    return info


def pack(src_dir: Path, archive: Path, kind: Literal["tar.gz", "zip"], prefix: str = "") -> str:
    """Pack ``src_dir`` into ``archive`` reproducibly (members under ``prefix/`` if given); return its sha256.

    Directories get their own entries; symlinks are stored as symlinks (not followed).
    """
    src_dir = Path(src_dir)
    prefix = prefix.strip("/")
    # (archive name, path) for every directory and file, parents before children thanks to sorting.
    items: list[tuple[str, Path]] = [(prefix, src_dir)] if prefix else []
    for dirpath, dirnames, filenames in os.walk(src_dir):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(src_dir).as_posix()
            items.append((f"{prefix}/{rel}" if prefix else rel, path))
    items.sort(key=lambda item: item[0])

    if kind == "tar.gz":
        entries: list[tuple[tarfile.TarInfo, bytes | None]] = []
        for name, path in items:
            if path.is_symlink():
                info = normalize_info(tarfile.TarInfo(name))
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, os.readlink(path), 0o777
                entries.append((info, None))
            elif path.is_dir():
                entries.append(dir_info(name))
            else:
                data = path.read_bytes()
                entries.append((file_info(name, len(data)), data))
        data = tar_gz(entries)
    elif kind == "zip":
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            for name, path in items:
                if path.is_symlink():
                    zf.writestr(zip_info(name, 0o120777), os.readlink(path).encode(), zipfile.ZIP_STORED)
                elif path.is_dir():
                    info = zip_info(name + "/", 0o40755)
                    info.external_attr |= 0x10  # MS-DOS directory flag
                    zf.writestr(info, b"", zipfile.ZIP_STORED)
                else:
                    zf.writestr(zip_info(name, 0o100644), path.read_bytes(), zipfile.ZIP_DEFLATED)
        data = buf.getvalue()
    else:
        raise ValueError(f"unknown archive kind {kind!r}")
    write_file(Path(archive), data)
    return sha256_bytes(data)
