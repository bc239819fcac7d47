"""`run_checks`: the groups in order on one device, each row reported as it finishes, under the
project's pinning; the machine described by the runs' own fingerprint (tasks/determinism/fingerprint.py)."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from tasks.determinism.fingerprint import fingerprint
from tasks.tools.gpu_check.checks_ship import compress_export_checks
from tasks.tools.gpu_check.checks_throughput import throughput_checks
from tasks.tools.gpu_check.checks_training import determinism_checks, strict_checks
from tasks.tools.gpu_check.report import FAIL, Check, GpuCheckReport, describe
from tasks.tools.gpu_check.workload import CheckOptions, pin

STEPS: dict[str, Callable[[CheckOptions], Iterator[Check]]] = {
    "strict": strict_checks,
    "determinism": determinism_checks,
    "throughput": throughput_checks,
    "compress": compress_export_checks,
}


def run_checks(options: CheckOptions, on_check: Callable[[Check], None] | None = None) -> GpuCheckReport:
    """Run the checks in `options.groups` on `options.device`; each finished row also goes to `on_check`."""
    started = time.perf_counter()
    determinism = pin(options)  # first: CUBLAS_WORKSPACE_CONFIG before CUDA starts
    device = torch.device(options.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # autocast, empty_cache and friends act on the current device
    machine = fingerprint(_index(device))
    report = GpuCheckReport(
        device=_device_info(device, machine),
        machine=machine,
        versions=_versions(),
        determinism=determinism,
        options={**asdict(options), "groups": list(options.groups)},
        checks=[],
    )
    for group in options.groups:
        group_started = time.perf_counter()
        for check in _guarded(group, STEPS[group](options)):
            report.checks.append(check)
            if on_check is not None:
                on_check(check)
        _release(device)
        report.group_seconds[group] = round(time.perf_counter() - group_started, 2)
    report.wall_s = time.perf_counter() - started
    return report


def _guarded(group: str, checks: Iterator[Check]) -> Iterator[Check]:
    """`checks`, and a FAIL row instead of a crash if the check code itself breaks (another torch
    version on the GPU machine): the rows before it and the other groups still count."""
    try:
        yield from checks
    except Exception as exc:
        yield Check(group, "(check code)", FAIL, f"the check itself failed: {describe(exc)}")


def _index(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return device.index if device.index is not None else torch.cuda.current_device()


def _device_info(device: torch.device, machine: dict[str, str]) -> dict[str, Any]:
    """The device in a few named facts and one summary line, read from the fingerprint's tags."""
    cpu, capability, cores = machine["hw.cpu.model"], machine["hw.cpu.capability"], machine["hw.cpu.count"]
    if device.type != "cuda":
        summary = f"cpu ({cpu}, {capability} kernels, {cores} cores)"
        return {"type": "cpu", "cpu": cpu, "cpu_capability": capability, "cores": _number(cores), "summary": summary}
    info: dict[str, Any] = {
        "type": "cuda",
        "index": _index(device),
        "name": machine["hw.gpu.name"],
        "compute_capability": machine["hw.gpu.capability"],
        "memory_gib": float(machine["hw.gpu.memory_gib"]),
        "count": _number(machine["hw.gpu.count"]),
        "driver": machine["hw.gpu.driver"],
        "cuda_driver_api": machine["hw.gpu.cuda_driver"],
        "cuda": machine["hw.version.cuda"],
        "cudnn": machine["hw.version.cudnn"],
        "nccl": machine["hw.version.nccl"],
        "cpu": cpu,
    }
    info["summary"] = (
        f"{info['name']} (sm {info['compute_capability']}, driver {info['driver']}, CUDA {info['cuda']}, "
        f"cuDNN {info['cudnn']}, NCCL {info['nccl']})"
    )
    return info


def _number(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def _versions() -> dict[str, str]:
    # heavy: torchvision (~3 s beyond torch), only to report its version
    import torchvision

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "numpy": np.__version__,
    }


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
