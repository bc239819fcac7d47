"""Matrix products for the portable kernels: numpy's OpenBLAS on its Haswell kernels, on one
thread, each product cut into chunks that run on torch's own thread pool.

Why not OpenBLAS's own threads: they and torch's OpenMP threads take turns on the same cores, and
every turn costs a wake-up, or a spinning thread in the other's way; on small layers that costs as
much as the product. Running the chunks on torch's pool leaves one pool and no turns.

A product's bytes depend on how it is cut (OpenBLAS's edge kernels add in another order), so the
cut is decided by the shape alone (`plan`), never by the thread count: the same bytes on 1 thread
or 64. The pool is a small C++ op (blas_pool.cpp), built once per machine with its C++ compiler
and kept in a cache ($XDG_CACHE_HOME/lockstep, created 0700). Loading a library runs its code in
this process, and its name is computable by anyone, so a cache folder or library that is not this
user's, is a link, or is writable by group or others, is refused in one line (exit 3), not rebuilt
elsewhere: whoever could write there may have planted it, and rebuilding in a private folder on
every run would hide that (and cost a compile per process). Where it cannot be built, the same
calls run from Python, one chunk after another: the same bytes, slower, and a warning says so.
The op also takes a grouped convolution's products in one call (Python's call per group cost more
than a small group's product), does the convolutions' im2col and col2im (`image_columns_op`, `columns_op`)
and computes depthwise convolutions (`depthwise_op`, tasks/determinism/depthwise.py).
(torch.utils.cpp_extension.load would build it too, but it wants ninja on PATH and builds a Python
module; g++ alone makes a torch op library.)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from tasks.core.errors import Refused

SOURCE = Path(__file__).with_name("blas_pool.cpp")
_MAX_CHUNKS = 8  # enough for 8 threads; a multiple of 2 and 4, so those counts share the work evenly
_MIN_CHUNK = 64  # narrower chunks spend more on packing the shared operand than they gain
_ALIGN = 4  # OpenBLAS's Haswell tiles are multiples of 4 wide: no chunk ends in a narrow edge tile
_BUILD_TIMEOUT_S = 300
# -ffp-contract=off: no fused multiply-add, which rounds a product and a sum once where the same loops
# written with torch ops (depthwise.py) round twice; without it the op's bytes would follow the compiler
_FLAGS = ("-O3", "-ffp-contract=off", "-std=c++20", "-fPIC", "-shared", "-fopenmp")
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS enums


class _Blas:
    """numpy's OpenBLAS, bound once per process."""

    def __init__(self, path: str) -> None:
        self.path = path
        library = ctypes.CDLL(path)  # already loaded by numpy: the same library, not a second copy
        index, pointer = ctypes.c_int64, ctypes.c_void_p  # numpy's OpenBLAS is ILP64
        self.gemm = {}
        kinds = ((torch.float32, "sgemm", ctypes.c_float), (torch.float64, "dgemm", ctypes.c_double))
        for dtype, name, scalar in kinds:
            function = getattr(library, f"scipy_cblas_{name}64_")
            function.argtypes = [ctypes.c_int] * 3 + [index] * 3 + [scalar, pointer, index, pointer, index]
            function.argtypes += [scalar, pointer, index]
            function.restype = None
            self.gemm[dtype] = function


def openblas() -> dict[str, Any]:
    """What threadpoolctl reads from numpy's OpenBLAS itself (architecture, version, file, ...); {}
    if none. Numpy's, not another package's: scipy, for one, brings its own OpenBLAS (another
    version, another interface), and threadpoolctl lists the libraries in no fixed order."""
    import numpy
    from threadpoolctl import threadpool_info

    site = Path(numpy.__file__).resolve().parent.parent
    found = [info for info in threadpool_info() if info.get("internal_api") == "openblas"]
    ours = [info for info in found if Path(info["filepath"]).resolve().parent in (site / "numpy.libs", site / "numpy")]
    return (ours or found or [{}])[0]


@functools.cache
def _blas() -> _Blas:
    path = openblas().get("filepath")
    if not path:
        raise RuntimeError("determinism.cpu: portable needs numpy's OpenBLAS, and numpy has none here")
    return _Blas(path)


