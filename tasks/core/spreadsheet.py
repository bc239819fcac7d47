"""CSV cells that no spreadsheet runs: the one rule for every CSV lockstep writes for people to open
(predictions.csv, a sweep's trials.csv), whose text can come from others (a registry's class names,
archive member names, a shared Optuna storage's trial attributes)."""

from __future__ import annotations

from typing import Any

# What makes Excel, LibreOffice and Google Sheets read a cell as a formula (OWASP, "CSV Injection").
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def cell(text: str) -> str:
    """`text` as a CSV cell no spreadsheet runs: a leading ' before a formula's first character. A
    carriage return is written as the two characters \\r: Python's csv writer does not quote it (with
    "\\n" line ends), and readers would start a new row there, one the name could forge."""
    return ("'" + text if text.startswith(FORMULA_START) else text).replace("\r", "\\r")


def value_cell(value: Any) -> Any:
    """A value of any type as a cell: numbers as they are (a negative one is a number, not a formula),
    None empty, anything else as its text through `cell`."""
    if value is None:
        return ""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value
    return cell(str(value))
