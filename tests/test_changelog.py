"""CHANGELOG.md is written for users, in Keep a Changelog's shape: releases, then Added / Changed /
Removed / Fixed, each entry a short bullet. Design history and measurements belong in
docs/design-history.md, so the changelog holds no commit hashes and no tables."""

from __future__ import annotations

import re
from pathlib import Path

CHANGELOG = Path(__file__).resolve().parents[1] / "CHANGELOG.md"
SECTIONS = {"Added", "Changed", "Removed", "Fixed"}
RELEASE = re.compile(r"Unreleased|\d{4}-\d{2}-\d{2}")
# A short commit hash: 7 to 40 hex characters with at least one digit and one letter (so neither a
# plain number nor an English word such as "defaced" counts).
COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
MAX_ENTRY_LINES = 3


def _releases() -> dict[str, dict[str, list[list[str]]]]:
    """Release heading -> section heading -> entries, each entry its lines; fails on anything else."""
    releases: dict[str, dict[str, list[list[str]]]] = {}
    release = section = None
    lines = CHANGELOG.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "# Changelog", "the first line is the title"
    for number, line in enumerate(lines, start=1):
        where = f"CHANGELOG.md:{number}: {line!r}"
        if line.startswith("## "):
            release, section = line[3:].strip(), None
            assert RELEASE.fullmatch(release), f"{where}: a release is 'Unreleased' or a date"
            assert release not in releases, f"{where}: release given twice"
            releases[release] = {}
        elif line.startswith("### "):
            assert release is not None, f"{where}: a section outside a release"
            section = line[4:].strip()
            assert section in SECTIONS, f"{where}: sections are {sorted(SECTIONS)}"
            assert section not in releases[release], f"{where}: section given twice in {release}"
            releases[release][section] = []
        elif line.startswith("#"):
            assert number == 1, f"{where}: only ##/### headings below the title"
        elif release is not None and line.strip():
            assert section is not None, f"{where}: text between a release heading and its first section"
            entries = releases[release][section]
            if line.startswith("- "):
                entries.append([line])
            else:
                assert line.startswith("  ") and entries, f"{where}: an entry is a bullet and its indented lines"
                entries[-1].append(line)
    return releases


def test_releases_are_unreleased_then_dates_newest_first() -> None:
    names = list(_releases())
    assert names, "no release headings"
    dates = [name for name in names if name != "Unreleased"]
    assert names == (["Unreleased"] if "Unreleased" in names else []) + dates, "Unreleased comes first"
    assert dates == sorted(dates, reverse=True), f"dated releases newest first: {dates}"


def test_every_release_has_entries_in_known_sections_only() -> None:
    for release, sections in _releases().items():
        assert sections, f"{release} has no Added/Changed/Removed/Fixed section"
        for section, entries in sections.items():
            assert entries, f"{release}, {section}: empty section"


def test_entries_are_at_most_three_lines() -> None:
    long = [
        f"{release}, {section}: {entry[0][:60]!r} ({len(entry)} lines)"
        for release, sections in _releases().items()
        for section, entries in sections.items()
        for entry in entries
        if len(entry) > MAX_ENTRY_LINES
    ]
    assert not long, f"entries over {MAX_ENTRY_LINES} lines: {long}"


def test_no_commit_hashes_or_tables() -> None:
    text = CHANGELOG.read_text(encoding="utf-8")
    hashes = sorted(set(COMMIT.findall(text)))
    assert not hashes, f"commit hashes in CHANGELOG.md (users need what changed, not where): {hashes}"
    tables = [line for line in text.splitlines() if line.lstrip().startswith("|")]
    assert not tables, f"tables belong in docs/design-history.md: {tables[:3]}"


def test_the_design_history_page_is_linked_and_exists() -> None:
    assert "docs/design-history.md" in CHANGELOG.read_text(encoding="utf-8")
    assert (CHANGELOG.parent / "docs" / "design-history.md").is_file()
