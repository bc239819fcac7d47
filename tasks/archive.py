"""Safe extraction of downloaded archives (.tar, .tar.gz/.tgz, .tar.bz2, .tar.xz, .zip).

Every member is checked before anything is written, and the archive is refused whole when one
member would land outside the destination: an absolute path, a `..` component, a link (symbolic
or hard) pointing outside, a device or FIFO. Python's tarfile `data` filter is applied on top, as
a second line of defence. Extraction goes to a staging directory renamed into place, so a
refused or failed archive leaves nothing behind.
"""

from __future__ import annotations

import posixpath
import stat
import tarfile
import zipfile
from pathlib import Path

from tasks.atomic import atomic_dir
from tasks.errors import ExpectedFailure

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")


class UnsafeArchiveError(ExpectedFailure):
    """The archive would write outside its destination; nothing was extracted."""


def is_archive(path: Path) -> bool:
    name = Path(path).name.lower()
    return name.endswith((*TAR_SUFFIXES, ".zip"))


def extract(archive: Path, dest: Path) -> Path:
    """Extract `archive` into `dest` (replaced atomically) after checking every member."""
    archive = Path(archive)
    with atomic_dir(dest) as staging:
        if archive.name.lower().endswith(".zip"):
            _extract_zip(archive, staging)
        elif archive.name.lower().endswith(TAR_SUFFIXES):
            _extract_tar(archive, staging)
        else:
            raise ExpectedFailure(f"{archive.name}: unknown archive type (expected {', '.join(TAR_SUFFIXES)} or .zip)")
    return Path(dest)


def _inside(name: str) -> str | None:
    """`name` normalised, or None when it is absolute or climbs out with `..`."""
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):  # POSIX, Windows root, drive
        return None
    normal = posixpath.normpath(name.replace("\\", "/"))
    return None if normal == ".." or normal.startswith("../") else normal


def _refuse(archive: Path, member: str, why: str) -> UnsafeArchiveError:
    return UnsafeArchiveError(f"{archive.name}: refusing to extract, member {member!r} {why}")


def _extract_tar(archive: Path, staging: Path) -> None:
    try:
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                where = _inside(member.name)
                if where is None:
                    raise _refuse(archive, member.name, "has an absolute path or '..'")
                if member.issym() or member.islnk():
                    # symlink targets are relative to the link's folder; hard links to the archive root
                    base = posixpath.dirname(where) if member.issym() else ""
                    if _inside(posixpath.join(base, member.linkname)) is None:
                        raise _refuse(archive, member.name, f"is a link pointing outside ({member.linkname!r})")
                elif not (member.isfile() or member.isdir()):
                    raise _refuse(archive, member.name, "is a device, FIFO or other special file")
            # The 'data' filter re-checks all of the above (and strips modes such as setuid).
            tar.extractall(staging, filter="data")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ExpectedFailure(f"{archive.name}: not a readable tar archive: {exc}") from None


def _extract_zip(archive: Path, staging: Path) -> None:
    try:
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                if _inside(info.filename) is None:
                    raise _refuse(archive, info.filename, "has an absolute path or '..'")
                if stat.S_ISLNK(info.external_attr >> 16):
                    # zipfile would write the link as a small text file; no dataset needs links
                    raise _refuse(archive, info.filename, "is a symbolic link (not supported in zip archives)")
            zf.extractall(staging)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ExpectedFailure(f"{archive.name}: not a readable zip archive: {exc}") from None