def plan(m: int, n: int) -> tuple[int, int]:
    """(dimension, chunk size) for a product of m x n: the longer side of the result, cut into at
    most `_MAX_CHUNKS` near-equal chunks of at least `_MIN_CHUNK`, rounded up to `_ALIGN`."""
    dim, extent = (0, m) if m >= n else (1, n)
    chunks = max(1, min(_MAX_CHUNKS, extent // _MIN_CHUNK))
    chunk = -(-extent // chunks)
    return dim, -(-chunk // _ALIGN) * _ALIGN


def gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, pool: bool = True) -> torch.Tensor:
    """`out` = a @ b for float32/float64 tensors: 2-D, or 3-D for one product per group (a grouped
    convolution's), made in one call; `out` row-major. An operand whose matrices are neither row-major
    nor transposed is copied first. `pool=False` makes the same calls one after another."""
    a, b = _operand(a), _operand(b)
    dim, chunk = plan(a.shape[-2], b.shape[-1])
    op = _pool_op() if pool else None
    if op is not None:
        op(a, b, out, dim, chunk)
    elif a.dim() == 2:
        _sequential(a, b, out, dim, chunk)
    else:
        for a_group, b_group, out_group in zip(a, b, out, strict=True):
            _sequential(a_group, b_group, out_group, dim, chunk)
    return out


def backend() -> str:
    """Where the products run in this process (for the fingerprint; either way, the same bytes)."""
    return "torch thread pool" if _pool_op() is not None else "one thread (blas_pool.cpp not built)"


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.stride(-2) >= max(1, t.shape[-1])


def _transposed(t: torch.Tensor) -> bool:
    return t.stride(-2) == 1 and t.stride(-1) >= max(1, t.shape[-2])


def _operand(t: torch.Tensor) -> torch.Tensor:
    """`t` as BLAS takes it: matrices row-major or transposed (as blas_pool.cpp's `operand` checks), else a copy."""
    return t.detach() if _row_major(t) or _transposed(t) else t.detach().contiguous()


def _layout(t: torch.Tensor) -> tuple[int, int]:
    return (_NO_TRANS, t.stride(0)) if _row_major(t) else (_TRANS, t.stride(1))


def _sequential(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, dim: int, chunk: int) -> None:
    """blas_pool.cpp's calls, made from here: keep the two in step."""
    (m, k), n = a.shape, b.shape[1]
    (trans_a, lda), (trans_b, ldb), ldc = _layout(a), _layout(b), out.stride(0)
    size = a.element_size()
    call = _blas().gemm[a.dtype]
    for start in range(0, m if dim == 0 else n, chunk):
        pa, pb, pc, rows, cols = a.data_ptr(), b.data_ptr(), out.data_ptr(), m, n
        if dim == 0:  # rows of out: rows of a
            rows = min(chunk, m - start)
            pa += start * (lda if trans_a == _NO_TRANS else 1) * size
            pc += start * ldc * size
        else:  # columns of out: columns of b
            cols = min(chunk, n - start)
            pb += start * (1 if trans_b == _NO_TRANS else ldb) * size
            pc += start * size
        call(_ROW_MAJOR, trans_a, trans_b, rows, cols, k, 1, pa, lda, pb, ldb, 0, pc, ldc)


def _pool_op() -> Any:
    """torch.ops.lockstep_blas.gemm_chunks, bound to numpy's OpenBLAS; None if the op cannot be built here."""
    return torch.ops.lockstep_blas.gemm_chunks if _library_loaded() else None


def depthwise_op() -> Any:
    """torch.ops.lockstep_blas.depthwise (tasks/determinism/depthwise.py's loops in C++); None if the op cannot be
    built here."""
    return torch.ops.lockstep_blas.depthwise if _library_loaded() else None


def image_columns_op() -> Any:
    """torch.ops.lockstep_blas.image_columns (im2col without groups: kernels.py's copies, an image at a time);
    None if the op cannot be built here."""
    return torch.ops.lockstep_blas.image_columns if _library_loaded() else None


def columns_op() -> Any:
    """torch.ops.lockstep_blas.gather_columns (a convolution's col2im: kernels.py's loop's sums, each input
    position's in one pass); None if the op cannot be built here."""
    return torch.ops.lockstep_blas.gather_columns if _library_loaded() else None


@functools.cache
def _library_loaded() -> bool:
    """Load blas_pool.cpp's ops, bound to numpy's OpenBLAS; False (and one warning) if it cannot be built."""
    try:
        torch.ops.load_library(str(build()))
    except BuildError as exc:
        warnings.warn(f"determinism.cpu portable: {exc}; products run on one thread (same bytes, slower)", stacklevel=2)
        return False
    torch.ops.lockstep_blas.bind(_blas().path)
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
    key = f"{SOURCE.read_bytes()!r} {torch.__version__} {torch_dir} {abi} {compiler} {_FLAGS}"
    key = hashlib.sha256(key.encode())
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lockstep"
    return cache / f"blas_pool-{key.hexdigest()[:16]}.so"


def _check_private(path: Path, folder: bool) -> None:
    """Refuse `path` unless it is a folder (or regular file) of this user's that nobody else can write."""
    info = os.lstat(path)
    if not (stat.S_ISDIR(info.st_mode) if folder else stat.S_ISREG(info.st_mode)):
        problem = "a link or special file" if not stat.S_ISDIR(info.st_mode) else "a folder"
    elif info.st_uid != os.getuid():
        problem = f"owned by uid {info.st_uid}, not by this user ({os.getuid()})"
    elif info.st_mode & 0o022:
        problem = f"writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    else:
        return
    fix = f"chmod 700 {path}" if folder and problem.startswith("writable") else f"remove {path}"
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
