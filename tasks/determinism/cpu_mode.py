"""Which CPU code paths a run computes with: `determinism.cpu`, auto (the default), portable or native.

auto is portable where the CPU supports it (x86-64 with AVX2 and FMA, or arm64 with NEON: `ARCHITECTURES`)
and a C++ compiler can build its kernels, and native elsewhere, said in one log line; the run's
fingerprint records the mode that ran (`hw.cpu.mode`) and the architecture. portable asked for on a CPU
without it is refused (exit 4). Both architectures compute the same bytes in portable mode
(tests/determinism/test_arm64.py, on an emulated arm64 machine).

CPU kernels pick their code by the CPU they run on, so the same run gives other weight bytes on
another machine (Intel vs AMD, AVX2 vs AVX-512):
- ATen's vectorised kernels (batch norm, activations, reductions, optimisers) are built once per
  instruction set and chosen at start-up; ATEN_CPU_CAPABILITY pins the choice.
- MKL (torch's matrix products and slow-path convolutions) has a reproducibility mode, but its ISA
  branches (MKL_CBWR=AVX2) exist on Intel CPUs only: on AMD it silently runs AUTO, other kernels
  (oneMKL developer guide, "Specifying Code Branches"). Its one vendor-neutral branch, COMPATIBLE
  (SSE2), is slow.
- oneDNN (convolutions) and NNPACK pick kernels and blocking by ISA and cache sizes; no BLAS
  promises an order of additions (OpenBLAS's AVX2 and AVX-512 kernels add in different ones).

Portable mode therefore pins ATen to AVX2 and sends convolutions and matrix products to kernels
whose order is fixed by their definition, whatever the vector width: each element of a product one
chain of fused multiply-adds (tasks/determinism/kernels.py, installed by dispatch.py;
tasks/determinism/blas.py). oneDNN and NNPACK are switched off and MKL is held to COMPATIBLE for
anything that still reaches it. The result is the same bytes on every x86-64 CPU with AVX2, whatever
the thread count. Native mode leaves every library its fastest path.

These variables are read when torch and numpy load, so `pin_env` runs before either is imported
in every process that computes (`python -m tasks`, the flow, DDP ranks); `activate` (torch loaded,
called by `pin_everything`) checks that they were, and refuses to compute otherwise.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from threadpoolctl import threadpool_limits

from tasks.core.config.base import ConfigError
from tasks.core.errors import HardwareMissing

MODES = ("auto", "portable", "native")
log = logging.getLogger(__name__)
# Set with the variables below: the mode this process's environment was pinned for. Children
# inherit both, so a DDP rank or a stage subprocess computes as its launcher does.
MODE_ENV = "LOCKSTEP_CPU"


@dataclass(frozen=True)
class Architecture:
    """What portable mode pins on one architecture, and what it needs of the CPU."""

    aten: str  # ATEN_CPU_CAPABILITY: the one set of ATen's vectorised kernels portable runs
    reports: str  # torch.backends.cpu.get_cpu_capability() once that is pinned
    needs: tuple[str, ...]  # /proc/cpuinfo flags the CPU must list
    flags_key: str  # the /proc/cpuinfo line that lists them


# By platform.machine()'s name (lower case). x86-64: AVX2's kernels, also on AVX-512 CPUs. arm64: NEON's
# (torch's "default" there), also where SVE ones exist; every arm64 CPU has NEON with fused multiply-add.
ARCHITECTURES = {
    "x86_64": Architecture("avx2", "AVX2", ("avx2", "fma"), "flags"),
    "aarch64": Architecture("default", "DEFAULT", ("asimd",), "Features"),
}
_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


def machine() -> str:
    """This CPU's architecture, as ARCHITECTURES names it."""
    name = platform.machine().lower()
    return _ALIASES.get(name, name)


PORTABLE_ENV = {
    "ATEN_CPU_CAPABILITY": ARCHITECTURES.get(machine(), ARCHITECTURES["x86_64"]).aten,
    "MKL_CBWR": "COMPATIBLE,STRICT",  # MKL's one vendor-neutral branch, for what still reaches it
    "MKL_DYNAMIC": "FALSE",  # MKL keeps the thread count it is given
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN is off in portable mode; capped should anything call it
}
_LOADED_FIRST = ("torch", "numpy")


class CpuModeError(ConfigError):
    """The process cannot compute in the configured mode (exit 2 at the entry points)."""


class CpuUnsupported(HardwareMissing):
    """This CPU cannot run the portable mode (exit 4 at the entry points)."""


