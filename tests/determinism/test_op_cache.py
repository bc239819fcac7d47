"""Issue 35, point 6: the cached C++ op (tasks/determinism/blas.py) is loaded only from a folder and
a file of this user's that nobody else can write. A library planted under the op's (computable)
name, with a constructor that records that it ran, is refused in one line (exit 3) and never runs;
so is a genuine-looking one in a group-writable folder. A fresh cache folder is made 0700."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.core.errors import ExitCode, Refused
from tasks.determinism import blas
from tests.conftest import ROOT, subprocess_env

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to plant a library")

CONSTRUCTOR = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("the planted library ran\\n", f); fclose(f); }
}
"""


def _fake_compiler(folder: Path) -> str:
    """A 'C++ compiler' that writes an empty file where -o says: build() runs in milliseconds."""
    path = folder / "fake-cxx"
    path.write_text('#!/bin/sh\nwhile [ "$#" -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    path.chmod(0o755)
    return str(path)


def _plant(target: Path, record: Path) -> None:
    source = target.parent / "planted.c"
    source.write_text(CONSTRUCTOR % record)
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(target)], check=True)
    source.unlink()


def _load_op(xdg: Path) -> subprocess.CompletedProcess[str]:
    """Load the pool op as training does (portable mode), in a fresh process with XDG_CACHE_HOME=xdg."""
    code = (
        "import sys; from tasks.core.cli import exit_code; from tasks.determinism import blas\n"
        "sys.exit(exit_code(lambda: 0 if blas.op('gemm_chunks') is not None else 0))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=subprocess_env(XDG_CACHE_HOME=str(xdg)),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_fresh_cache_folder_is_private_and_so_is_the_library(tmp_path: Path) -> None:
    cache = tmp_path / "xdg" / "lockstep"
    built = blas.build(cache, _fake_compiler(tmp_path))
    assert built.parent == cache and built.is_file()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert stat.S_IMODE(built.stat().st_mode) & 0o022 == 0
    assert blas.build(cache, _fake_compiler(tmp_path)) == built  # found again, checked, not rebuilt


def test_a_venv_reached_through_a_link_uses_the_same_library(tmp_path: Path) -> None:
    """A project whose .venv links to another's (as the tests' project copies do) finds the op already
    built for that torch instead of compiling its own copy (seconds of a compiler per project)."""
    link = tmp_path / "venv"
    link.symlink_to(sys.prefix, target_is_directory=True)
    code = "import torch; from tasks.determinism import blas; print(torch.__file__); print(blas.library_path())"
    done = subprocess.run(
        [str(link / "bin" / "python"), "-c", code],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    torch_file, library = done.stdout.split()
    assert torch_file.startswith(str(link))  # torch was imported through the link ...
    assert library == str(blas.library_path())  # ... and the op's library is the same file


def test_a_library_someone_else_could_write_is_refused_and_never_runs(tmp_path: Path) -> None:
    """In a fresh process, as training loads it: exit 3, one line, the constructor never ran."""
    xdg, record = tmp_path / "xdg", tmp_path / "constructor-ran"
    (xdg / "lockstep").mkdir(parents=True, mode=0o700)
    target = blas.library_path(xdg / "lockstep")
    _plant(target, record)
    target.chmod(0o775)
    done = _load_op(xdg)
    assert not record.exists(), "the planted library's constructor ran"
    assert done.returncode == ExitCode.REFUSED, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"{target}: writable by group or others" in done.stderr, done.stderr


def _build_refused(env: dict[str, str]) -> str:
    """build()'s refusal with `env` (HOME, XDG_CACHE_HOME or neither) as the cache's only source: in this
    process, since build() refuses before anything is loaded (the fresh-process path and its exit code
    are the test above's)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("XDG_CACHE_HOME", raising=False)
        for key, value in env.items():
            patch.setenv(key, value)
        with pytest.raises(Refused) as refused:
            blas.build()
    return str(refused.value)


def test_a_cache_folder_someone_else_could_write_is_refused(tmp_path: Path) -> None:
    xdg = tmp_path / "xdg"
    (xdg / "lockstep").mkdir(parents=True, mode=0o700)
    target = blas.library_path(xdg / "lockstep")
    _plant(target, tmp_path / "constructor-ran")
    target.chmod(0o700)
    (xdg / "lockstep").chmod(0o770)
    assert f"{xdg / 'lockstep'}: writable by group or others" in _build_refused({"XDG_CACHE_HOME": str(xdg)})


def test_a_library_of_another_user_or_a_link_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "lockstep"
    cache.mkdir(mode=0o700)
    target = blas.library_path(cache)
    elsewhere = tmp_path / "elsewhere.so"
    elsewhere.write_bytes(b"")
    target.symlink_to(elsewhere)
    with pytest.raises(Refused, match="a link or special file"):
        blas.build(cache)
    target.unlink()
    if os.getuid() != 0:
        pytest.skip("changing a file's owner needs root")
    target.write_bytes(b"")
    target.chmod(0o700)
    os.chown(target, 65534, 65534)  # nobody
    with pytest.raises(Refused, match="owned by uid 65534"):
        blas.build(cache)
    os.chown(cache, 65534, 65534)
    with pytest.raises(Refused, match=f"{cache}: owned by uid 65534"):
        blas.build(cache)


def test_the_cache_key_covers_every_file_the_op_is_built_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each header blas_pool.cpp includes is hashed into the library's name: a change to any of them builds
    a new library rather than loading the old one (checked on copies of the sources)."""
    folder = blas.SOURCE.parent
    included = {line.split('"')[1] for line in blas.SOURCE.read_text().splitlines() if line.startswith('#include "')}
    assert included == {path.name for path in folder.glob("*.h")} == {path.name for path in blas._HEADERS}
    copies = tmp_path / "sources"
    copies.mkdir()
    for path in (blas.SOURCE, *blas._HEADERS):
        shutil.copy(path, copies / path.name)
    monkeypatch.setattr(blas, "SOURCE", copies / blas.SOURCE.name)
    monkeypatch.setattr(blas, "_HEADERS", tuple(copies / path.name for path in blas._HEADERS))
    before = blas.library_path(tmp_path)
    for header in blas._HEADERS:
        header.write_bytes(header.read_bytes() + b"\n")
        assert blas.library_path(tmp_path) != before, header.name
        before = blas.library_path(tmp_path)


@pytest.mark.parametrize("planted", ["world-writable xdg parent", "world-writable ~/.cache", "foreign ~/.cache"])
def test_a_library_under_a_parent_someone_else_could_write_is_refused(tmp_path: Path, planted: str) -> None:
    """Issue 66, point 9: the cache folder and the library are private, but a folder above them is not:
    whoever can write it can swap the cache folder for their own at any time, so nothing there is loaded."""
    if planted.startswith("foreign") and os.getuid() != 0:
        pytest.skip("changing a folder's owner needs root")
    home, record = tmp_path / "home", tmp_path / "constructor-ran"
    if planted.startswith("world-writable xdg"):
        shared = tmp_path / "shared"  # e.g. XDG_CACHE_HOME=/srv/scratch/me/cache, /srv/scratch mode 777
        xdg = shared / "me" / "cache"
        env = {"HOME": str(home), "XDG_CACHE_HOME": str(xdg)}
    else:
        shared = home / ".cache"
        xdg = shared
        env = {"HOME": str(home)}
    (xdg / "lockstep").mkdir(parents=True, mode=0o700)
    home.mkdir(exist_ok=True)
    target = blas.library_path(xdg / "lockstep")
    _plant(target, record)
    target.chmod(0o700)
    for folder in {shared, xdg}:
        folder.chmod(0o700)
    if planted.startswith("foreign"):
        os.chown(shared, 65534, 65534)
    else:
        shared.chmod(0o777)  # no sticky bit: anyone may rename what is inside
    problem = "owned by uid 65534" if planted.startswith("foreign") else "writable by group or others"
    assert f"{shared}: {problem}" in _build_refused(env)


def test_a_sticky_shared_parent_like_tmp_is_accepted(tmp_path: Path) -> None:
    """/tmp-like folders (world-writable with the sticky bit, root's or this user's) let nobody rename
    another's entries: a cache below one is loaded (here, built with a fake compiler)."""
    shared = tmp_path / "scratch"
    (shared / "me" / "lockstep").mkdir(parents=True, mode=0o700)
    shared.chmod(0o1777)
    built = blas.build(shared / "me" / "lockstep", _fake_compiler(tmp_path))
    assert built.is_file()
