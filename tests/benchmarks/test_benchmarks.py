"""The benchmarks run (`python -m benchmarks --smoke`: tiny sizes, one round) so that they do not rot.
Timings are not asserted here: a shared 2-core CI machine is no place to judge them."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from benchmarks.__main__ import markdown, unargued_misses
from benchmarks.compression import SMOKE_INT8_OPTIONS, SMOKE_VARIANTS
from benchmarks.harness import Figure, alternate, paired
from benchmarks.portable_cost import SMOKE_STEP_MODELS
from tests.conftest import ROOT, run
from tests.support.file_module import load_file


def test_a_missed_target_fails_the_run_unless_the_run_measured_it_out_of_reach() -> None:
    met = Figure("B4", "tracking on vs off", 1.0, 1.0, "<= 1.05x", True)
    missed = Figure("B3-flow", "no-op flow", 12.0, 10.0, "<= 10 s", False)
    argued = Figure("B1", "epoch", 0.16, 0.29, "<= 0.33x", False, argued="the model alone takes 0.57x")
    report = Figure("B8", "deterministic vs fast", 1.0, 1.0, "report", None)
    assert unargued_misses([met, missed, argued, report]) == ["B3-flow"]
    assert unargued_misses([met, argued, report]) == []
    table = markdown([met, missed, argued, report], {"cpu": "x", "cores": 2, "python": "3.11", "torch": "2"})
    rows = {line.split(" | ")[0][2:]: line for line in table.splitlines() if line.startswith("| B")}
    assert rows["B1"].endswith("| no (1) |") and rows["B3-flow"].endswith("| **no** |")
    assert rows["B4"].endswith("| yes |") and rows["B8"].endswith("| report |")
    assert "1. B1: the model alone takes 0.57x" in table


def test_a_paired_row_is_the_median_of_its_rounds_ratios_not_the_ratio_of_its_medians() -> None:
    # The host's speed moved between rounds: the medians of the times pooled over them compare 2.0 s
    # with 1.0 s, while each round measured the two sides at one speed and found 1.25x, 1.2x and 1.25x.
    pooled = Figure("B9-x", "step", 2.0, 1.0, "<= 1.3x", None)
    assert pooled.ratio == 2.0
    pooled.round_ratios = [1.25, 1.2, 1.25]
    assert pooled.ratio == 1.25 and pooled.row()["ratio"] == 1.25
    assert "| 1.250x |" in markdown([pooled], {"cpu": "x", "cores": 2, "python": "3.11", "torch": "2"})


def test_the_cases_take_turns_in_reversed_order_each_round_and_pair_round_by_round() -> None:
    order: list[str] = []
    seconds = {"a": iter([9.0, 2.0, 3.0, 4.0]), "b": iter([9.0, 1.0, 2.0, 2.0])}
    cases = {name: (lambda name=name: order.append(name) or next(seconds[name])) for name in seconds}
    times = alternate(cases, rounds=3, warmup=1)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]  # neither side always runs first
    assert times == {"a": [2.0, 3.0, 4.0], "b": [1.0, 2.0, 2.0]}  # the warm-up round is not timed
    assert paired(times, "a", "b") == [2.0, 1.5, 2.0]


def test_the_docs_render_the_committed_results_with_the_day_they_were_measured() -> None:
    hook = load_file(ROOT / "docs" / "hooks" / "benchmarks.py", "benchmarks_hook")
    record = json.loads((ROOT / "benchmarks" / "results" / "bench.json").read_text())
    assert hook.render(record).startswith(f"Measured {record['date']} on {record['machine']['cpu']} (")
    undated = {key: value for key, value in record.items() if key != "date"}  # a file from before the field
    assert hook.render(undated).startswith("Measured on a day not recorded")


def test_the_docs_render_each_machine_kinds_results_under_its_own_heading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mkdocs.exceptions import PluginError

    hook = load_file(ROOT / "docs" / "hooks" / "benchmarks.py", "benchmarks_hook")
    record = json.loads((ROOT / "benchmarks" / "results" / "bench.json").read_text())
    (tmp_path / "bench.json").write_text(json.dumps(record))
    other = {**record, "machine": {**record["machine"], "cpu": "Other CPU"}, "date": "2026-12-31"}
    (tmp_path / "bench-other.json").write_text(json.dumps(other))
    monkeypatch.setenv("LOCKSTEP_BENCH_JSON", str(tmp_path / "bench.json"))
    page = type("Page", (), {"file": type("File", (), {"src_uri": hook.PAGE})()})()
    rendered = hook.on_page_markdown(f"# B\n\n{hook.MARKER}\n", page, {}, None)
    main, second = f"### On {record['machine']['cpu']} (`bench.json`)", "### On Other CPU (`bench-other.json`)"
    assert hook.MARKER not in rendered and rendered.index(main) < rendered.index(second)
    assert "Measured 2026-12-31 on Other CPU (" in rendered.split(second)[1]

    (tmp_path / "bench-other.json").write_text('{"machine": {}}')  # a broken file fails the build, named
    with pytest.raises(PluginError, match="bench-other.json"):
        hook.on_page_markdown(hook.MARKER, page, {}, None)


def smoke_run(tmp_path: Path, suites: list[str]) -> tuple[dict[str, dict], str]:
    """`python -m benchmarks --smoke --only SUITES`: the figures by id, checked for what every figure
    must have; and the Markdown table. (Two tests share the suites, so that the two xdist workers
    can each take one.)"""
    started = time.time()
    done = run(["python", "-m", "benchmarks", "--smoke", "--only", *suites, "--out", str(tmp_path)], ROOT)
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["smoke"] is True and record["machine"]["cores"] >= 1
    days = {time.strftime("%Y-%m-%d", time.gmtime(moment)) for moment in (started, time.time())}
    assert record["date"] in days, (record["date"], days)  # the day it ran (UTC; a run may cross midnight)
    figures = {f["id"]: f for f in record["figures"]}
    for figure in figures.values():
        assert figure["lockstep"] > 0 and figure["baseline"] > 0 and math.isfinite(figure["ratio"]), figure
        assert figure["met"] is None, figure  # toy sizes: no verdicts (and no failed run over one)
    untimed = {"B6-size", "B6-acc", "B6-pruned", "B12"} | {n for n in figures if n.startswith("B7")}
    timed = {name: f["details"]["runs"] for name, f in figures.items() if name not in untimed}
    assert all(times and all(times.values()) for times in timed.values()), timed  # every case timed
    table = (tmp_path / "bench.md").read_text()
    assert table in done.stdout
    return figures, table


@pytest.mark.slow
def test_benchmarks_smoke_run_writes_the_table_and_json(tmp_path: Path) -> None:
    """Every suite but the whole-pipeline ones (tests/benchmarks/test_benchmarks_pipeline.py)."""
    figures, table = smoke_run(tmp_path, ["B1", "B4", "B5", "B6", "B7", "B9", "B12"])
    expected = {
        "B1",
        "B1-data",
        "B4",
        "B4-dvc",
        "B5",
        "B6-size",
        "B6-speed",
        "B6-speed-b1",
        "B6-acc",
        "B6-pruned",
        "B8",
        "B9",
        "B12",
    }
    assert expected | {f"B9-{model}" for model in SMOKE_STEP_MODELS} <= set(figures)
    # B13, from B9's steps: the FMA peak's microbenchmark ran, and each model's operations were counted
    assert {"B13", *(f"B13-{model}" for model in SMOKE_STEP_MODELS)} <= set(figures)
    assert figures["B13"]["details"]["vector_floats"] in (4, 8, 16)
    assert all(figures[f"B13-{model}"]["details"]["gflop_per_step"] > 0 for model in SMOKE_STEP_MODELS)
    for name in (n for n in figures if n.startswith("B7")):
        assert figures[name]["details"]["rows"], name
    for name in ["B4", "B4-dvc", "B8", "B9", *(f"B9-{model}" for model in SMOKE_STEP_MODELS)]:  # one round: its ratio
        assert (
            len(figures[name]["round_ratios"]) == 1 and figures[name]["ratio"] == figures[name]["round_ratios"][0] > 0
        )
    # the variants B6's figures read, no more (each other one costs a fine-tune and an export; tests/ship builds them)
    assert {row["variant"] for row in figures["B6-size"]["details"]["rows"]} == {"fp32", *SMOKE_VARIANTS}
    assert {"static_int8", "pruned_l1"} <= set(SMOKE_VARIANTS)
    options = figures["B6-speed"]["details"]["int8_options"]  # the quantizer's alternatives, timed against fp32
    assert set(options) == {"shipped", *SMOKE_INT8_OPTIONS}
    for row in options.values():
        assert row["speedup_b1_t1"] > 0 and row["speedup_b64_t1"] > 0 and 0 <= row["top1_agreement"] <= 1
    assert "| B1 |" in table
    streamed = figures["B12"]["details"]  # one epoch, then a scoring pass, over a split streamed from its file
    assert streamed["images"] == 8192 and streamed["epoch_s"] > 0 and streamed["peak_mib"] >= streamed["before_mib"]
    assert streamed["predict_s"] > 0 and streamed["logits"] == [8192, 10]
    assert "B6: the compress stage's table" in table and "| static_int8 |" in table
