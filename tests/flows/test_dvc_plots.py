"""`dvc plots show` and `dvc plots diff`, as a user runs them, opened in headless Chromium with no
network: every plot (accuracy, loss, learning rate, the confusion matrix) is drawn from the page alone,
because .dvc/config's page inlines Vega (.dvc/plots/vendor/). DVC's default page, on the same plots,
asks a CDN for Vega: the template is what makes the difference. `dvc exp show` lists each experiment's
headline metrics: test accuracy, and the shipped model's accuracy, size and latency."""

from __future__ import annotations

import csv
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import ROOT, clone_project, commit_all, run
from tests.support.chromium import devtools

VENDOR = ROOT / ".dvc" / "plots" / "vendor"
SCREENSHOTS = ROOT / "test-artifacts"  # kept for a person to look at
# plot id (dvc.yaml) -> the lines each revision draws in it (the confusion matrix: its cells instead)
LINES = {"accuracy": 2, "loss": 2, "lr": 1}
EXPERIMENT = "three-epochs"
# Another experiment, quickly: fewer epochs (other curves, another matrix), one compressed variant
# (export's candidates need only static_int8); ~50 s of train→export on 2 cores.
OVERRIDES = ["-S", "train.epochs=3", "-S", "compress.variants=[static_int8]"]


