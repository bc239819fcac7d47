"""The benchmarks run (`python -m benchmarks --smoke`: tiny sizes, one round) so that they do not rot.
Timings are not asserted here: a shared 2-core CI machine is no place to judge them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import ROOT, run

pytestmark = pytest.mark.slow


def test_benchmarks_smoke_run_writes_the_table_and_json(tmp_path: Path) -> None:
    done = run(["python", "-m", "benchmarks", "--smoke", "--out", str(tmp_path)], ROOT)
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["smoke"] is True and record["machine"]["cores"] >= 1
    figures = {f["id"]: f for f in record["figures"]}
    assert {"B1", "B3-dvc", "B3-flow", "B4", "B4-dvc", "B5", "B8"} <= set(figures)
    assert any(name.startswith("B7") for name in figures)
    for figure in figures.values():
        assert figure["lockstep"] > 0 and figure["baseline"] > 0 and math.isfinite(figure["ratio"])
        timed = figure["details"].get("runs") or {row["scale"]: row for row in figure["details"]["rows"]}  # B7: rows
        assert timed and all(timed.values()), figure
    table = (tmp_path / "bench.md").read_text()
    assert table in done.stdout and "| B1 |" in table
