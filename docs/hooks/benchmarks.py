"""MkDocs hook: the benchmark table of docs/benchmarks.md, rendered from `make bench`'s results.

`python -m benchmarks` writes benchmarks/results/bench.json: the day (UTC) and the machine it ran on,
whether it was a smoke run, and one record per figure (id, measure, lockstep, baseline, ratio, target, met, unit,
details, argued). This hook replaces the marker `<!-- bench-table -->` in benchmarks.md with that
table at build time, so that no number on the page is copied by hand. `LOCKSTEP_BENCH_JSON` names
another results file. Without one the page says how to make it; a file that cannot be read fails
the build.

The figures differ by machine kind (the CPU decides int8's speed, a vCPU pair's ceiling, ...), so a
run on another kind is kept beside it as `bench-<kind>.json` (`python -m benchmarks --out DIR`, its
bench.json renamed) and rendered after the main table, under a heading naming its machine.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

PAGE = "benchmarks.md"
MARKER = "<!-- bench-table -->"
RESULTS = Path("benchmarks") / "results" / "bench.json"
OTHER_KINDS = "bench-*.json"  # the same benchmarks on another machine kind, beside RESULTS


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    if page.file.src_uri != PAGE or MARKER not in markdown:
        return markdown
    path = _results_path(config)
    if not path.is_file():
        return markdown.replace(MARKER, _missing(path))
    others = sorted(path.parent.glob(OTHER_KINDS))
    # a heading a machine kind when there is more than one
    return markdown.replace(MARKER, "\n".join(_rendered(results, heading=bool(others)) for results in [path, *others]))


def _rendered(path: Path, heading: bool) -> str:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        title = f"### On {_cell(record['machine']['cpu'])} (`{path.name}`)\n\n" if heading else ""
        return title + render(record)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise PluginError(f"benchmarks hook: cannot render {path}: {error!r}") from error


def _results_path(config: Any) -> Path:
    override = os.environ.get("LOCKSTEP_BENCH_JSON")
    if override:
        return Path(override)
    return Path(config["config_file_path"]).resolve().parent / RESULTS


def _missing(path: Path) -> str:
    return (
        f"*No results to show: `{RESULTS.as_posix()}` is not in this checkout. "
        "Run `make bench` (or `python -m benchmarks --only B1 B4`), then build the docs again.*\n"
    )


def render(record: dict[str, Any]) -> str:
    """The results file as Markdown: the machine, the table, its numbered notes, B6's variant table."""
    host = record["machine"]
    when = record.get("date", "on a day not recorded (a results file older than the `date` field)")
    lines = [
        f"Measured {_cell(when)} on {_cell(host['cpu'])} ({host['cores']} cores), Python {host['python']}, "
        f"torch {host['torch']}, {_cell(host.get('os', 'unknown OS'))}.",
        "",
    ]
    if record.get("smoke"):
        lines += [
            "**This is a smoke run** (`--smoke`: toy sizes, one round): the figures show that the "
            "benchmarks run, not how fast anything is, and carry no verdicts.",
            "",
        ]
    lines += [
        "| # | measure | lockstep | baseline | ratio | target | met |",
        "| --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    notes: list[str] = []
    figures = sorted(record["figures"], key=_order)
    for figure in figures:
        met = {True: "yes", False: "**no**", None: "report"}[figure["met"]]
        if figure["met"] is False and figure.get("argued"):
            notes.append(f"{len(notes) + 1}. **{figure['id']}**: {_cell(figure['argued'])}")
            met = f"no ({len(notes)})"
        unit = figure.get("unit", "s")
        lines.append(
            f"| {figure['id']} | {_cell(figure['measure'])} | {_value(figure['lockstep'], unit)} | "
            f"{_value(figure['baseline'], unit)} | {figure['ratio']:.3f}x | {_cell(figure['target'])} | {met} |"
        )
    if notes:
        lines += ["", "Targets missed that the same run measured to be out of reach:", "", *notes]
    for figure in figures:
        table = figure.get("details", {}).get("table_md")
        if table:
            lines += ["", f"**{figure['id'].partition('-')[0]}: the compress stage's table** (every variant)", ""]
            lines += [table.strip()]
    return "\n".join(lines) + "\n"


def _order(figure: dict[str, Any]) -> int:
    """By number (B2 before B10); figures of one number keep the order the run wrote them in."""
    match = re.match(r"B(\d+)", figure["id"])
    return int(match.group(1)) if match else 10**6


def _value(value: float, unit: str) -> str:
    if unit == "B":
        return f"{value / 1024:.1f} KiB"
    if unit == "s" and value < 0.1:
        return f"{value * 1000:.3g} ms"
    return f"{value:.4g} {unit}".rstrip()


def _cell(text: str) -> str:
    """Text that stays inside one table cell and is not read as HTML."""
    return str(text).replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")
