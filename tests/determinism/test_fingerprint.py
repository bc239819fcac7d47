"""Machine facts as a run records them (tasks/determinism/fingerprint.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.determinism.fingerprint import nvidia_driver


@pytest.mark.parametrize(
    ("first_line", "version"),
    [
        # the proprietary module
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023", "535.104.05"),
        # the open module, as an H200 machine printed it (the first GPU check read "for" here)
        ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (nixbld@)", "580.159.04"),
    ],
)
def test_the_driver_version_is_read_from_either_kernel_module(tmp_path: Path, first_line: str, version: str) -> None:
    proc = tmp_path / "version"
    proc.write_text(f"{first_line}\nGCC version:  gcc version 15.3.0 (GCC)\n")
    assert nvidia_driver(proc) == version
