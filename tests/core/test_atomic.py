"""tasks/core/atomic.py: a folder replaced whole, in one step where the kernel can."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tasks.core import atomic
from tasks.core.atomic import atomic_dir


def test_a_folder_is_replaced_whole_in_one_exchange_without_starting_a_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """renameat2 is looked up in the C library the process has loaded: `ctypes.util.find_library` ran
    /sbin/ldconfig for it, a process that every stage, flow and re-read started once."""
    target = tmp_path / "data"
    target.mkdir()
    (target / "old.txt").write_text("old\n")

    def no_process(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    atomic._renameat2.cache_clear()
    try:
        with atomic_dir(target) as staging:
            (staging / "new.txt").write_text("new\n")
            staged = staging.stat().st_ino
        if sys.platform == "linux":  # glibc >= 2.28 and musl have it: the swap is one step there
            assert atomic._renameat2() is not None
    finally:
        atomic._renameat2.cache_clear()
    assert target.stat().st_ino == staged  # the staging folder is the target now
    assert [p.name for p in target.iterdir()] == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["data"]  # the old tree is gone, no staging left
