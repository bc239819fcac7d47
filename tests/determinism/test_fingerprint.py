"""Machine facts as a run records them (tasks/determinism/fingerprint.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.determinism import fingerprint
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


@pytest.mark.parametrize(
    ("implementer", "part", "vendor", "model"),
    [
        ("0x41", "0xd0c", "Arm", "Neoverse N1"),
        ("0x41", "0xd4f", "Arm", "Neoverse V2"),
        ("0x51", "0x001", "implementer 0x51", "part 0x001"),
    ],
)
def test_an_arm64_cpu_is_named_from_its_codes(
    monkeypatch: pytest.MonkeyPatch, implementer: str, part: str, vendor: str, model: str
) -> None:
    """arm64's /proc/cpuinfo has no vendor_id or model name: the golden record's list of machines would
    say only "aarch64" without the implementer's and part's codes named."""
    info = {"Features": "fp asimd asimddp", "CPU implementer": implementer, "CPU part": part}
    monkeypatch.setattr(fingerprint.cpu_mode, "cpuinfo", lambda: info)
    monkeypatch.setattr(fingerprint.cpu_mode.platform, "machine", lambda: "aarch64")
    facts = fingerprint.cpu_facts()
    assert (facts["hw.cpu.arch"], facts["hw.cpu.vendor"], facts["hw.cpu.model"]) == ("aarch64", vendor, model)
    assert facts["hw.cpu.flags"] == "asimd asimddp"
