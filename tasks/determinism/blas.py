"""Matrix products for the portable kernels: each element of a product is one chain of fused
multiply-adds over the inner dimension, in order, from zero, computed by a small C++ op
(blas_pool.cpp, fma_chain.h) on torch's own thread pool.

That definition is what makes the bytes portable: it names one rounding per term and one order, so
a kernel with 16-lane (AVX-512), 8-lane (AVX2) or 4-lane (arm64's NEON) vectors, or a scalar loop, gives
the same bytes; each CPU runs the widest it has. A BLAS promises no order (OpenBLAS's AVX2 and AVX-512 kernels add in
different ones), so products pinned to one BLAS kernel set held their bytes only by running its AVX2
kernels everywhere, AVX-512 CPUs included. Each product is cut into chunks (`plan`) that run on torch's
threads; the cut changes where an element is computed, never its chain, so the bytes are the same on 1
thread or 64. The op is built once per machine with its C++ compiler and kept in a cache
($XDG_CACHE_HOME/lockstep, created 0700). Loading a library runs its code in this process, and its name
is computable by anyone, so a cache folder or library that is not this user's, is a link, or is writable
by group or others, is refused in one line (exit 3), as is a cache below a folder another user owns or
could write (~/.cache and every folder above it are checked; root's, and sticky ones like /tmp, are
fine), not rebuilt elsewhere: whoever could write there may have planted it, and rebuilding in a
private folder on every run would hide that (and cost a compile per process). Where it cannot be
built, float32 products are computed in Python (`emulated`: the same bytes, far slower, and a warning
says so) and float64 ones are refused. The op also takes a grouped
convolution's products in one call, multiplies a convolution's columns without writing them out
(`Fields`, `field_gemm`, the image from `padded_image`), computes its input gradient with col2im at
once (`input_gradient`), col2im alone (`gather_columns`), depthwise convolutions (`depthwise`,
tasks/determinism/depthwise.py), activations (`activation`, tasks/determinism/activations.py), and lays a
large weight gradient out as its weight (`rotated_copy`): `op(name)` gives each.
(torch.utils.cpp_extension.load would build it too, but it wants ninja on PATH and builds a Python
module; g++ alone makes a torch op library.)
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tasks.core.errors import Refused

SOURCE = Path(__file__).with_name("blas_pool.cpp")
# included by SOURCE: part of what the cache key hashes
_HEADERS = tuple(
    Path(__file__).with_name(name)
    for name in (
        "fma_chain.h",
        "depthwise_taps.h",
        "activations.h",
        "normalization.h",
        "products.h",
        "convolution.h",
        "depthwise.h",
        "sampling.h",
    )
)
_MIN_CHUNK = 64  # narrower chunks spend more on packing the shared operand than they gain
_ROWS, _COLUMNS = 12, 32  # the widest kernel's tile (AVX2's, 6 x 16, divides it): chunks of whole tiles
_BUILD_TIMEOUT_S = 300
# -ffp-contract=off: no fused multiply-add but the ones the code asks for (the products' chains): the
# depthwise loops and the activations round a product and a sum apart, as the same code written with torch
# ops (depthwise.py, activations.py) does; without it the op's bytes would follow the compiler.
# -fno-trapping-math: no code reads floating-point exception flags, and without it GCC keeps the
# activations' comparisons as branches and computes them one element at a time (the values are the same)
_FLAGS = ("-O3", "-ffp-contract=off", "-fno-trapping-math", "-std=c++20", "-fPIC", "-shared", "-fopenmp")


def plan(m: int, n: int, threads: int) -> tuple[int, int]:
    """(dimension, chunk size) for a product of m x n on `threads` threads: the longer side of the
    result, cut into one chunk per thread (fewer where chunks would be under `_MIN_CHUNK`), each a
    whole number of the kernel's tiles. The cut changes no byte (each element is its own chain), so
    it follows the threads: one chunk each, no thread waiting on another's second one."""
    dim, extent = (0, m) if m >= n else (1, n)
    chunks = max(1, min(threads, extent // _MIN_CHUNK))
    align = _ROWS if dim == 0 else _COLUMNS
    chunk = -(-extent // chunks)
    return dim, -(-chunk // align) * align


def gemm(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, bias: torch.Tensor | None = None, width: int = 0
) -> torch.Tensor:
    """`out` = a @ b for float32/float64 tensors: 2-D, or 3-D for one product per group (a grouped
    convolution's), made in one call; `out` row-major. An operand whose matrices are neither row-major
    nor transposed is copied first. `bias` (2-D only: one value per column of out, contiguous) is added
    to the product as torch's addmm adds it, one rounding, as the op stores it (no pass of its own).
    `width`: the op's vectors in bits (256 or 512 on x86-64, 128 on arm64; 0 the widest this CPU has),
    for tests: the bytes do not depend on it."""
    a, b = _operand(a), _operand(b)
    chunks = op("gemm_chunks")
    if chunks is not None:
        chunks(a, b, out, *plan(a.shape[-2], b.shape[-1], torch.get_num_threads()), width, bias)
        return out
    if a.dtype != torch.float32:
        raise Refused(
            f"determinism.cpu: portable computes {a.dtype} products only in the C++ op (blas_pool.cpp), "
            "which could not be built here (see the warning above): install a C++ compiler, or use native"
        )
    out.copy_(emulated(a, b))
    return out if bias is None else out.add_(bias)


_ROTATED_BYTES = 2 << 20  # an L2 cache: smaller operands stay in it, and torch's copy is as fast as the op's


def rotated_copy(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` (B, C, R1, R2) = `x` (B, R1, R2, C), element for element (any strides, no overlap): a weight
    gradient's product laid out as the weight. torch's copy of the permuted view reads a row apart per
    element; where x outgrows the cache at a resnet's power-of-two strides (rows a megabyte apart) that
    thrashes it, several times slower than the op's, which copies 16 of out's rows at a time."""
    copy = op("rotated_copy") if x.numel() * x.element_size() >= _ROTATED_BYTES else None
    if copy is not None:
        copy(x.detach(), out)
    else:
        out.copy_(x.permute(0, 3, 1, 2))
    return out


@dataclass(frozen=True)
class Fields:
    """A convolution's columns (im2col's, without groups) left unwritten: `image`, the input padded and
    channels-last (N, Hp, Wp, C), contiguous, and the kernel's size, stride and dilation. Row r of the
    columns is output position r's receptive field, its kernel offsets (i, then j) and channels (fastest)."""

    image: torch.Tensor
    kernel: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]


def field_gemm(
    fields: Fields, b: torch.Tensor, out: torch.Tensor, transposed: bool = False, *, width: int = 0
) -> torch.Tensor:
    """`out` = columns @ b, or columns^T @ b (`transposed`: a weight gradient's), for `fields`' columns:
    the bytes `gemm` gives for the columns written out, gathered strip by strip inside the op instead.
    The op must be built (kernels.py writes the columns out where it is not)."""
    where = plan(out.shape[0], out.shape[1], torch.get_num_threads())
    op("field_chunks")(
        fields.image, _operand(b), out, *fields.kernel, *fields.stride, *fields.dilation, transposed, *where, width
    )
    return out


def emulated(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (float32, 2-D or 3-D) as the op computes it, in torch: each element's chain
    c = fma(a_k, b_k, c) from zero, one k at a time over whole matrices. fma's single rounding comes
    from float64: a product of two float32 values is exact there, the sum is rounded to odd (the
    nearest float64 whose last bit is odd, when it is not exact), and a value rounded to odd with
    53 bits rounds to 24 as the exact one would (Boldo and Melquiond, 2008)."""
    a64, b64 = a.double(), b.double()
    c = torch.zeros((*a.shape[:-1], b.shape[-1]), dtype=torch.float32)
    for k in range(a.shape[-1]):
        p = a64[..., k : k + 1] * b64[..., k : k + 1, :]
        c64 = c.double()
        s = p + c64
        tail = s - p  # TwoSum: s + error == p + c64 exactly
        error = (p - (s - tail)) + (c64 - tail)
        inexact = (error != 0) & error.isfinite() & ((s.view(torch.int64) & 1) == 0)  # and even: not yet odd
        s = torch.where(inexact, torch.nextafter(s, torch.where(error > 0, torch.inf, -torch.inf).double()), s)
        c = s.float()
    return c


def backend() -> str:
    """How products run in this process (for the fingerprint; either way, the same bytes)."""
    widest = op("widest")
    if widest is None:
        return "fma chains in Python, one thread (blas_pool.cpp not built)"
    return f"fma chains, {widest()}-bit vectors, torch thread pool"


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.stride(-2) >= max(1, t.shape[-1])


def _transposed(t: torch.Tensor) -> bool:
    return t.stride(-2) == 1 and t.stride(-1) >= max(1, t.shape[-2])


def _operand(t: torch.Tensor) -> torch.Tensor:
    """`t` as the op takes it: matrices row-major or transposed (as blas_pool.cpp's `operand` checks), else a copy."""
    return t.detach() if _row_major(t) or _transposed(t) else t.detach().contiguous()


# blas_pool.cpp's ops (torch.ops.lockstep_blas.<name>), as its TORCH_LIBRARY block defines them
OPS = frozenset(
    {
        "gemm_chunks",
        "widest",
        "field_chunks",
        "padded_image",
        "input_gradient",
        "gather_columns",
        "depthwise",
        "activation",
        "rotated_copy",
        "layer_norm_backward",
        "softmax_backward",
        "halving_sums",
        "box_muller",
    }
)


def op(name: str) -> Any:
    """torch.ops.lockstep_blas.`name` (one of OPS); None where blas_pool.cpp cannot be built here, and the
    caller computes the same bytes in torch (or refuses)."""
    if name not in OPS:
        raise KeyError(f"blas_pool.cpp has no op {name!r}")
    return getattr(torch.ops.lockstep_blas, name) if _library_loaded() else None


@functools.cache
def _library_loaded() -> bool:
    """Load blas_pool.cpp's ops; False (and one warning) if it cannot be built."""
    try:
        torch.ops.load_library(str(build()))
    except BuildError as exc:
        warnings.warn(
            f"determinism.cpu portable: {exc}; float32 products run in Python (same bytes, far slower), "
            "float64 ones are refused",
            stacklevel=2,
        )
        return False
    return True


class BuildError(RuntimeError):
    """blas_pool.cpp could not be built on this machine."""


def _torch_dir() -> Path:
    """The installed torch package, links resolved: a project whose .venv is a link to another's (or a
    checkout reached by another path) uses the same library rather than compiling its own."""
    return Path(torch.__file__).resolve().parent


def library_path(cache: Path | None = None, compiler: str | None = None) -> Path:
    """Where the op library for this source, this torch and `compiler` is kept."""
    compiler = compiler or os.environ.get("CXX") or "g++"
    torch_dir = _torch_dir()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    sources = b"".join(path.read_bytes() for path in (SOURCE, *_HEADERS))
    key = f"{sources!r} {torch.__version__} {torch_dir} {abi} {compiler} {_FLAGS}"
    key = hashlib.sha256(key.encode())
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lockstep"
    return cache / f"blas_pool-{key.hexdigest()[:16]}.so"


def _check_private(path: Path, folder: bool) -> None:
    """Refuse `path` unless it is a folder (or regular file) of this user's that nobody else can write."""
    info = os.lstat(path)
    if not (stat.S_ISDIR(info.st_mode) if folder else stat.S_ISREG(info.st_mode)):
        problem = "a link or special file" if not stat.S_ISDIR(info.st_mode) else "a folder"
    else:
        problem = _unsafe(info, owners={os.getuid()}, sticky_ok=False)
    if problem is not None:
        fix = f"chmod 700 {path}" if folder and problem.startswith("writable") else f"remove {path}"
        _refuse(path, problem, fix)


def _check_parents(cache: Path) -> None:
    """Refuse a cache below a folder someone else owns or could write (a sticky one like /tmp aside):
    they could rename the private cache folder away and put theirs, library and all, in its place.
    Every folder above it is checked, on its path as given and with links resolved (root's are fine)."""
    cache = Path(os.path.abspath(cache))
    for chain in (cache, cache.resolve()):
        for folder in chain.parents:
            try:
                info = os.stat(folder)
            except FileNotFoundError:  # made below, 0700, by this process
                continue
            problem = _unsafe(info, owners={0, os.getuid()}, sticky_ok=True)
            if problem is not None:
                fix = f"chmod go-w {folder}" if problem.startswith("writable") else "move the cache"
                _refuse(folder, f"{problem}, above the op cache {cache}", fix)


def _unsafe(info: os.stat_result, owners: set[int], sticky_ok: bool) -> str | None:
    """What makes a file or folder writable by someone else than this user, or None."""
    if info.st_uid not in owners:
        return f"owned by uid {info.st_uid}, not by this user ({os.getuid()})"
    if info.st_mode & 0o022 and not (sticky_ok and info.st_mode & stat.S_ISVTX):
        return f"writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _refuse(path: Path, problem: str, fix: str) -> None:
    raise Refused(
        f"{path}: {problem}; the op compiled there would run inside this process, so it is not loaded: {fix}, "
        "or set XDG_CACHE_HOME to a folder only you can write"
    )


def build(cache: Path | None = None, compiler: str | None = None) -> Path:
    """The op library for this source and this torch, built on first use into `cache`
    ($XDG_CACHE_HOME/lockstep by default, created 0700), written to a temporary name and then renamed.
    Raises Refused for a cache folder or library someone else could have written (`_check_private`)."""
    compiler = compiler or os.environ.get("CXX") or "g++"
    torch_dir = _torch_dir()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    target = library_path(cache, compiler)
    cache = target.parent
    _check_parents(cache)
    if os.path.lexists(cache):
        _check_private(cache, folder=True)
    if os.path.lexists(target):
        _check_private(target, folder=False)
        return target
    if shutil.which(compiler) is None:
        raise BuildError(f"no C++ compiler ({compiler}) to build {SOURCE.name}")
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(cache, folder=True)  # (made by someone else between the check above and here)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        partial = Path(scratch) / target.name
        command = [compiler, *_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
        command += [f"-I{torch_dir / 'include'}", f"-I{torch_dir / 'include/torch/csrc/api/include'}"]
        # torch's own libgomp (rpath): the op's parallel region must be torch's OpenMP pool, not a second one
        command += [str(SOURCE), "-o", str(partial), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu"]
        command += [f"-Wl,-rpath,{torch_dir / 'lib'}"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise BuildError(f"{compiler} took over {_BUILD_TIMEOUT_S} s on {SOURCE.name}") from None
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()[-1:]
            raise BuildError(f"{compiler} failed on {SOURCE.name}: {(errors or ['no message'])[0].strip()}")
        partial.chmod(0o700)  # not the umask's choice: a group-writable library would be refused next time
        os.replace(partial, target)
    return target
