"""Machine facts as a run records them (tasks/determinism/fingerprint.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.determinism import fingerprint
from tasks.determinism.fingerprint import nvidia_driver
from tests.conftest import ROOT


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


def test_a_portable_run_from_x86_64_is_expected_to_give_the_same_bytes_on_arm64() -> None:
    """What `make reproduce` of an x86-64 run says on arm64: the architecture, vendor and model differ, none
    of them decides portable bytes, so a difference in bytes would be a bug; in native mode it would not."""
    golden = json.loads((ROOT / "tests/determinism/golden/portable_training.json").read_text())
    x86 = golden["recorded_on"]
    arm = {**x86, "hw.cpu.arch": "aarch64", "hw.cpu.vendor": "Arm", "hw.cpu.model": "Neoverse N1"}
    arm |= {"hw.cpu.flags": "asimd asimdhp asimddp", "hw.cpu.capability": "DEFAULT"}
    arm |= {"hw.env.ATEN_CPU_CAPABILITY": "default", "hw.cpu.products": "fma chains, 128-bit vectors"}
    assert fingerprint.explain(x86, arm) == ([], False)  # (each pinned its own capability: not a reason)
    unpinned = {**arm, "hw.cpu.capability": "SVE256"}
    assert fingerprint.explain(x86, unpinned) == (["hw.cpu.capability: run AVX2, now SVE256"], False)
    native = {**x86, "hw.cpu.mode": "native"}
    differences, expected = fingerprint.explain(native, {**arm, "hw.cpu.mode": "native"})
    assert expected and "hw.cpu.model: run AMD EPYC, now Neoverse N1" in differences