def cpuinfo() -> dict[str, str]:
    """The first CPU's entries of /proc/cpuinfo (empty where there is none: not Linux). The one reader:
    the fingerprint (tasks/determinism/fingerprint.py, which imports this module) uses it too."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    first = text.split("\n\n", 1)[0]
    return dict(
        (key.strip(), value.strip()) for key, _, value in (line.partition(":") for line in first.splitlines()) if value
    )


def portable_unsupported() -> str | None:
    """Why this CPU cannot compute in portable mode, or None if it can. Read without torch (from the
    platform and /proc/cpuinfo), so that `auto` is resolved before torch loads; `activate` checks
    again, with torch, what ATen then runs."""
    arch = machine()
    if arch not in ARCHITECTURES:
        return f"this CPU is {arch}, neither x86-64 nor arm64"
    info = cpuinfo()
    if not info:
        return None  # no /proc (not Linux): activate's check with torch decides
    flags = info.get(ARCHITECTURES[arch].flags_key, "").split()
    missing = [flag for flag in ARCHITECTURES[arch].needs if flag not in flags]
    return f"this CPU lacks {' and '.join(missing)}" if missing else None


def resolve(mode: str) -> str:
    """`mode` with `auto` decided: the mode this process was already pinned in (a launcher's, which its
    children follow), else portable where this CPU supports it and native elsewhere, said in one line."""
    if mode != "auto":
        return mode
    if os.environ.get(MODE_ENV) in ("portable", "native"):
        return os.environ[MODE_ENV]
    why = portable_unsupported() or _no_compiler()
    if why is None:
        return "portable"
    log.warning(
        "determinism.cpu: auto computes in native mode here (%s; portable needs x86-64 with AVX2 and FMA "
        "or arm64 with NEON, and a C++ compiler for its kernels): the weight bytes depend on this CPU's kind, "
        "and a GPU's are unaffected",
        why,
    )
    return "native"


def _no_compiler() -> str | None:
    """Why portable's C++ op cannot be built here, or None. Without it, portable computes float32 products
    in Python (tasks/determinism/blas.py: the same bytes, far too slow to train with), so `auto` does not
    choose it; `portable` asked for by name still can."""
    compiler = os.environ.get("CXX") or "g++"
    return None if shutil.which(compiler) else f"no C++ compiler ({compiler}) to build its kernels"


def pin_env(mode: str) -> None:
    """Set (portable) or clear (native) the variables, before torch or numpy is imported; `auto` is
    resolved first (`resolve`).

    Native clears only what a portable launcher of ours set (MODE_ENV says so): a variable the user
    set stays, and the run's fingerprint records it.
    """
    if mode not in MODES:
        raise CpuModeError(f"determinism.cpu: {mode!r} is not one of {', '.join(MODES)}")
    mode = resolve(mode)
    if os.environ.get(MODE_ENV) == mode:
        return
    loaded = [name for name in _LOADED_FIRST if name in sys.modules]
    if loaded:
        raise CpuModeError(
            f"determinism.cpu: {mode} must be set before {' and '.join(loaded)} is imported, but this process "
            f"imported it in {os.environ.get(MODE_ENV, 'native')} mode; run the stage as its own process "
            f"(python -m tasks <stage> --params ...), or set {MODE_ENV}={mode} and the variables of "
            "tasks.determinism.cpu_mode.PORTABLE_ENV in its environment"
        )
    if mode == "portable":
        os.environ.update(PORTABLE_ENV)
    elif os.environ.get(MODE_ENV) == "portable":
        for name in PORTABLE_ENV:
            os.environ.pop(name, None)
    os.environ[MODE_ENV] = mode


def clean_env(env: dict[str, str]) -> dict[str, str]:
    """`env` without the variables a portable launcher of ours set, for a child that pins its own mode."""
    if env.get(MODE_ENV) != "portable":
        return {k: v for k, v in env.items() if k != MODE_ENV}
    return {k: v for k, v in env.items() if k != MODE_ENV and k not in PORTABLE_ENV}


def current() -> str:
    """The mode this process's environment was pinned for (native if none)."""
    return os.environ.get(MODE_ENV, "native")


def activate(mode: str, num_threads: int) -> dict[str, Any]:
    """Check that `mode` is in force in this (torch-loaded) process, set its switches; what is in force."""
    # after prepare(): torch (~4 s) loads once the CPU mode's variables are pinned; this module is imported before
    import torch

    from tasks.determinism import dispatch

    mode = resolve(mode)
    pinned = current()
    if pinned != mode:
        raise CpuModeError(
            f"determinism.cpu: {mode}, but this process loaded torch in {pinned} mode (it cannot change "
            "once torch is loaded); run the stage as its own process: python -m tasks <stage> --params ..."
        )
    portable = mode == "portable"
    if portable:
        _check_portable(torch)
    torch.backends.mkldnn.enabled = not portable
    torch.backends.nnpack.set_flags(not portable)
    if portable:
        dispatch.install()
    else:
        dispatch.uninstall()
    # Portable products run on torch's threads (tasks/determinism/blas.py); numpy's OpenBLAS, which
    # neither mode trains with, gets the run's thread count, not one thread per core on top of torch's.
    _set_blas_threads(num_threads)
    return {
        "cpu": mode,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn": torch.backends.mkldnn.enabled,
        "nnpack": torch._C._get_nnpack_enabled(),
        "portable_kernels": dispatch.installed(),
    }


def _check_portable(torch: Any) -> None:
    arch = machine()
    if arch not in ARCHITECTURES:
        raise CpuUnsupported(
            f"determinism.cpu: portable needs an x86-64 CPU with AVX2 or an arm64 one; this is {arch}: use native"
        )
    pinned, expected = ARCHITECTURES[arch].aten, ARCHITECTURES[arch].reports
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != expected:
        raise CpuUnsupported(
            f"determinism.cpu: portable needs ATen's {expected} kernels, but torch runs {capability} "
            f"(a CPU without them, or {MODE_ENV} set without ATEN_CPU_CAPABILITY={pinned}): use native"
        )


def _set_blas_threads(num_threads: int) -> None:
    threadpool_limits(limits=num_threads, user_api="blas")
