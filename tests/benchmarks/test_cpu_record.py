"""tests/support/cpu_record.py: a test's CPU, its own and its reaped children's, in the run's
test-artifacts/ and in the table (a pytest run of its own, on a file of two tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, subprocess_env
from tests.support.cpu_record import table

SPIN = "import time\\nend = time.process_time() + 1.0\\nwhile time.process_time() < end: pass"
TESTS = f"""
import subprocess, sys

def test_a_child_spins():
    subprocess.run([sys.executable, "-c", "{SPIN}"], check=True)

def test_idle():
    pass
"""


def test_a_tests_reaped_child_counts_for_it_and_the_table_ranks_it_first(tmp_path: Path) -> None:
    (tmp_path / "test_spin.py").write_text(TESTS)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "tests.support.cpu_record", "-p", "no:randomly"]
    env = subprocess_env(PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [*command, "test_spin.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    shown = table(tmp_path / "test-artifacts", top=5)
    assert shown.startswith("2 tests:"), shown
    costly = shown.rsplit("| --- |\n", 1)[1].splitlines()
    spent, _, test = costly[0].strip("| ").split(" | ")
    assert test == "`test_spin.py::test_a_child_spins`" and float(spent) >= 0.9, shown
    assert costly[1].startswith("| 0 |") and "test_idle" in costly[1], shown
