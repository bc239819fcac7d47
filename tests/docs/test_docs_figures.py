"""Every measured figure on README.md and docs/ is dated where it stands or rendered from
benchmarks/results/ at build time."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from tests.support.doc_pages import PAGES, ROOT, code_blocks, page_lines

# A measured figure: a time, a ratio or a share, or an approximate size (see the test's docstring).
FIGURE = re.compile(
    r"(?<![\w.×/+-])(?:(~|about |About |≈ ?)?(\d+(?:\.\d+)?(?:\s?[-–]\s?\d+(?:\.\d+)?)?) "
    r"(ms|µs|s|min|minutes|seconds|hours)"
    r"|(~|about |About |≈ ?)?(\d+\.\d+(?:\s?[-–]\s?\d+(?:\.\d+)?)?)(×|x|%| times)"
    r"|(~|about |About |≈ ?)(\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)?)(×|x|%| KB| MB| GB| KiB| MiB| GiB))(?![\w²])"
)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# Words just before a number that make it a bound, a setting or a goal rather than a measurement.
NOT_MEASURED = re.compile(
    r"(≤|≥|<|>|\bat most|\bat least|\bup to|\bno more than|\btargets?\b|\bbudgets?\b|\blimit|\bdefault"
    r"|\btimeout|\bevery|\bwithin|\bbound|\bafter)[^.;]{0,30}$",
    re.I,
)
# ... or just after it (`10 s apart`, `300 s by default`).
NOT_MEASURED_AFTER = re.compile(r"^[^.;,]{0,12}\b(apart|idle|by default|of keepalives)\b")


def _figure_text(page: Path) -> list[str]:
    """The page's lines as the figure check reads them: code spans blanked (values, commands, messages),
    code blocks reduced to their comments (where a measured time may hide: `# first start ~25 s`)."""
    _, covered = code_blocks(page)
    shown = []
    for i, line in enumerate(page_lines(page)):
        if i in covered:
            comment = re.search(r"\s#\s(.*)$", line)
            shown.append(comment.group(1) if comment else "")
        else:
            shown.append(re.sub(r"`[^`]*`", "``", line))
    return shown


def _units(page: Path) -> Iterator[tuple[int, list[int], str]]:
    """Paragraphs, list items, table rows (with the paragraph before the table: its caption) and code
    comments, each as (first line, its line numbers, the text a date may stand in)."""
    lines = _figure_text(page)
    _, covered = code_blocks(page)
    unit: list[int] = []
    caption = header = ""
    for i, line in enumerate([*lines, ""]):
        single = i in covered or line.startswith(("|", "#"))
        starts = single or not line.strip() or re.match(r"^\s*([-*+]|\d+\.) ", line)
        if starts and unit:
            text = "\n".join(lines[j] for j in unit)
            yield unit[0], unit, text
            caption, unit = text, []
        if line.startswith("|") and not (i > 0 and lines[i - 1].startswith("|")):
            header = line  # a table's first row: its header
        if single and line.strip():
            yield i, [i], line + ("\n" + header + "\n" + caption if line.startswith("|") else "")
        elif line.strip():
            unit.append(i)


def _rendered(page: Path) -> set[int]:
    """Lines a docs hook writes at build time: between `<!-- name: ... -->` and `<!-- /name -->`."""
    lines, inside, opened = page_lines(page), set(), None
    for i, line in enumerate(lines):
        marker = re.match(r"^<!-- (/?)([\w-]+)", line.strip())
        if marker and not marker.group(1) and any(f"<!-- /{marker.group(2)}" in later for later in lines[i:]):
            opened = marker.group(2)
        elif marker and marker.group(1) and marker.group(2) == opened:
            opened = None
        if opened:
            inside.add(i)
    return inside


def _after(lines: list[str], j: int, end: int) -> str:
    """What follows a figure: the rest of its line and the next one (`300 s by` / `default`)."""
    return lines[j][end:] + " " + (lines[j + 1] if j + 1 < len(lines) else "")


def figure_items() -> Iterator[tuple[str, str]]:
    for page in PAGES:
        lines = _figure_text(page)

        heading, rendered = "", _rendered(page)
        for first, members, context in _units(page):
            if first in rendered:
                continue
            if lines[first].startswith("#") and first not in code_blocks(page)[1]:
                heading = lines[first]
            if DATE.search(context) or DATE.search(heading):
                continue
            for j in members:
                for m in FIGURE.finditer(lines[j]):
                    if NOT_MEASURED.search(lines[j][: m.start()]) or NOT_MEASURED_AFTER.search(
                        _after(lines, j, m.end())
                    ):
                        continue
                    yield f"{page.relative_to(ROOT)}:{j + 1}", m.group(0).strip()


def test_every_figure_is_rendered_or_dated() -> None:
    """A measured figure on a page must say when it was measured, or come from benchmarks/results/.

    A figure is a time (`2 s`, `16-23 s`, `4 min`), a ratio or a share with decimals (`1.25×`,
    `99.1%`), or anything approximate (`about 2×`, `~25 s`, `about 7 GB`). It is accepted when
    - a date (YYYY-MM-DD) stands in its paragraph, list item or table row, in its table's header row
      or the paragraph just before its table, or in the heading of its section (`### Measured
      2026-11-24 on ...`);
    - a bound, setting or goal precedes it in its clause (≤, ≥, at most, up to, target, budget,
      limit, default, timeout, every, within, after) or follows it (`10 s apart`, `300 s by
      default`): that is a number the code sets, not one it measured;
    - it is a value in a code span or a command (`--timeout 60`); code comments are read;
    - it is rendered at build time from benchmarks/results/ (the page holds a marker, not the number).
    Integers with × or % (`16×` the data, `50%` of weights) are settings, not figures.
    """
    stale = [f"{where}: {figure}: a figure with no date where it stands" for where, figure in figure_items()]
    assert not stale, f"{len(stale)} undated figures:\n" + "\n".join(stale)
