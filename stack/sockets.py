"""Where SeaweedFS serves HTTP on a Unix socket (each of its servers does, beside its ports).

Its default is /tmp/seaweedfs-<name>-<port>.sock, a name any local user can compute and take first
(a socket or link of theirs there would get requests meant for ours). So the stack always names one:
in its own folder (`run/`, private like the rest of it), or, where that path is too long for a socket
address, in a private folder made with mkdtemp (0700, an unguessable name) that the stack's folder
records and reuses while it is still this user's alone (a directory, not a link, mode 0700).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from stack.state import Stack

# A socket address holds 108 bytes with its NUL on Linux (104 on the BSDs); leave room for both.
MAX_SOCKET_PATH = 100


def local_socket(stack: Stack, flag: str, name: str) -> dict[str, Path]:
    """`weed`'s flag naming the Unix socket of server `name`: in the stack's folder where it fits, else
    in the stack's private socket folder (`private_folder`)."""
    run = stack.root / "run"
    run.mkdir(exist_ok=True, mode=0o700)
    path = run / f"{name}.sock"
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        path = private_folder(stack) / f"{name}.sock"
    return {flag: path}


def private_folder(stack: Stack) -> Path:
    """The stack's socket folder outside it: the one its `run/socket-folder` names if it is still a
    directory of this user's that nobody else can enter, else a new one (recorded for the next start)."""
    record = stack.root / "run" / "socket-folder"
    try:
        recorded = Path(record.read_text().strip())
    except (OSError, UnicodeDecodeError):
        recorded = None
    if recorded is not None and recorded.is_absolute() and _ours_alone(recorded):
        return recorded
    made = Path(tempfile.mkdtemp(prefix="lockstep-weed-", dir=_short_temp()))  # 0700
    record.write_text(f"{made}\n")
    return made


def _ours_alone(folder: Path) -> bool:
    try:
        info = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700


def _short_temp() -> str:
    """The temporary folder, or /tmp where $TMPDIR is itself too deep for a socket under it."""
    temp = tempfile.gettempdir()
    return temp if len(os.fsencode(temp)) <= MAX_SOCKET_PATH - 40 else "/tmp"
