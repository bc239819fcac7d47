"""Every entry point's first call: params.yaml validated, then the process set up for it before torch
and numpy load.

torch and numpy read the CPU mode's variables (tasks/determinism/cpu_mode.py), and torch's OpenMP how
long its threads spin (tasks/determinism/threads.py), once, when they are imported, so these must be
in force before anything imports them: `bootstrap` is called by each entry point (`python -m tasks`,
the flows, a DDP rank, the benchmarks) before its heavy imports, and the processes they start
inherit them. Prefect's settings, which Prefect likewise reads when it is
imported, are applied by importing the flows package (flows/__init__.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.core.config.params import Params
from tasks.core.config.yaml_io import PARAMS_FILE, load_params, with_overrides
from tasks.determinism.cpu_mode import pin_env
from tasks.determinism.threads import pin_waiting


def bootstrap(params_file: str | Path = PARAMS_FILE, overrides: dict[str, Any] | None = None) -> Params:
    """`params_file` with `overrides` applied (not written), validated; this process pinned for it.

    Raises ConfigError (exit 2 at the entry points) for bad params, or for a CPU mode that can no
    longer be set because torch or numpy is already loaded in another one.
    """
    params = with_overrides(params_file, overrides)[1] if overrides else load_params(params_file)
    return pin(params)


def pin(params: Params) -> Params:
    """This process set up for `params`, already read and validated (the pipeline flow reads its params
    file once, to check it: flows/run_params.py); before torch or numpy loads."""
    pin_env(params.determinism.cpu)
    pin_waiting()
    return params