def _vendor() -> ModuleType:
    spec = importlib.util.spec_from_file_location("plots_vendor", VENDOR / "vendor.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_template_inlines_exactly_the_pinned_npm_files() -> None:
    """Offline: the page DVC fills holds each pinned file byte for byte (sha512 of the file in the npm
    tarball whose registry integrity vendor.json records), and a changed byte is caught."""
    vendor = _vendor()
    html = vendor.TEMPLATE.read_text()
    assert vendor.check_template(html) == []
    for pkg in vendor.packages():  # one byte more in any inlined file is caught
        opening = f'<script data-package="{pkg["name"]}@{pkg["version"]}">\n'
        problems = vendor.check_template(html.replace(opening, opening + ";", 1))
        assert problems == [
            f"{pkg['name']}@{pkg['version']}: inlined script differs from {pkg['file']} of the pinned tarball"
        ]
    # DVC's CDN tags would come back through its scripts placeholder
    assert vendor.check_template(html.replace("<title>", "{scripts}<title>")), "a {scripts} placeholder passed"
    assert run(["dvc", "config", "plots.html_template"], ROOT).stdout.strip() == "plots/offline.html"
    readme = (VENDOR / "README.md").read_text()
    for pkg in vendor.packages():  # the README names what is pinned, as pinned
        assert pkg["version"] in readme and pkg["integrity"] in readme and f"{pkg['file_bytes']:,}" in readme, pkg


@dataclass(frozen=True)
class Page:
    plots: dict[str, dict[str, Any]]  # div id -> {"lines", "cells": drawn SVG paths, "text": its SVG text}
    requested: list[str]  # every URL the page asked for, itself included
    failed: list[str]

    def offline_problems(self, plots: list[str], revisions: int, classes: int) -> list[str]:
        """Why this page is not a self-contained drawing of `plots` ([]: it is)."""
        problems = [f"requested {url}" for url in self.requested if not url.startswith("file://")]
        problems += [f"failed {failure}" for failure in self.failed]
        for plot in plots:
            drawn = self.plots.get(plot, {"lines": 0, "cells": 0})
            if plot == "confusion" and drawn["cells"] < classes * classes * revisions:
                problems.append(f"confusion: {drawn['cells']} cells drawn")
            elif plot in LINES and drawn["lines"] < LINES[plot] * revisions:
                problems.append(f"{plot}: {drawn['lines']} lines drawn")
        return problems


DRAWN = """JSON.stringify(Object.fromEntries([...document.querySelectorAll('body > div[id]')].map(div => [div.id, {
    lines: div.querySelectorAll('svg .mark-line path').length,
    cells: div.querySelectorAll('svg .mark-rect path').length,
    text: [...div.querySelectorAll('svg text')].map(t => t.textContent).join(' '),
}])))"""


def open_page(html: Path, profile: Path, ready: str, screenshot: Path | None = None) -> Page:
    """The page as Chromium shows it from disk once `ready` holds (a screenshot kept), what it asked for."""
    with devtools(profile, width=1400, height=1100) as page:
        page.open(html.as_uri(), ready, timeout_s=60)
        if screenshot:
            page.screenshot(screenshot)
        plots = json.loads(page.evaluate(DRAWN))
        requested = list(page.requested.values())  # `failed` would miss a CDN that answered
        return Page(plots, requested, list(page.failed))


def all_svg_drawn(count: int) -> str:
    return f"document.querySelectorAll('svg.marks').length >= {count}"


def classes(repo: Path) -> int:
    with open(repo / "artifacts/evaluate/predictions.csv", newline="") as handle:
        return len({row["actual"] for row in csv.DictReader(handle)})


@pytest.mark.slow
def test_plots_show_draws_every_plot_offline_and_the_default_page_cannot(
    dvc_repo: dict[str, Any], tmp_path: Path
) -> None:
    """`dvc plots show` with the project's config: each plot drawn (its lines, every cell of the confusion
    matrix) from the file alone. The same plots in DVC's default page ask cdn.jsdelivr.net for Vega: the
    check that passes ours fails it, so the template is what makes the page work offline."""
    repo = dvc_repo["repo"]
    shown = run(["dvc", "plots", "show", "-o", str(tmp_path / "plots")], repo)
    html = tmp_path / "plots" / "index.html"
    assert shown.stdout.strip().endswith(html.as_uri()), shown.stdout  # DVC says where the page is
    page = open_page(html, tmp_path / "profile", all_svg_drawn(len(LINES) + 1), SCREENSHOTS / "dvc-plots.png")
    assert page.offline_problems([*LINES, "confusion"], revisions=1, classes=classes(repo)) == []
    assert "predicted class" in page.plots["confusion"]["text"]

    # DVC's own page (dvc_render's PAGE_HTML, what it uses with no plots.html_template), same plots
    from dvc_render.html import PAGE_HTML

    (tmp_path / "default.html").write_text(PAGE_HTML)
    run(
        ["dvc", "plots", "show", "-o", str(tmp_path / "default"), "--html-template", str(tmp_path / "default.html")],
        repo,
    )
    # offline its scripts fail at once and it stays blank (online it would draw, from the CDN)
    default = open_page(tmp_path / "default" / "index.html", tmp_path / "profile-default", "true")
    problems = default.offline_problems([*LINES, "confusion"], revisions=1, classes=classes(repo))
    assert any(p.startswith("requested https://cdn.jsdelivr.net/") for p in problems), problems


@pytest.fixture(scope="module")
def experiments(dvc_repo: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's project committed as a baseline, plus one experiment (`dvc exp run`) beside it."""
    repo = clone_project(dvc_repo["repo"], tmp_path_factory.mktemp("plots") / "repo")
    commit_all(repo, "baseline: dvc.lock of the reproduced pipeline")
    run(["dvc", "exp", "run", "-n", EXPERIMENT, *OVERRIDES], repo)
    return repo


@pytest.mark.slow
def test_plots_diff_draws_both_revisions(experiments: Path, tmp_path: Path) -> None:
    """`dvc plots diff <baseline> <experiment>`: every plot drawn offline for both, each naming both."""
    run(["dvc", "plots", "diff", "HEAD", EXPERIMENT, "-o", str(tmp_path / "diff")], experiments)
    html = tmp_path / "diff" / "index.html"
    page = open_page(html, tmp_path / "profile", all_svg_drawn(len(LINES) + 1), SCREENSHOTS / "dvc-plots-diff.png")
    assert page.offline_problems([*LINES, "confusion"], revisions=2, classes=classes(experiments)) == []
    for plot, drawn in page.plots.items():  # each names both: a legend entry, or a confusion matrix's header
        assert "HEAD" in drawn["text"] and EXPERIMENT in drawn["text"], (plot, drawn["text"])


@pytest.mark.slow
def test_exp_show_lists_the_headline_metrics_of_each_experiment(experiments: Path) -> None:
    """`dvc exp show --json`: the baseline and the experiment each with its test accuracy (evaluate) and
    the shipped model's accuracy, size and latency (gates.json's flat `shipped`), its own numbers."""
    shown = json.loads(run(["dvc", "exp", "show", "--json"], experiments).stdout)
    baseline = next(entry for entry in shown if entry["rev"] != "workspace")
    rows = {"baseline": baseline, **{exp["name"]: exp["revs"][0] for exp in baseline["experiments"] or []}}
    assert set(rows) == {"baseline", EXPERIMENT}, list(rows)
    headline = {}
    for name, row in rows.items():
        metrics = row["data"]["metrics"]
        evaluated = metrics["artifacts/evaluate/metrics.json"]["data"]
        shipped = metrics["artifacts/export/gates.json"]["data"]["shipped"]
        assert set(shipped) == {"accuracy", "size_bytes", "latency_b1_ms", "latency_b64_ms"}, (name, shipped)
        headline[name] = (evaluated["accuracy"], shipped["accuracy"], shipped["size_bytes"])
    assert headline["baseline"][:2] != headline[EXPERIMENT][:2], headline  # each experiment's own numbers
