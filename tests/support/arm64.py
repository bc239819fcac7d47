"""An arm64 machine on this x86-64 one, for the portable mode's cross-architecture checks (issue 71):
Debian's arm64 Python and the locked arm64 wheels, run under user-mode emulation.

    python -m tests.support.arm64          # the set-up step (`make arm64-env`; .ci/run runs it)

What it builds, once per lock and cached in ~/.cache/lockstep/arm64/<key> (a new key when uv.lock or
this recipe's settings change; built in a temporary folder and renamed, so a half-built one is never used):

- `root/`: a sysroot unpacked from Debian's arm64 packages (python3.11 and the libraries it and torch
  load), with an arm64 `/proc/cpuinfo` and the `midr_el1` files torch's cpuinfo reads (a Neoverse N1's);
- `site/`: the lock's arm64 wheels, all of its main dependencies (torch's aarch64 wheel is a CUDA build:
  its nvidia libraries come too, ~5 GB, since torch loads them at import).

`run_python` runs that Python under `qemu-aarch64-static -cpu neoverse-n1` in a private mount namespace
in which /proc/cpuinfo is the arm64 one (torch reads the x86 one and crashes). C++ is compiled by
Debian's cross compiler (CXX=aarch64-linux-gnu-g++): an x86 program the emulated process starts runs
natively. The emulator runs NEON and FMA instructions exactly, not a real chip's timing: no timing
figure comes from it. The system packages (qemu-user-static, g++-aarch64-linux-gnu) and the arm64
package lists come from Debian's registry, installed by `ensure_system_packages` (root or sudo).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from tasks.determinism import cpu_mode
from tests.conftest import ROOT

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lockstep" / "arm64"
QEMU = "qemu-aarch64-static"
CXX = "aarch64-linux-gnu-g++"
SYSTEM_PACKAGES = ("qemu-user-static", "g++-aarch64-linux-gnu")
# Debian's arm64 packages the sysroot unpacks, with what they depend on (apt's closure, `_closure`)
DEBIAN_ROOTS = ("python3.11", "libstdc++6", "libgomp1")
DEBIAN_SKIP = ("dpkg", "install-info", "tar")  # pulled in by packaging scripts an unpacked root never runs
# The arm64 wheels are the whole lock's (its main dependencies, as `uv export --no-dev` lists them, torch with
# its CUDA libraries most of the ~6 GB): the determinism code needs few of them, `make reproduce` on the
# emulated machine (tests/support/arm64_reproduce.py) needs MLflow, DVC and the rest.
PLATFORM = "aarch64-manylinux_2_28"
PYTHON = "3.11.2"  # Debian 12's python3.11, which the sysroot unpacks
# The CPUs the machine can be, as qemu names them: each one's MIDR_EL1 (implementer 0x41 Arm, variant, part,
# revision) and /proc/cpuinfo's features, as Linux shows them on it. The tests run on the first;
# LOCKSTEP_ARM64_CPU picks another by hand (an SVE one: docs/reproducibility.md, "arm64").
CPUS = {
    # an AWS Graviton 2's and Ampere Altra's core (r3p1): NEON with FMA, no SVE
    "neoverse-n1": (
        "0x00000000413fd0c1",
        "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs",
    ),
    # Fujitsu's A64FX (Fugaku's, r0p0 variant 1): SVE with 512-bit vectors. Debian 12's qemu (7.2) models
    # no Neoverse V1 or V2, the SVE cores of Graviton 3 and 4 and of NVIDIA Grace
    "a64fx": (
        "0x00000000461f0010",
        "fp asimd evtstrm sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm fcma dcpop sve",
    ),
}
CPU = os.environ.get("LOCKSTEP_ARM64_CPU", "neoverse-n1")
CORES = 2
SYSFS_CPUS = "sys/devices/system/cpu"  # torch's cpuinfo reads cpu<n>/regs/identification/midr_el1 there


class Arm64Unavailable(RuntimeError):
    """The emulated arm64 machine cannot be built or run here (one line: what is missing)."""


RECIPE_VERSION = 1  # raise when the build below changes in a way the settings above do not show


def _key() -> str:
    recipe = repr((RECIPE_VERSION, DEBIAN_ROOTS, DEBIAN_SKIP, PYTHON, PLATFORM, CPUS, CORES))
    return hashlib.sha256(recipe.encode() + (ROOT / "uv.lock").read_bytes()).hexdigest()[:16]


def home() -> Path:
    """Where this lock's arm64 machine is (built or not)."""
    return CACHE / _key()


