"""Safe extraction of downloaded archives (.tar, .tar.gz/.tgz, .tar.bz2, .tar.xz, .zip).

Every member is checked before anything is written, and the archive is refused whole when one
member would land outside the destination (an absolute path, a `..` component, a link pointing
outside), is a link at all (symbolic or hard: no dataset needs one, and `cat -> .` would show every
image under a second class), or is a device or FIFO. Python's tarfile `data` filter is applied on
top, as a second line of defence. Extraction goes to a staging directory renamed into place, so a
refused or failed archive leaves nothing behind.

Bombs are refused the same way, before anything is written: more members than `max_files`, more
bytes in all than `max_bytes`, or more than `max_ratio` times the archive's own size (a 400 KB
gzip can hold 400 MB of zeros). The sizes are the members' own (tar headers; zip's declared
sizes, which zipfile enforces when it inflates), summed as the member list is read, so even
reading a bomb's member list stops at the first limit it passes. A tar member's long-name and pax
headers count too (tarfile holds them in memory), and each is bounded before it is read
(tasks/core/tar.py BoundedTarInfo): a header cannot be a bomb of its own.
"""

from __future__ import annotations

import lzma
import posixpath
import stat
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from tasks.core.atomic import atomic_dir
from tasks.core.errors import ExpectedFailure, Refused
from tasks.core.tar import BoundedTarInfo, HeaderRefused, tarfile

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
RATIO_FLOOR = 1 << 20  # extracting to less is harmless, and a few tiny flat images compress well: no ratio check
_CORRUPT = (EOFError, OSError, zlib.error, lzma.LZMAError)  # bz2 and gzip raise OSError
SHOWN_CHARS = 200  # of a member name or an error in a message: a tar name may be 64 KiB, a message is one line


class UnsafeArchiveError(Refused):
    """The archive would write outside its destination, holds a link or is a bomb; nothing was extracted."""


@dataclass(frozen=True)
class ArchiveLimits:
    """What one archive may expand to (DataConfig's max_extracted_bytes, max_compression_ratio, max_archive_files)."""

    max_bytes: int  # all members together
    max_ratio: float  # extracted bytes / archive bytes
    max_files: int  # members, folders included


class _Budget:
    """Sums members as they are listed; refuses the archive at the first limit passed."""

    def __init__(self, archive: Path, limits: ArchiveLimits) -> None:
        self.archive, self.limits = archive, limits
        self.size = max(archive.stat().st_size, 1)
        self.files = self.bytes = 0

    def add(self, size: int, files: int = 1) -> None:
        self.files += files
        self.bytes += max(size, 0)
        limits, name = self.limits, self.archive.name
        if self.files > limits.max_files:
            raise UnsafeArchiveError(
                f"{name}: refusing to extract, more than {limits.max_files} members (data.max_archive_files)"
            )
        if self.bytes > limits.max_bytes:
            raise UnsafeArchiveError(
                f"{name}: refusing to extract, more than {limits.max_bytes} bytes once extracted "
                "(data.max_extracted_bytes)"
            )
        if self.bytes > RATIO_FLOOR and self.bytes > limits.max_ratio * self.size:
            raise UnsafeArchiveError(
                f"{name}: refusing to extract, it expands more than {limits.max_ratio:g} times "
                f"({self.bytes} bytes from {self.size} and counting; data.max_compression_ratio)"
            )


def is_archive(path: Path) -> bool:
    name = Path(path).name.lower()
    return name.endswith((*TAR_SUFFIXES, ".zip"))


def extract(archive: Path, dest: Path, limits: ArchiveLimits) -> Path:
    """Extract `archive` into `dest` (replaced atomically) after checking every member."""
    archive = Path(archive)
    with atomic_dir(dest) as staging:
        if archive.name.lower().endswith(".zip"):
            _extract_zip(archive, staging, _Budget(archive, limits))
        elif archive.name.lower().endswith(TAR_SUFFIXES):
            _extract_tar(archive, staging, _Budget(archive, limits))
        else:
            raise ExpectedFailure(f"{archive.name}: unknown archive type (expected {', '.join(TAR_SUFFIXES)} or .zip)")
    return Path(dest)


def _inside(name: str) -> str | None:
    """`name` normalised, or None when it is absolute or climbs out with `..`."""
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):  # POSIX, Windows root, drive
        return None
    normal = posixpath.normpath(name.replace("\\", "/"))
    return None if normal == ".." or normal.startswith("../") else normal


def _shown(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}..."


def _refuse(archive: Path, member: str, why: str) -> UnsafeArchiveError:
    return UnsafeArchiveError(f"{archive.name}: refusing to extract, member {_shown(repr(member))} {why}")


def _extract_tar(archive: Path, staging: Path, budget: _Budget) -> None:
    try:
        with tarfile.open(archive, tarinfo=BoundedTarInfo) as tar:
            for member in tar:  # read lazily: a bomb is refused before its whole list is decompressed
                budget.add((member.size if member.isfile() else 0) + member.extended_bytes)
                _check_tar_member(archive, member)
            # The 'data' filter re-checks all of the above (and strips modes such as setuid).
            tar.extractall(staging, filter="data")
    except HeaderRefused as exc:
        raise UnsafeArchiveError(f"{archive.name}: refusing to extract, {exc}") from None
    except (tarfile.TarError, *_CORRUPT) as exc:
        raise ExpectedFailure(f"{archive.name}: not a readable tar archive: {_shown(str(exc))}") from None
    except RecursionError:  # a backstop: BoundedTarInfo refuses long chains of headers well before this
        raise ExpectedFailure(f"{archive.name}: not a readable tar archive: headers nested too deep") from None


def _check_tar_member(archive: Path, member: tarfile.TarInfo) -> None:
    where = _inside(member.name)
    if where is None:
        raise _refuse(archive, member.name, "has an absolute path or '..'")
    if member.issym() or member.islnk():
        # symlink targets are relative to the link's folder; hard links to the archive root
        base = posixpath.dirname(where) if member.issym() else ""
        if _inside(posixpath.join(base, member.linkname)) is None:
            raise _refuse(archive, member.name, f"is a link pointing outside ({_shown(repr(member.linkname))})")
        # inside, too: `cat -> .` would list every image a second time, under the class `cat`
        raise _refuse(archive, member.name, f"is a link ({_shown(repr(member.linkname))}); a dataset needs none")
    if not (member.isfile() or member.isdir()):
        raise _refuse(archive, member.name, "is a device, FIFO or other special file")


def _extract_zip(archive: Path, staging: Path, budget: _Budget) -> None:
    try:
        with zipfile.ZipFile(archive) as zf:
            infos = zf.infolist()
            budget.add(0, files=len(infos))  # the central directory gives the count at once
            for info in infos:
                budget.add(info.file_size, files=0)  # zipfile stops inflating a member at its declared size
                if _inside(info.filename) is None:
                    raise _refuse(archive, info.filename, "has an absolute path or '..'")
                if stat.S_ISLNK(info.external_attr >> 16):
                    # zipfile would write the link as a small text file; no dataset needs links
                    raise _refuse(archive, info.filename, "is a symbolic link (not supported in zip archives)")
                if info.flag_bits & 0x1:
                    raise _refuse(archive, info.filename, "is encrypted")
            zf.extractall(staging)
    except (zipfile.BadZipFile, NotImplementedError, *_CORRUPT) as exc:  # NotImplementedError: a compression method
        raise ExpectedFailure(f"{archive.name}: not a readable zip archive: {_shown(str(exc))}") from None
