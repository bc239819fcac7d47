"""A page of DVC plots (`dvc plots show|diff`) as headless Chromium draws it from disk: what each plot
drew, and what the page asked the network for. Used by tests/flows/test_dvc_plots.py (one revision) and
tests/flows/test_dvc_experiments.py (a baseline and a queued experiment)."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import ROOT
from tests.support.chromium import devtools

SCREENSHOTS = ROOT / "test-artifacts"  # kept for a person to look at
# plot id (dvc.yaml) -> the lines each revision draws in it (the confusion matrix: its cells instead)
LINES = {"accuracy": 2, "loss": 2, "lr": 1}
PLOTS = [*LINES, "confusion"]


@dataclass(frozen=True)
class Page:
    plots: dict[str, dict[str, Any]]  # div id -> {"lines", "cells": drawn SVG paths, "text": its SVG text}
    requested: list[str]  # every URL the page asked for, itself included
    failed: list[str]

    def offline_problems(self, revisions: int, classes: int) -> list[str]:
        """Why this page is not a self-contained drawing of every plot ([]: it is)."""
        problems = [f"requested {url}" for url in self.requested if not url.startswith("file://")]
        problems += [f"failed {failure}" for failure in self.failed]
        for plot in PLOTS:
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


def every_plot_drawn() -> str:
    """The page's readiness: an SVG drawn for each plot."""
    return f"document.querySelectorAll('svg.marks').length >= {len(PLOTS)}"


def classes(repo: Path) -> int:
    with open(repo / "artifacts/evaluate/predictions.csv", newline="") as handle:
        return len({row["actual"] for row in csv.DictReader(handle)})