def _sh(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload]
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise Arm64Unavailable(f"{' '.join(command[:4])}... exited {done.returncode}: {' | '.join(tail)}")
    return done


def ensure_system_packages() -> None:
    """The emulator and the cross compiler from Debian, and arm64 in apt's package lists."""
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    foreign = _sh(["dpkg", "--print-foreign-architectures"]).stdout.split()
    missing = [p for p in SYSTEM_PACKAGES if shutil.which(QEMU if p.startswith("qemu") else CXX) is None]
    if "arm64" in foreign and not missing:
        return
    if "arm64" not in foreign:
        _sh([*sudo, "dpkg", "--add-architecture", "arm64"])
    _sh([*sudo, "apt-get", "update", "-qq"])
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _sh([*sudo, "apt-get", "install", "-y", "-qq", "--no-install-recommends", *SYSTEM_PACKAGES], env=env)


def _closure() -> list[str]:
    """The arm64 packages DEBIAN_ROOTS need, by apt's dependency closure (no recommends)."""
    flags = ["--recurse", "--no-recommends", "--no-suggests", "--no-conflicts", "--no-breaks", "--no-replaces"]
    listed = _sh(["apt-cache", "depends", *flags, "--no-enhances", *(f"{p}:arm64" for p in DEBIAN_ROOTS)]).stdout
    names = {line.strip() for line in listed.splitlines() if line.strip().endswith(":arm64") and line[0].isalnum()}
    return sorted(n for n in names if n.split(":")[0] not in DEBIAN_SKIP)


def _build_root(root: Path, scratch: Path) -> None:
    debs = scratch / "debs"
    debs.mkdir()
    root.mkdir(parents=True)
    _sh(["apt-get", "download", *_closure(), "media-types"], cwd=debs)
    for deb in sorted(debs.glob("*.deb")):
        _sh(["dpkg-deb", "-x", str(deb), str(root)])
    (root / SYSFS_CPUS).mkdir(parents=True)  # where run_python mounts the CPU's own (emulated sysfs)
    for name, (midr, features) in CPUS.items():
        (root / "cpus" / name).mkdir(parents=True)
        (root / "cpus" / name / "cpuinfo").write_text("".join(_cpuinfo(n, midr, features) for n in range(CORES)))
        for n in range(CORES):
            ident = root / "cpus" / name / f"cpu{n}/regs/identification"
            ident.mkdir(parents=True)
            (ident / "midr_el1").write_text(midr + "\n")


def _cpuinfo(n: int, midr: str, features: str) -> str:
    """Core n's paragraph of /proc/cpuinfo, as Linux writes it on arm64."""
    code = int(midr, 16)
    implementer, variant, part, revision = (code >> 24) & 0xFF, (code >> 20) & 0xF, (code >> 4) & 0xFFF, code & 0xF
    return (
        f"processor\t: {n}\nBogoMIPS\t: 50.00\nFeatures\t: {features}\nCPU implementer\t: {implementer:#04x}\n"
        f"CPU architecture: 8\nCPU variant\t: {variant:#x}\nCPU part\t: {part:#05x}\nCPU revision\t: {revision}\n\n"
    )


def _build_site(site: Path, scratch: Path) -> None:
    uv = ROOT / ".uv/bin/uv"
    pins = _sh([str(uv), "export", "--frozen", "--no-dev", "--no-hashes", "--no-emit-project"], cwd=ROOT).stdout
    requirements = scratch / "requirements.txt"
    requirements.write_text(pins)
    # Debian 12's Python is 3.11.2: the lock's markers (backports.tarfile below 3.11.4) are evaluated for it
    _sh(
        [str(uv), "pip", "install", "--quiet", "--python-platform", PLATFORM, "--python-version", PYTHON]
        + ["--target", str(site), "-r", str(requirements)]
    )


