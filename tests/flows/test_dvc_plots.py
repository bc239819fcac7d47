"""`dvc plots show`, as a user runs it, opened in headless Chromium with no network: every plot
(accuracy, loss, learning rate, the confusion matrix) is drawn from the page alone, because .dvc/config's
page inlines Vega (.dvc/plots/vendor/). DVC's default page, on the same plots, asks a CDN for Vega: the
template is what makes the difference. `dvc plots diff` of a baseline and an experiment, and `dvc exp
show`, are tests/flows/test_dvc_experiments.py's (on the experiments its queue ran)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import ROOT, run
from tests.support.file_module import load_file
from tests.support.plots_page import SCREENSHOTS, classes, every_plot_drawn, open_page

VENDOR = ROOT / ".dvc" / "plots" / "vendor"


def _vendor() -> ModuleType:
    return load_file(VENDOR / "vendor.py", "plots_vendor")


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
    page = open_page(html, tmp_path / "profile", every_plot_drawn(), SCREENSHOTS / "dvc-plots.png")
    assert page.offline_problems(revisions=1, classes=classes(repo)) == []
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
    problems = default.offline_problems(revisions=1, classes=classes(repo))
    assert any(p.startswith("requested https://cdn.jsdelivr.net/") for p in problems), problems
