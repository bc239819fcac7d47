"""The members a recipe reads, taken from a package: a Debian .deb, a wheel, or an npm tarball.

Only members whose name matches one of the set's patterns are written, and only regular files (a
package's symbolic links, such as an icon theme's aliases, are skipped: no class gets a file twice). Every
member's name is checked, taken or not, and the whole package is refused when one is absolute or climbs
out with `..`: a package that tries that is not the one that was pinned. The bytes written are bounded
(`MAX_BYTES`, the members' declared sizes summed as they are listed) and so is the count of members.

    .deb   an ar archive: its data.tar.{xz,gz,bz2} read as a stream (python, no dpkg needed), each
           taken member extracted with tarfile's `data` filter
    .whl   a zip: the taken members read by name, zipfile stopping each at its declared size
    .tgz   npm's tarball, read as a stream like a .deb's data.tar, with the `data` filter
"""

from __future__ import annotations

import fnmatch
import io
import posixpath
import stat
import zipfile
from pathlib import Path
from typing import BinaryIO

from tasks.core.errors import ExpectedFailure, Refused
from tasks.core.tar import tarfile

MAX_BYTES = 512 << 20  # what the taken members may add up to; wesnoth's unit sprites are 12 MB
MAX_MEMBERS = 200_000  # listed, taken or not; wesnoth's data package has about 40,000
_TAR_MODES = {"data.tar": "r|", "data.tar.gz": "r|gz", "data.tar.xz": "r|xz", "data.tar.bz2": "r|bz2"}


class UnsafePackage(Refused):
    """A member would land outside the folder, or the package is larger than a data set's: nothing used."""


class _Taken:
    """The members taken so far, refused past the limits."""

    def __init__(self, package: Path, patterns: tuple[str, ...], max_bytes: int) -> None:
        self.package, self.patterns, self.max_bytes = package, patterns, max_bytes
        self.members = self.bytes = 0

    def wanted(self, name: str) -> str | None:
        """`name` normalised if a pattern takes it; UnsafePackage when it is absolute or climbs out."""
        self.members += 1
        if self.members > MAX_MEMBERS:
            raise UnsafePackage(f"{self.package.name}: more than {MAX_MEMBERS} members; not a package this reads")
        normal = posixpath.normpath(name.replace("\\", "/")) if name else ""
        if name.startswith(("/", "\\")) or normal == ".." or normal.startswith("../"):
            raise UnsafePackage(
                f"{self.package.name}: refusing to unpack, member {name!r} has an absolute path or '..'"
            )
        normal = normal.removeprefix("./")
        return normal if any(fnmatch.fnmatchcase(normal, p) for p in self.patterns) else None

    def add(self, size: int) -> None:
        self.bytes += max(size, 0)
        if self.bytes > self.max_bytes:
            raise UnsafePackage(f"{self.package.name}: the members taken come to more than {self.max_bytes} bytes")


def unpack(package: Path, dest: Path, patterns: tuple[str, ...], max_bytes: int = MAX_BYTES) -> Path:
    """The members of `package` matching `patterns`, as files under `dest` (made here); `dest`."""
    dest.mkdir(parents=True)
    taken = _Taken(package, patterns, max_bytes)
    name = package.name
    try:
        if name.endswith(".deb"):
            with open(package, "rb") as handle:
                member, stream = _deb_data(handle, package)
                _from_tar(tarfile.open(fileobj=stream, mode=_TAR_MODES[member]), dest, taken)
        elif name.endswith(".whl"):
            _from_zip(package, dest, taken)
        elif name.endswith((".tgz", ".tar.gz")):
            with open(package, "rb") as handle:
                _from_tar(tarfile.open(fileobj=handle, mode="r|gz"), dest, taken)
        else:
            raise ExpectedFailure(f"{name}: not a .deb, .whl or .tgz package")
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        raise ExpectedFailure(f"{name}: not a readable package: {exc}") from None
    return dest


def _from_tar(tar: tarfile.TarFile, dest: Path, taken: _Taken) -> None:
    """Stream mode: each member is extracted as it is read, so a compressed archive is read once."""
    with tar:
        for member in tar:
            name = taken.wanted(member.name)
            if name is None or not member.isfile():
                continue
            taken.add(member.size)
            # the `data` filter checks the name and strips modes again (a second line of defence)
            tar.extract(member.replace(name=name, deep=False), dest, filter="data")


def _from_zip(package: Path, dest: Path, taken: _Taken) -> None:
    with zipfile.ZipFile(package) as archive:
        for info in archive.infolist():
            name = taken.wanted(info.filename)
            if name is None or info.is_dir() or stat.S_ISLNK(info.external_attr >> 16):
                continue
            if info.flag_bits & 0x1:
                raise UnsafePackage(f"{package.name}: member {info.filename!r} is encrypted")
            taken.add(info.file_size)
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as source, open(target, "wb") as out:
                while block := source.read(1 << 20):
                    out.write(block)


class _Window(io.RawIOBase):
    """`size` bytes of `handle` from where it stands: one member of an ar archive, read in place."""

    def __init__(self, handle: BinaryIO, size: int) -> None:
        super().__init__()
        self.handle, self.left = handle, size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self.handle.read(min(len(buffer), self.left))
        buffer[: len(data)] = data
        self.left -= len(data)
        return len(data)


def _deb_data(handle: BinaryIO, package: Path) -> tuple[str, io.BufferedReader]:
    """The data.tar member of a .deb (an ar archive: an 8-byte magic, then 60-byte headers), as a stream."""
    if handle.read(8) != b"!<arch>\n":
        raise ExpectedFailure(f"{package.name}: not a Debian package (no ar header)")
    while len(header := handle.read(60)) == 60:
        if header[58:60] != b"`\n":
            raise ExpectedFailure(f"{package.name}: a damaged ar header")
        name, size = header[:16].decode("ascii", "replace").strip().rstrip("/"), int(header[48:58])
        if name.startswith("data.tar"):
            if name not in _TAR_MODES:
                raise ExpectedFailure(f"{package.name}: {name} is compressed in a way this reader does not know")
            return name, io.BufferedReader(_Window(handle, size))
        handle.seek(size + size % 2, io.SEEK_CUR)  # members are padded to an even length
    raise ExpectedFailure(f"{package.name}: no data.tar member")
