"""torch's half of pinning: its seeds, thread count and switches, and the RNG states checkpoints keep.

`pin_everything` is what tasks/determinism/bootstrap.py's `start` calls (every entry point's one start)
once torch may load; the dict it returns is logged with the run, so a run records the settings it was
produced under. DataLoaders get their generator and worker seeding from `loader_kwargs`.
"""

from __future__ import annotations

import logging
import os
import random
import sys
from typing import Any

import numpy as np
import torch

from tasks.determinism import cpu_mode
from tasks.determinism.seeds import pin_seeds
from tasks.determinism.threads import LoadFollower, NumThreads, resolve

# cuBLAS needs this before CUDA initialises to pick deterministic workspaces.
CUBLAS_WORKSPACE_CONFIG = ":4096:8"
log = logging.getLogger(__name__)
_follower: LoadFollower | None = None  # set by pin_everything where the count follows the load


def pin_everything(seed: int, num_threads: NumThreads, strict: bool = True, cpu: str | None = None) -> dict[str, Any]:
    """Seed python, numpy and torch (all devices) and pin every backend switch.

    `strict` turns on `torch.use_deterministic_algorithms`; a stage that uses ops with no
    deterministic implementation (eager int8 kernels) passes `strict=False` and says so in its
    run: the flag is then in warn-only mode rather than silently off. `cpu` is `determinism.cpu`
    (tasks/determinism/cpu_mode.py); None: the mode this process was started in. `num_threads`
    may be `auto` (tasks/determinism/threads.py).
    """
    pin_seeds(seed)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.manual_seed(seed)  # seeds every CUDA device too
    mode = cpu_mode.resolve(cpu or cpu_mode.current())
    threads = resolve(num_threads, follow_load=mode == "portable")  # portable bytes do not follow it
    torch.set_num_threads(threads)
    global _follower
    _follower = LoadFollower(resolve(num_threads)) if mode == "portable" and num_threads == "auto" else None
    cpu_settings = cpu_mode.activate(mode, threads)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    _use_deterministic_algorithms(warn_only=not strict)
    return {**settings(), **cpu_settings}


def allow_fast_kernels() -> None:
    """The other side of a benchmark of pinning's cost (B8, gpu_check's throughput): nondeterministic
    kernels allowed and cuDNN's autotuner on, after `pin_everything`; TF32 stays off, so a ratio is the
    price of determinism alone. Nothing that records a run computes this way."""
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False
    torch.backends.cudnn.benchmark = True


def follow_load() -> None:
    """Under `num_threads: auto` in portable mode (whose bytes do not follow the count), compute from now
    on with the cores other processes left idle since the last call (tasks/determinism/threads.py's
    LoadFollower): the training loop calls it before each epoch. Elsewhere it does nothing."""
    count = _follower.count() if _follower is not None else None
    if count is not None and count != torch.get_num_threads():
        log.info("other processes' load changed: computing with %d thread(s), not %d", count, torch.get_num_threads())
        torch.set_num_threads(count)


def _use_deterministic_algorithms(warn_only: bool) -> None:
    """`torch.use_deterministic_algorithms(True, warn_only=...)`, without its ~3.5 s import.

    The public call also sets `torch._inductor.config.deterministic`, and importing that config
    pulls in torch._dynamo: 3.5 s in every stage process, most of which never compile anything.
    Inductor reads the same setting from TORCHINDUCTOR_DETERMINISTIC when it is first imported,
    so set it there (and directly, if inductor is already loaded), then the flag itself.
    """
    os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None:
        inductor_config.deterministic = True
    torch._C._set_deterministic_algorithms(True, warn_only=warn_only)


def settings() -> dict[str, Any]:
    """The determinism switches in force right now (what a run logs as tags)."""
    return {
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "num_threads": torch.get_num_threads(),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""),
        "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", ""),
    }


def rng_state() -> dict[str, Any]:
    """Every RNG this process draws from, as JSON-ready values (resumable checkpoints store it)."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"]:
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _seed_worker(worker_id: int) -> None:
    # torch seeds each worker from the loader's generator; derive numpy/random from it so any
    # library used inside a Dataset is reproducible too.
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)
    # A worker computes too (an augmentation policy's sharpness filter is a convolution): in the mode the
    # training process runs in, which it inherits through the environment (a forkserver child starts bare).
    if cpu_mode.current() == "portable":
        cpu_mode.activate("portable", 1)


def loader_kwargs(seed: int) -> dict[str, Any]:
    """DataLoader arguments that make shuffling and worker RNG a function of `seed` alone."""
    return {"generator": torch.Generator().manual_seed(seed), "worker_init_fn": _seed_worker}
