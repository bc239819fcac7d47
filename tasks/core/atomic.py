"""Write-then-rename helpers: an output is either the old one or the complete new one.

A stage killed half-way (SIGKILL, a full disk, bad input) must never leave a truncated file that a
later stage would read as valid. New content goes to a temporary name beside the target and is
renamed onto it only once complete. A write that fails (no space left, a quota, a read-only disk)
raises `WriteError` naming the target, with the previous version untouched; temporaries that a
killed process left behind are swept by the next write of the same target.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tasks.core.errors import ExpectedFailure

# Failures of the write itself, wherever in the block they surface (a write() on a full disk carries
# no file name). Other errors inside the block (a missing input, bad data) propagate as they are.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})


class WriteError(ExpectedFailure):
    """An output could not be written; the previous version of it is intact."""

    def __init__(self, target: Path, exc: OSError) -> None:
        reason = exc.strerror or str(exc)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            reason += f" (free: {_free_bytes(target) / 2**20:.1f} MiB on its filesystem)"
        where = f", at {exc.filename}" if exc.filename and Path(exc.filename).name != target.name else ""
        super().__init__(f"{target}: could not write it: {reason}{where}; the previous version is unchanged")
        self.errno = exc.errno


def _free_bytes(path: Path) -> int:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return 0


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _temp_prefix(target: Path) -> str:
    # The writer's pid in the name: a later writer can tell a dead writer's leftovers from a live one's.
    return f".{target.name}.tmp{os.getpid()}."


def _sweep_leftovers(target: Path) -> None:
    """Remove temporaries of `target` whose writer is gone (killed mid-write)."""
    for path in target.parent.glob(f".{target.name}.tmp*"):
        pid = path.name[len(f".{target.name}.tmp") :].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            if path.name.endswith(".old") and not target.exists():
                os.rename(path, target)  # killed between atomic_dir's two renames: the previous tree, back
            else:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_RENAME_EXCHANGE = 2  # linux/fs.h


@functools.cache
def _renameat2():  # glibc >= 2.28; None elsewhere
    # The C library this process already loaded (dlopen(NULL)), not `ctypes.util.find_library("c")`, which
    # runs /sbin/ldconfig in a subprocess to find its name: a process per first replaced folder.
    return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where unsupported.

    Python has no binding for it; without it, replacing a directory takes two renames, and a kill
    between them would leave the target missing.
    """
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):  # filesystem or kernel without it
        return False
    raise OSError(code, os.strerror(code), str(b))


@contextmanager
def scratch_dir(parent: Path, name: str) -> Iterator[Path]:
    """An empty folder in `parent` for the block, removed after it, however the block ends. A killed
    process's (a name with its pid, as a staging folder's) is removed by the next process to ask for
    one of the same `name`: a scratch copy of a dataset is not left behind for good."""
    target = Path(parent) / name
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep_leftovers(target)
    path = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), dir=target.parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield an empty staging directory that replaces `target` when the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep_leftovers(target)
    staging = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), dir=target.parent))
    os.chmod(staging, 0o777 & ~_umask())
    try:
        try:
            yield staging
            if not target.exists():
                os.rename(staging, target)
            elif _exchange(staging, target):
                pass  # `staging` now holds the old tree, removed below
            else:
                # Two renames: the old tree is moved aside under a temporary name first.
                old = target.with_name(f"{_temp_prefix(target)}old")
                os.rename(target, old)
                os.rename(staging, target)
                staging = old
        except OSError as exc:
            if exc.errno in WRITE_ERRNOS:
                raise WriteError(target, exc) from exc
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def atomic_file(target: Path) -> Iterator[Path]:
    """Yield a temporary path beside `target`; it is fsynced and renamed onto `target` on success."""
    with atomic_files([target]) as temporaries:
        yield temporaries[0]


@contextmanager
def atomic_files(targets: list[Path]) -> Iterator[list[Path]]:
    """Temporary paths beside several `targets`, renamed onto them together once the block succeeds.

    A stage's outputs are then all old or all new, except in the microseconds between the renames at
    the end (a kill while they are being serialised, the slow part, leaves every one of them as it was).
    """
    targets = [Path(target) for target in targets]
    temporaries: list[Path] = []
    try:
        try:
            for target in targets:
                target.parent.mkdir(parents=True, exist_ok=True)
                _sweep_leftovers(target)
                fd, name = tempfile.mkstemp(prefix=_temp_prefix(target), dir=target.parent)
                os.close(fd)
                temporaries.append(Path(name))
                os.chmod(name, 0o666 & ~_umask())  # mkstemp creates 0600; outputs get the usual mode
            yield temporaries
            for tmp in temporaries:
                with open(tmp, "rb+") as handle:
                    os.fsync(handle.fileno())
            for tmp, target in zip(temporaries, targets, strict=True):
                os.replace(tmp, target)
        except OSError as exc:
            if exc.errno in WRITE_ERRNOS:
                # a write() on a full disk names no file: the group is named by its folder
                raise WriteError(targets[0] if len(targets) == 1 else Path(os.path.commonpath(targets)), exc) from exc
            raise
    finally:
        for tmp in temporaries:
            tmp.unlink(missing_ok=True)


def write_bytes(target: Path, data: bytes) -> None:
    """Atomically replace `target` with `data`."""
    with atomic_file(target) as tmp:
        tmp.write_bytes(data)


def write_text(target: Path, text: str) -> None:
    """Atomically replace `target` with `text`."""
    write_bytes(target, text.encode())
