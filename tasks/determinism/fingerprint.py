"""The machine a run computed on, as flat `hw.*` tags: what can change weight bytes, what names the
machine, and nothing secret. The one place that reads machine facts (/proc, sysfs, the NVIDIA driver).

Every stage run carries it (tasks/runner.py), the model card repeats the train stage's,
`make reproduce` compares it with the rebuilding machine's (`explain`) to say why bytes differ, and
the GPU check (tasks/tools/gpu_check/) and the benchmarks (benchmarks/harness.py) report it. It loads
nothing the pinning (pinning.py) does not: the GPU check runs it on a bare CUDA machine.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from tasks.determinism import cpu_mode

# The ISA extensions that decide which kernels a library picks (ATen, oneDNN, MKL, OpenBLAS).
ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    # arm64's (/proc/cpuinfo "Features"): NEON, its half/dot-product forms, SVE, bfloat16 and int8 matrices
    "asimd",
    "asimdhp",
    "asimddp",
    "sve",
    "sve2",
    "bf16",
    "i8mm",
)
# Keys whose difference changes the bytes in portable mode (kernels pinned) ...
PORTABLE_KEYS = (
    "hw.cpu.mode",
    "hw.cpu.capability",
    "hw.threads",
    "hw.version.torch",
    "hw.version.numpy",
)
# ... and in native mode, where each library picks its kernels from the CPU and its caches.
NATIVE_KEYS = (
    *PORTABLE_KEYS,
    "hw.cpu.vendor",
    "hw.cpu.model",
    "hw.cpu.flags",
    "hw.cpu.cache",
    "hw.version.mkl",
    "hw.version.onednn",
    "hw.env.ATEN_CPU_CAPABILITY",
    "hw.env.MKL_CBWR",
    "hw.env.ONEDNN_MAX_CPU_ISA",
)
GPU_KEYS = (
    "hw.gpu.name",
    "hw.gpu.capability",
    "hw.gpu.count",
    "hw.version.cuda",
    "hw.version.cudnn",
    "hw.version.nccl",
)
_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "OPENBLAS_CORETYPE")


def _caches() -> str:
    """L1d/L2/L3 sizes: blocking in oneDNN and MKL follows them."""
    found = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        if kind != "Instruction":
            found.append(f"L{level}{'d' if kind == 'Data' else ''} {size}")
    return ", ".join(found) or "unknown"


# arm64's /proc/cpuinfo names no vendor or model, only codes (as Linux's arch/arm64/include/asm/cputype.h)
ARM_IMPLEMENTERS = {
    "0x41": "Arm",
    "0xc0": "Ampere",
    "0x4e": "NVIDIA",
    "0x61": "Apple",
    "0x48": "HiSilicon",
    "0x46": "Fujitsu",
}
ARM_PARTS = {
    ("0x41", "0xd0c"): "Neoverse N1",  # AWS Graviton2, Ampere Altra
    ("0x41", "0xd40"): "Neoverse V1",  # Graviton3
    ("0x41", "0xd49"): "Neoverse N2",
    ("0x41", "0xd4f"): "Neoverse V2",  # NVIDIA Grace, Graviton4
    ("0x41", "0xd84"): "Neoverse V3",
    ("0x41", "0xd8e"): "Neoverse N3",
    ("0xc0", "0xac3"): "AmpereOne",
    ("0x46", "0x001"): "A64FX",  # Fugaku: SVE, 512-bit
}


def cpu_facts() -> dict[str, str]:
    """The CPU as /proc/cpuinfo and sysfs describe it, without loading torch."""
    info = cpu_mode.cpuinfo()
    flags = set(info.get("flags", "").split()) | set(info.get("Features", "").split())
    vendor, model = info.get("vendor_id"), info.get("model name")
    implementer, part = info.get("CPU implementer", "").lower(), info.get("CPU part", "").lower()
    if implementer:  # arm64
        vendor = vendor or ARM_IMPLEMENTERS.get(implementer, f"implementer {implementer}")
        model = model or ARM_PARTS.get((implementer, part), f"part {part}")
    return {
        "hw.cpu.arch": cpu_mode.machine(),  # (x86-64 and arm64 compute the same portable bytes)
        "hw.cpu.vendor": vendor or platform.processor() or "unknown",
        "hw.cpu.model": re.sub(r"\s+", " ", model or platform.machine()),
        "hw.cpu.flags": " ".join(f for f in ISA_FLAGS if f in flags) or "none",
        "hw.cpu.cache": _caches(),
        "hw.cpu.count": str(os.cpu_count()),
    }


def _cpu(torch: Any) -> dict[str, str]:
    return {
        "hw.cpu.capability": torch.backends.cpu.get_cpu_capability(),
        "hw.threads": str(torch.get_num_threads()),
    }


def _versions(torch: Any) -> dict[str, str]:
    config = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version (\S+)", config)
    onednn = re.search(r"MKL-DNN v(\S+)", config)
    return {
        "hw.version.torch": torch.__version__,
        "hw.version.mkl": mkl.group(1) if mkl else "none",
        "hw.version.onednn": onednn.group(1) if onednn else "none",
    }


def _gpu(torch: Any, index: int) -> dict[str, str]:
    if not torch.cuda.is_available():
        return {}
    props = torch.cuda.get_device_properties(index)
    return {
        "hw.gpu.name": props.name,
        "hw.gpu.capability": f"{props.major}.{props.minor}",
        "hw.gpu.count": str(torch.cuda.device_count()),
        "hw.gpu.memory_gib": str(round(props.total_memory / 2**30, 1)),
        "hw.gpu.driver": nvidia_driver(),
        "hw.gpu.cuda_driver": cuda_driver_api(),
        "hw.version.cuda": str(torch.version.cuda),
        "hw.version.cudnn": str(torch.backends.cudnn.version()),
        "hw.version.nccl": _nccl(torch),
    }


def nvidia_driver(proc: Path = Path("/proc/driver/nvidia/version")) -> str:
    """The NVIDIA kernel driver's version: from /proc (no process started), else as nvidia-smi prints it;
    torch itself does not expose it."""
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06 ..." or, for the open modules,
    # "... UNIX Open Kernel Module for x86_64  580.159.04 ...": the first version number after it
    found = re.search(r"Kernel Module\b.*?\s(\d+(?:\.\d+)+)\s", proc.read_text()) if proc.exists() else None
    if found:
        return found.group(1)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown"
    try:
        done = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else "unknown"


def cuda_driver_api() -> str:
    """The CUDA version the driver supports (cuDriverGetVersion), e.g. 12.8; torch's own is the runtime's."""
    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"{version.value // 1000}.{version.value % 1000 // 10}"
    except (OSError, AttributeError):
        pass
    return "unknown"


def _nccl(torch: Any) -> str:
    try:
        version = torch.cuda.nccl.version()
    except Exception as exc:  # a build without NCCL
        return f"unknown ({type(exc).__name__})"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def fingerprint(gpu: int = 0, with_torch: bool = True) -> dict[str, str]:
    """This process's machine, libraries and CPU mode as `hw.*` strings (torch loaded and pinned);
    `gpu`: the CUDA device whose name, capability and memory are read. `with_torch=False`: what a
    process that computes with numpy alone (the data stages) can say without loading torch."""
    # after prepare(): numpy reads the pinned environment when it loads
    import numpy

    tags = {"hw.cpu.mode": cpu_mode.current(), **cpu_facts(), "hw.version.numpy": numpy.__version__}
    tags.update({f"hw.env.{name}": os.environ.get(name, "unset") for name in _ENV})
    if with_torch:
        tags.update(_torch_facts(gpu))
    return tags


def _torch_facts(gpu: int) -> dict[str, str]:
    # after prepare(): torch (~4 s) loads once the CPU mode is pinned, and only with_torch
    import torch

    tags = {
        **_cpu(torch),
        **_versions(torch),
        **_gpu(torch, gpu),
    }
    if cpu_mode.current() == "portable":
        # after prepare(): blas loads torch (~4 s) once the CPU mode is pinned
        from tasks.determinism import blas

        tags["hw.cpu.products"] = blas.backend()  # speed only: the same bytes either way
    return tags


def _as_pinned(facts: dict[str, str]) -> bool:
    """Whether a fingerprint's ATen capability is the one portable pins on its architecture (x86-64 where a
    run recorded none: the one portable architecture before arm64)."""
    architecture = cpu_mode.ARCHITECTURES.get(facts.get("hw.cpu.arch", "x86_64"))
    return architecture is not None and facts.get("hw.cpu.capability") == architecture.reports


def explain(run: dict[str, str], now: dict[str, str], device: str = "cpu") -> tuple[list[str], bool]:
    """Why the bytes of a run and of its rebuild may differ: (the differences that explain it, expected).

    `expected` is True when the bytes were never meant to match: the run was made in native mode on
    another CPU (then compare metrics instead). An empty list for differing bytes is a bug.
    """
    if not any(key.startswith("hw.") for key in run):
        return ["the run records no hardware fingerprint (made before lockstep recorded one)"], False
    mode = run.get("hw.cpu.mode", "native")
    if now.get("hw.cpu.mode", mode) != mode:  # e.g. determinism.cpu: auto, rebuilt on a CPU without AVX2
        return [
            f"hw.cpu.mode: the run computed in {mode} mode, this machine in {now['hw.cpu.mode']} mode "
            "(determinism.cpu: auto is portable only on x86-64 CPUs with AVX2 and FMA and on arm64 ones)"
        ], True
    keys = NATIVE_KEYS if mode == "native" else PORTABLE_KEYS
    if device.startswith("cuda"):
        keys = (*keys, *GPU_KEYS)
    differences = [
        f"{key}: run {run.get(key, 'not recorded')}, now {now.get(key, 'unknown')}"
        for key in keys
        if key in now
        and run.get(key) != now[key]
        # (each architecture pins its own ATen capability, AVX2 or NEON's: both give portable's bytes)
        and not (key == "hw.cpu.capability" and mode == "portable" and _as_pinned(run) and _as_pinned(now))
    ]
    other_cpu = any(run.get(k) != now.get(k) for k in ("hw.cpu.vendor", "hw.cpu.model", "hw.cpu.flags", "hw.cpu.cache"))
    return differences, mode == "native" and other_cpu
