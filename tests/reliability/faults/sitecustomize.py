"""Fault injection for the reliability suite, inside a real pipeline process.

A test puts this folder on PYTHONPATH, so Python imports this module at start-up in the process it
starts and in every Python process below it (dvc's stage commands, torchrun's ranks). It does
nothing unless LOCKSTEP_FAULT is set:

    LOCKSTEP_FAULT=kill     SIGKILL this process half-way through writing a file
    LOCKSTEP_FAULT=enospc   fail that write with ENOSPC ("No space left on device"), as a full disk does
    LOCKSTEP_FAULT_PATH     ... the Nth file opened for writing whose path contains this text
    LOCKSTEP_FAULT_NTH      N (default 1)

"Half-way": the first write() to that file puts half of its bytes on disk, then the fault strikes.
It hooks Python's `open` (builtins and io, which pathlib and numpy use), so it reaches every file
the stages write through Python; the stages serialise checkpoints in memory for that reason too.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import signal

_FAULT = os.environ.get("LOCKSTEP_FAULT")
_PATH = os.environ.get("LOCKSTEP_FAULT_PATH", "")
_NTH = int(os.environ.get("LOCKSTEP_FAULT_NTH", "1"))
_seen = 0
_real_open = io.open


class _FaultyFile:
    """A file opened for writing whose first write() is cut in half, then the fault strikes."""

    def __init__(self, handle: io.IOBase) -> None:
        self._handle = handle

    def write(self, data):  # noqa: ANN001, ANN201 - the file protocol
        half = memoryview(data)[: len(data) // 2] if not isinstance(data, str) else data[: len(data) // 2]
        self._handle.write(half)
        self._handle.flush()
        os.fsync(self._handle.fileno())  # the half is really on disk, as a killed writer would leave it
        if _FAULT == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self) -> _FaultyFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.close()

    def __getattr__(self, name: str):  # noqa: ANN204 - everything else is the real file's
        return getattr(self._handle, name)


def _open(file, mode="r", *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - open's signature
    global _seen
    handle = _real_open(file, mode, *args, **kwargs)
    writing = any(flag in mode for flag in "wax")  # not "r+": opened to fsync what is written
    if writing and isinstance(file, (str, bytes, os.PathLike)) and _PATH in os.fsdecode(file):
        _seen += 1
        if _seen == _NTH:
            return _FaultyFile(handle)
    return handle


if _FAULT in ("kill", "enospc"):
    builtins.open = io.open = _open
elif _FAULT:
    raise SystemExit(f"LOCKSTEP_FAULT={_FAULT!r}: expected kill or enospc")
