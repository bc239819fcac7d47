"""The whole-pipeline benchmarks (B2: the flow vs plain stage calls; B3: no-op runs; B10: a sweep on 1 and
2 Dask workers, in the same project copy) run in their smoke
form; a module of their own, so that they and the other suites (tests/benchmarks/test_benchmarks.py) can run on
different xdist workers. The smoke run times B2 on digits only: its 20x dataset (a generated snapshot
in data/) is `make bench`'s alone: three more pipeline runs, over a minute of CI, for no verdict."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.test_benchmarks import smoke_run


@pytest.mark.slow
def test_pipeline_benchmarks_smoke_run(tmp_path: Path) -> None:
    figures, table = smoke_run(tmp_path, ["B2", "B3", "B10"])
    assert set(figures) == {"B2-x1", "B3-dvc", "B3-flow", "B10"}
    assert figures["B10"]["details"]["speedup"] > 0
    assert all(f"| {name} |" in table for name in figures)
    assert figures["B2-x1"]["details"]["stages"] == [
        "download",
        "stats",
        "preprocess",
        "train",
        "evaluate",
        "compress",
        "export",
    ]