def build() -> Path:
    """The arm64 machine for this lock: built if missing (minutes, ~6 GB), else as it is."""
    target = home()
    if (target / "ready").exists():
        return target
    ensure_system_packages()
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE, prefix="building-") as tmp:
        scratch = Path(tmp)
        partial = scratch / "machine"
        _build_root(partial / "root", scratch)
        _build_site(partial / "site", scratch)
        (partial / "ready").write_text("built by tests/support/arm64.py\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(partial, target)
    for old in CACHE.iterdir():  # an earlier lock's machine (~5 GB): nothing uses it any more
        if old != target and not old.name.startswith("building-"):
            shutil.rmtree(old, ignore_errors=True)
    return target


# The kernel's binfmt_misc handler for arm64 ELF programs (Debian's /usr/share/binfmts/qemu-aarch64):
# magic and mask of the ELF header's class, byte order and machine (0xb7, AArch64).
BINFMT = Path("/proc/sys/fs/binfmt_misc")
HANDLER = "lockstep-aarch64"
ELF_MAGIC = r"\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00"
ELF_MASK = r"\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff"


def _handled(entry: Path) -> bool:
    text = entry.read_text(errors="replace") if entry.name not in ("register", "status") else ""
    return "enabled" in text and "magic " + ELF_MAGIC.replace("\\x", "") in text


@contextmanager
def binfmt() -> Iterator[None]:
    """While open, the kernel runs arm64 programs through the emulator: the processes an emulated program
    starts (`sys.executable`, as `make reproduce` starts its stages) are emulated too. The handler is
    registered with the F flag (the emulator opened now, so it works in any mount namespace) unless one is
    there, and removed after, as is binfmt_misc's mount if this mounted it (root)."""
    if os.geteuid() != 0:
        raise Arm64Unavailable("emulating an arm64 program's children needs root (binfmt_misc)")
    mounted = not (BINFMT / "register").exists()
    if mounted:
        _sh(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)])
    ours = not any(_handled(entry) for entry in BINFMT.iterdir())
    if ours:
        qemu = shutil.which(QEMU)
        (BINFMT / "register").write_text(f":{HANDLER}:M::{ELF_MAGIC}:{ELF_MASK}:{qemu}:F")
    try:
        yield
    finally:
        if ours:
            (BINFMT / HANDLER).write_text("-1")
        if mounted:
            _sh(["umount", str(BINFMT)])


def run_python(
    args: list[str],
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
    timeout_s: float = 1800,
    children: bool = False,
) -> subprocess.CompletedProcess[str]:
    """arm64 Python with `args`, emulated, in `cwd` (on PYTHONPATH, after the arm64 wheels); its
    CompletedProcess. The C++ op it builds is cached in the machine's own folder, apart from x86's.
    `children`: the arm64 programs it starts run emulated too, on the same CPU and sysroot (`binfmt`)."""
    machine = home()
    if not (machine / "ready").exists():
        raise Arm64Unavailable(f"no arm64 machine at {machine}: run `make arm64-env` first")
    if shutil.which(QEMU) is None or shutil.which(CXX) is None or shutil.which("unshare") is None:
        raise Arm64Unavailable(f"{QEMU}, {CXX} or unshare is missing: run `make arm64-env`")
    root, site = machine / "root", machine / "site"
    python = [QEMU, "-cpu", CPU, "-L", str(root), str(root / "usr/bin/python3.11")]
    cache = machine / "cache"
    cache.mkdir(mode=0o700, exist_ok=True)
    if CPU not in CPUS:
        raise Arm64Unavailable(f"LOCKSTEP_ARM64_CPU={CPU}: expected one of {', '.join(CPUS)}")
    own = root / "cpus" / CPU
    # the CPU's /proc/cpuinfo and sysfs identification, in this process's own mount namespace
    inner = (
        f"mount --bind {shlex.quote(str(own / 'cpuinfo'))} /proc/cpuinfo && "
        f"mount --bind {shlex.quote(str(own))} {shlex.quote(str(root / SYSFS_CPUS))} && "
        f'exec {shlex.join(python)} "$@"'
    )
    # as a stage starts (tests/support/portable.py run_script): no CPU mode or thread settings of this
    # process's, which pinned x86-64's (ATEN_CPU_CAPABILITY=avx2 is no arm64 capability)
    inherited = {
        k: v for k, v in (env if env is not None else os.environ).items() if not k.startswith(("OMP_", "OPENBLAS"))
    }
    child_env = {
        **cpu_mode.clean_env(inherited),
        "CXX": CXX,
        "PYTHONPATH": f"{site}:{cwd}",
        "XDG_CACHE_HOME": str(cache),
        # read by every emulator the kernel starts for a child (`binfmt`) as -cpu and -L
        "QEMU_CPU": CPU,
        "QEMU_LD_PREFIX": str(root),
    }
    with binfmt() if children else nullcontext():
        return subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "bash", "-c", inner, "bash", *args],
            cwd=cwd,
            env=child_env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )


if __name__ == "__main__":
    try:
        print(build())
    except Arm64Unavailable as exc:
        print(f"arm64 machine: {exc}", file=sys.stderr)
        sys.exit(1)
