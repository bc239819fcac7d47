"""Write-then-rename helpers: an output is either the old one or the complete new one.

A stage killed half-way (or failing on bad input) must never leave a truncated file that a later
stage would read as valid.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield an empty staging directory that replaces `target` when the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    os.chmod(staging, 0o777 & ~_umask())
    try:
        yield staging
        # A directory cannot be replaced in one atomic step on POSIX: move the old one aside
        # first, so a reader sees either the old tree or the new one, never a mix.
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            os.rename(target, old)
        os.rename(staging, target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def atomic_file(target: Path) -> Iterator[Path]:
    """Yield a temporary path beside `target`; it is fsynced and renamed onto `target` on success."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; outputs get the usual mode
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(target: Path, text: str) -> None:
    """Atomically replace `target` with `text`."""
    with atomic_file(target) as tmp:
        tmp.write_text(text)
