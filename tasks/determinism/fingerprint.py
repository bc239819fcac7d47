"""The machine a run computed on, as flat `hw.*` tags: what can change weight bytes, and nothing secret.

Every stage run carries it (tasks/stages.py), the model card repeats the train stage's, and
`make reproduce` compares it with the rebuilding machine's (`explain`) to say why bytes differ.
"""

from __future__ import annotations

import os
import platform
import re
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
)
# Keys whose difference changes the bytes in portable mode (kernels pinned) ...
PORTABLE_KEYS = (
    "hw.cpu.mode",
    "hw.cpu.capability",
    "hw.cpu.openblas",
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


def _cpuinfo() -> dict[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:  # not Linux: platform's answer below
        return {}
    first = text.split("\n\n", 1)[0]
    return dict(
        (key.strip(), value.strip()) for key, _, value in (line.partition(":") for line in first.splitlines()) if value
    )


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


def _cpu(torch: Any) -> dict[str, str]:
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    return {
        "hw.cpu.vendor": info.get("vendor_id", platform.processor() or "unknown"),
        "hw.cpu.model": re.sub(r"\s+", " ", info.get("model name", platform.machine())),
        "hw.cpu.flags": " ".join(f for f in ISA_FLAGS if f in flags) or "none",
        "hw.cpu.cache": _caches(),
        "hw.cpu.count": str(os.cpu_count()),
        "hw.cpu.capability": torch.backends.cpu.get_cpu_capability(),
        "hw.threads": str(torch.get_num_threads()),
    }


def _versions(torch: Any) -> dict[str, str]:
    import numpy

    from tasks.determinism import blas  # loads torch: not at module level

    config = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version (\S+)", config)
    onednn = re.search(r"MKL-DNN v(\S+)", config)
    return {
        "hw.version.torch": torch.__version__,
        "hw.version.numpy": numpy.__version__,
        "hw.version.mkl": mkl.group(1) if mkl else "none",
        "hw.version.onednn": onednn.group(1) if onednn else "none",
        "hw.version.openblas": str(blas.openblas().get("version", "none")),
    }


def _gpu(torch: Any) -> dict[str, str]:
    if not torch.cuda.is_available():
        return {}
    props = torch.cuda.get_device_properties(0)
    driver = Path("/proc/driver/nvidia/version")
    found = re.search(r"Kernel Module\s+(\S+)", driver.read_text()) if driver.exists() else None
    return {
        "hw.gpu.name": props.name,
        "hw.gpu.capability": f"{props.major}.{props.minor}",
        "hw.gpu.count": str(torch.cuda.device_count()),
        "hw.gpu.driver": found.group(1) if found else "unknown",
        "hw.version.cuda": str(torch.version.cuda),
        "hw.version.cudnn": str(torch.backends.cudnn.version()),
        "hw.version.nccl": ".".join(map(str, torch.cuda.nccl.version())),
    }


def fingerprint() -> dict[str, str]:
    """This process's machine, libraries and CPU mode as `hw.*` strings (torch loaded and pinned)."""
    import torch

    tags = {
        "hw.cpu.mode": cpu_mode.current(),
        "hw.cpu.openblas": cpu_mode.blas_coretype() or "none",
        **_cpu(torch),
        **_versions(torch),
        **_gpu(torch),
    }
    tags.update({f"hw.env.{name}": os.environ.get(name, "unset") for name in _ENV})
    if cpu_mode.current() == "portable":
        from tasks.determinism import blas

        tags["hw.cpu.products"] = blas.backend()  # speed only: the same bytes either way
    return tags


def explain(run: dict[str, str], now: dict[str, str], device: str = "cpu") -> tuple[list[str], bool]:
    """Why the bytes of a run and of its rebuild may differ: (the differences that explain it, expected).

    `expected` is True when the bytes were never meant to match: the run was made in native mode on
    another CPU (then compare metrics instead). An empty list for differing bytes is a bug.
    """
    if not any(key.startswith("hw.") for key in run):
        return ["the run records no hardware fingerprint (made before lockstep recorded one)"], False
    mode = run.get("hw.cpu.mode", "native")
    keys = NATIVE_KEYS if mode == "native" or now.get("hw.cpu.mode") != mode else PORTABLE_KEYS
    if device.startswith("cuda"):
        keys = (*keys, *GPU_KEYS)
    differences = [
        f"{key}: run {run.get(key, 'not recorded')}, now {now.get(key, 'unknown')}"
        for key in keys
        if key in now and run.get(key) != now[key]
    ]
    other_cpu = any(run.get(k) != now.get(k) for k in ("hw.cpu.vendor", "hw.cpu.model", "hw.cpu.flags", "hw.cpu.cache"))
    return differences, mode == "native" and other_cpu
