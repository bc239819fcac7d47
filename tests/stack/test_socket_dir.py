"""Issue 66, point 9: SeaweedFS's Unix sockets never fall back to its predictable /tmp/seaweedfs-<name>-<port>.sock
(a name another local user can take first). On a stack folder too deep for a socket address they go in a
private folder (0700, a name nobody can guess), reused only while it is still this user's alone."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from stack.servers import ObjectStore
from stack.state import Stack

PORTS = {"s3": 18333, "s3_grpc": 28333, "filer": 18888, "filer_grpc": 28888}
MADE: list[Path] = []  # folders made outside the test's own, removed after it


def _socket(stack: Stack) -> Path:
    """Where `weed s3`, as the stack starts it, serves HTTP on a Unix socket."""
    flags = [arg for arg in _command(stack) if arg.startswith("-localSocket=")]
    assert flags, "no -localSocket: weed falls back to /tmp/seaweedfs-s3-<port>.sock"
    path = Path(flags[0].split("=", 1)[1])
    if not path.is_relative_to(stack.root):
        MADE.append(path.parent)
    return path


def _command(stack: Stack) -> list[str]:
    (stack.root / "secrets").mkdir(parents=True, exist_ok=True, mode=0o700)
    return ObjectStore(stack).command()


def _private(folder: Path) -> bool:
    info = os.lstat(folder)
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700


@pytest.fixture
def deep_stack(tmp_path: Path) -> Iterator[Stack]:
    root = tmp_path / ("d" * 60) / ("e" * 60) / ".stack"  # too long for a socket address (108 bytes)
    root.mkdir(parents=True, mode=0o700)
    yield Stack(root, "127.0.0.1", PORTS)
    while MADE:
        folder = MADE.pop()
        if folder.is_symlink():
            folder.unlink()
        elif folder.exists():
            shutil.rmtree(folder)


def test_a_short_stack_folder_keeps_its_sockets(tmp_path: Path) -> None:
    stack = Stack(tmp_path / ".stack", "127.0.0.1", PORTS)
    stack.root.mkdir(mode=0o700)
    assert _socket(stack) == stack.root / "run" / "s3.sock"


def test_a_deep_stack_folder_puts_its_sockets_in_a_private_folder(deep_stack: Stack) -> None:
    path = _socket(deep_stack)
    assert not path.name.startswith("seaweedfs-") and len(os.fsencode(path)) <= 100, path
    assert _private(path.parent), oct(path.parent.stat().st_mode)
    assert _socket(deep_stack) == path  # the same folder at the next start


@pytest.mark.parametrize("planted", ["world-writable", "link"])
def test_a_recorded_folder_someone_else_could_write_is_not_reused(
    deep_stack: Stack, tmp_path: Path, planted: str
) -> None:
    first = _socket(deep_stack).parent
    if planted == "world-writable":
        first.chmod(0o777)
    else:
        first.rmdir()
        elsewhere = tmp_path / "theirs"
        elsewhere.mkdir(mode=0o700)
        first.symlink_to(elsewhere, target_is_directory=True)
    second = _socket(deep_stack).parent
    assert second != first and _private(second)
