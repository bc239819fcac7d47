"""How every process starts: `start`, the one call that pins a process, and `bootstrap`, its first half
for an entry point that reads params.yaml before its heavy imports.

A process is pinned in two halves, in this order:
1. `prepare`, before torch and numpy load (they read these once, when they are imported): the CPU mode's
   variables (cpu_mode.py `pin_env`) and how OpenMP's threads wait (threads.py `pin_waiting`);
2. the seeds (seeds.py `pin_seeds`: Python's hash seed, `random`, numpy) and, in a process that computes
   with torch, torch's seeds, thread count and switches (pinning.py `pin_everything`).

`start` does both, and returns the settings a run logs. Every entry point calls it: the stage runner
once per stage (`python -m tasks <stage>`, the pipeline flow, a sweep's trials), a DDP rank, the
reproduce probe, gpu_check once per case, each benchmark with its thread count. One that reads
params.yaml first and imports heavy modules before it computes (`python -m tasks`, the flows, a DDP
launcher, the benchmarks) calls `bootstrap` first, and `start` then finds its environment in place.
The processes they start inherit it. Prefect's settings are not pinning: flows/prefect_settings.py,
called by the flows' entry points.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.core.config.params import Params
from tasks.core.config.yaml_io import PARAMS_FILE, load_params, with_overrides
from tasks.core.processes import tune_collector
from tasks.determinism import cpu_mode
from tasks.determinism.threads import NumThreads, pin_waiting

# what a process that never loads torch records for it (the data stages compute with numpy alone)
WITHOUT_TORCH = "not loaded: the stage computes with numpy alone"


def bootstrap(params_file: str | Path = PARAMS_FILE, overrides: dict[str, Any] | None = None) -> Params:
    """`params_file` with `overrides` applied (not written), validated; this process prepared for it
    (`prepare`: before torch and numpy load).

    Raises ConfigError (exit 2 at the entry points) for bad params, or for a CPU mode that can no
    longer be set because torch or numpy is already loaded in another one.
    """
    params = with_overrides(params_file, overrides)[1] if overrides else load_params(params_file)
    prepare(params.determinism.cpu)
    return params


def prepare(cpu: str | None = None) -> None:
    """The environment torch and numpy read when they load: `determinism.cpu`'s variables (None: the
    mode this process was started in, left as it is) and how OpenMP's threads wait. Before either is
    imported; again later, it changes nothing (a mode torch was not loaded in is refused: CpuModeError).
    And the collector set for a process that imports large libraries, its full collections rare and none at
    exit (processes.py `tune_collector`): every entry point comes here first, before those imports."""
    tune_collector()
    if cpu is not None:
        cpu_mode.pin_env(cpu)
    pin_waiting()


def start(
    seed: int, num_threads: NumThreads, *, strict: bool = True, cpu: str | None = None, torch: bool = True
) -> dict[str, Any]:
    """This process pinned to compute with `seed` on `num_threads` threads (a count, or `auto`), in CPU
    mode `cpu` (None: the one it was started in); what it logs as `determinism.*` tags.

    `torch=False`: a process that computes with numpy alone (the data stages) pins its seeds and never
    loads torch, which costs seconds. `strict`: torch's deterministic algorithms, raising on an op that
    has none (False: warn-only, for the stages with eager int8 kernels).
    """
    prepare(cpu)
    if not torch:
        from tasks.determinism.seeds import pin_seeds  # imports numpy: after `prepare`

        return {**pin_seeds(seed), "cpu": cpu_mode.current(), "torch": WITHOUT_TORCH}
    from tasks.determinism.pinning import pin_everything  # imports torch: after `prepare`

    return pin_everything(seed, num_threads, strict, cpu)
