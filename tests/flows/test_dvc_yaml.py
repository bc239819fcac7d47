"""dvc.yaml and the code agree: each stage lists exactly the params sections it reads and the code it
imports, so that a change to either re-runs the stage and nothing else does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.core import layout
from tasks.core.config.params import NUMPY_STAGES, STAGE_PARAMS, STAGES
from tests.conftest import write_params
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


# What each stage's command computes with: its module, and the determinism pinning it runs under
# (tasks/runner.py's run_stage: numpy's seeds alone for the data stages, which never load torch; every
# seed and switch for the others); train also runs tasks/train/launcher.py's ranks. The rest of the runner
# (tasks/runner.py, tracking.py) is the edge that logs, not a dep: how a run is logged does not
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
STAGE_MODULES = {
    name: (STAGE_MODULE[name], "tasks.determinism.seeds" if name in NUMPY_STAGES else "tasks.determinism.pinning")
    for name in STAGES
}
STAGE_MODULES["train"] += ("tasks.train.launcher",)
STAGE_MODULES["download"] += ("tasks.data.checks",)  # the new snapshot's profile (an output) and its data checks


# C++ a module compiles and loads (the source and what it includes): what it computes, though no import names it
NATIVE_SOURCES = {
    "tasks/determinism/blas.py": tuple(
        f"tasks/determinism/{name}"
        for name in (
            "activations.h",
            "blas_pool.cpp",
            "convolution.h",
            "depthwise.h",
            "depthwise_taps.h",
            "fma_chain.h",
            "normalization.h",
            "products.h",
            "sampling.h",
        )
    )
}


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
        for module, sources in NATIVE_SOURCES.items():
            for source in sources:
                assert (module in imported) == (source in stage["deps"]), f"{name}: {source} goes with {module}"


def test_compress_reruns_when_the_candidates_it_builds_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`compress.variants: auto` builds what export.candidates names: real DVC must see that change
    as compress's (dvc.yaml's params, a stub command; in-process, about a second)."""
    from dvc.repo import Repo

    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    monkeypatch.chdir(tmp_path)
    Repo.init(str(tmp_path), no_scm=True)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert params["compress"]["variants"] == "auto"
    stage = {"cmd": "echo built > built.txt", "params": _stages()["compress"]["params"], "outs": ["built.txt"]}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"compress": stage}}))

    def stale_params(**changes: Any) -> list[str]:
        write_params(tmp_path / "params.yaml", changes)
        status = Repo(str(tmp_path)).status(["compress"])
        return sorted(key for entry in status.get("compress", []) for key in entry["changed deps"]["params.yaml"])

    write_params(tmp_path / "params.yaml", {})
    Repo(str(tmp_path)).reproduce("compress")
    assert stale_params() == []
    assert stale_params(export={"max_accuracy_drop": 0.02}) == []  # export's own gates: not compress's
    assert stale_params(export={"candidates": ["qat_int8", "static_int8", "fp32"]}) == ["export.candidates"]
