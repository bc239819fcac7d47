"""dvc.yaml and the code agree: each stage lists exactly the params sections it reads and the code it
imports, so that a change to either re-runs the stage and nothing else does."""

from __future__ import annotations

import yaml

from tasks.core import layout
from tasks.core.config.params import STAGE_PARAMS, STAGES
from tests.support.code_graph import PACKAGES, ROOT, closure, module_path


def _stages() -> dict:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def test_stages_in_pipeline_order() -> None:
    assert tuple(_stages()) == STAGES == ("download", "stats", "preprocess", "train", "evaluate", "compress", "export")


def test_each_stage_lists_exactly_the_params_it_reads() -> None:
    for name, stage in _stages().items():
        assert tuple(stage["params"]) == STAGE_PARAMS[name], name
        assert stage["cmd"] == f"python -m tasks {name}"


def test_outputs_never_overlap_the_dvc_tracked_data_dir() -> None:
    for name, stage in _stages().items():
        for entry in stage.get("outs", []) + stage.get("metrics", []):
            path = entry if isinstance(entry, str) else next(iter(entry))
            assert path.startswith(f"{layout.ARTIFACTS}/"), (name, path)


# What each stage's command computes with: its module, and the determinism pinning every stage runs
# under (tasks/stages.py's run_stage); train also runs tasks/train/launcher.py's ranks. The rest of the runner
# (tasks/stages.py, tracking.py) is the edge that logs, not a dep: how a run is logged does not
# change what it computes.
STAGE_MODULE = {
    "download": "tasks.data.download",
    "stats": "tasks.data.stats",
    "preprocess": "tasks.data.preprocess",
    "train": "tasks.train.stage",
    "evaluate": "tasks.train.evaluate",
    "compress": "tasks.ship.compress",
    "export": "tasks.ship.export",
}
STAGE_MODULES = {name: (STAGE_MODULE[name], "tasks.determinism.pinning") for name in STAGES}
STAGE_MODULES["train"] += ("tasks.train.launcher",)
STAGE_MODULES["download"] += ("tasks.data.checks",)  # the new snapshot's profile (an output) and its data checks


# C++ a module compiles and loads: what it computes, though no import names it
NATIVE_SOURCES = {"tasks/determinism/blas.py": "tasks/determinism/blas_pool.cpp"}


def _code_deps(deps: list[str]) -> set[str]:
    """The .py files a stage's deps name, folders expanded."""
    files: set[str] = set()
    for dep in deps:
        path = ROOT / dep
        if path.is_dir() and dep.split("/")[0] in PACKAGES:
            files |= {str(p.relative_to(ROOT)) for p in path.rglob("*.py")}
        elif dep.endswith(".py"):
            files.add(dep)
    return files


def test_each_stage_lists_exactly_the_code_it_imports() -> None:
    for name, stage in _stages().items():
        imported = {str(module_path(m).relative_to(ROOT)) for m in closure(*STAGE_MODULES[name])}
        listed = _code_deps(stage["deps"])
        assert listed == imported, (
            f"{name}: missing {sorted(imported - listed)}, not imported {sorted(listed - imported)}"
        )
        for module, source in NATIVE_SOURCES.items():
            assert (module in imported) == (source in stage["deps"]), f"{name}: {source} goes with {module}"
