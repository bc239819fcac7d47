"""Importing a package configures nothing: `import tasks`, `import stack`, `import flows` and each module of
flows/ leave the environment, logging's record factory and sys.excepthook as they were, start no thread
or process, and load neither numpy nor torch. Entry points configure by explicit calls
(tasks/determinism/bootstrap.py `start`, flows/prefect_settings.py `configure`), so a module imported by a
test, a tool or another module behaves the same wherever it is imported from.

One fresh process imports them in turn (one import of Prefect, MLflow and torch for all) and reports what
each import changed.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT, subprocess_env

MODULES = ["tasks", "stack", "flows", *sorted(f"flows.{path.stem}" for path in (ROOT / "flows").glob("[!_]*.py"))]

_PROBE = """
import json, logging, os, sys, threading
changed = {}
for name in sys.argv[1:]:
    before = (dict(os.environ), logging.getLogRecordFactory(), sys.excepthook, threading.active_count())
    __import__(name)
    env, factory, hook, threads = before
    what = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))
    if logging.getLogRecordFactory() is not factory:
        what.append("logging's record factory")
    if sys.excepthook is not hook:
        what.append("sys.excepthook")
    if threading.active_count() != threads:
        what.append(f"threads: {threads} -> {threading.active_count()}")
    if what:
        changed[name] = what
# numpy and torch read determinism.cpu's variables once, when they load: an entry point must import
# neither before its bootstrap (`start`) has set them (a late `import numpy` broke `make sweep` once)
loaded = [name for name in ("numpy", "torch") if name in sys.modules]
if loaded:
    changed["(loaded before a bootstrap)"] = loaded
import multiprocessing
children = [str(child) for child in multiprocessing.active_children()]
if children:
    changed["(processes started)"] = children
print(json.dumps(changed))
"""


def test_importing_a_package_or_a_flows_module_configures_nothing() -> None:
    assert "flows.pipeline" in MODULES and "flows.prefect_settings" in MODULES
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *MODULES],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    changed = json.loads(done.stdout.strip().splitlines()[-1])
    assert changed == {}, f"configured on import (call it from the entry point instead): {changed}"
