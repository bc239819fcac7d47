"""benchmarks/process_cpu.py: a command's CPU by role, its own process tree apart from the machine's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.process_cpu import main, role

# a Python child that spins for a second of CPU, then its parent exits with code 3
SPIN = "import subprocess, sys\nsubprocess.run([sys.executable, '-m', 'tasks', 'spin'], check=False)\nsys.exit(3)\n"
# the command's own process becomes the spinning child after a second of being something else (as a process
# sampled between fork and exec does): it is named by what it became
EXEC_LATER = (
    "import os, sys, time\ntime.sleep(1.2)\nos.execv(sys.executable, [sys.executable, '-m', 'tasks', 'spin'])\n"
)


def test_each_kind_of_process_gets_its_role() -> None:
    venv = "/repo/.venv/bin/python"
    assert role(f"{venv} -m tasks train --params p.yaml") == "stage process: train"
    assert role(f"{venv} -m tasks.train.launcher --join") == "train launcher (DDP rank)"
    assert role(f"{venv} -m prefect server start --host 127.0.0.1") == "Prefect server"
    assert role(f"{venv} -m flows.pipeline --force") == "flow: pipeline"
    assert role(f"{venv} -m flows.sweep worker tcp://127.0.0.1:1") == "sweep (coordinator, Dask)"
    assert role(f"{venv} -u -c import sys;exec(eval(sys.stdin.readline()))") == "pytest-xdist worker (in-process tests)"
    assert role("") == "kernel thread"
    assert role("/usr/bin/git status") == "git"


def test_the_commands_tree_is_counted_apart_and_its_exit_code_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `-m tasks spin` is no stage: the child only needs a command line of a known role. It spins here.
    fake = tmp_path / "tasks"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(
        "import time\nstart = time.process_time()\nwhile time.process_time() - start < 1.0:\n    pass\n"
    )
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "cpu.json"
    assert main(["--out", str(out), "--", sys.executable, "-c", SPIN]) == 3
    report = json.loads(out.read_text())
    roles = {row["role"]: row for row in report["command_tree"]}
    # sampled twice a second: up to half a second of the child's end can fall after its last sample
    assert roles["stage process: spin"]["processes"] == 1 and roles["stage process: spin"]["cpu_s"] >= 0.5
    assert report["command_tree_cpu_s"] <= report["busy_cpu_s"] + 0.5
    assert "stage process: spin" not in {row["role"] for row in report["outside"]}
    assert report["exit_code"] == 3 and not list(tmp_path.glob("*.tmp"))

    assert main(["--out", str(out), "--", sys.executable, "-c", EXEC_LATER]) == 0
    # (the tree is this test process's: other tests' helpers it started, a resource tracker, may be in it)
    roles = {row["role"]: row for row in json.loads(out.read_text())["command_tree"]}
    spin = roles.get("stage process: spin", {"processes": 0, "cpu_s": 0.0})
    assert spin["processes"] == 1 and spin["cpu_s"] >= 0.5, roles
