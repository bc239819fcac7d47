"""B3-flow's gain, pinned in the fast tier: what a `make run` with nothing stale loads before it knows.

A no-op `make run` took 16-23 s on 2 cores while it imported Prefect (~1.5 s), started a server of its
own, imported MLflow and its store (~2.9 s) and opened DVC's repository once per stage; it now takes
~2 s (flows/noop.py). The slow tier runs it for real and checks what it imported and started
(tests/flows/test_e2e.py `audited_noop_run`); this checks, in a second, that the modules on its way
import none of the heavy libraries at their top, where a later edit would put the cost back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT, subprocess_env

# Everything `python -m flows.pipeline` imports before it has asked DVC and recorded a no-op run.
NOOP_PATH = ["flows.pipeline", "flows.noop", "tasks.tracking.sqlite_record", "tasks.tracking.dashboard"]
HEAVY = {"prefect", "mlflow", "torch", "torchvision", "onnx", "onnxruntime", "sqlalchemy", "pandas"}


def test_the_no_op_path_imports_no_heavy_library() -> None:
    code = f"import json, sys\nfor m in {NOOP_PATH!r}: __import__(m)\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, check=True
    )
    loaded = {name.split(".")[0] for name in json.loads(done.stdout)}
    assert not HEAVY & loaded, sorted(HEAVY & loaded)


def test_make_run_is_that_command() -> None:
    # Under `make test-all` (CI) this make would be a sub-make: it would announce its directory and take
    # the outer make's variables (ARGS) from MAKEFLAGS. A user types it at a prompt: so is it run here.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ARGS")}
    shown = subprocess.run(["make", "-n", "run"], cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    assert shown.strip().splitlines()[-1].split()[-2:] == ["-m", "flows.pipeline"], shown
