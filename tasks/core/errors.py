"""The one exception type for failures a user can act on: bad data, a failed download, a full disk,
an untrusted or corrupt file, another run holding the lock, a failed gate, a diverging training run.

Entry points (tasks/core/cli.py) print it as one line naming the file, URL or key, without a
traceback, and exit 1. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class ExpectedFailure(RuntimeError):
    """An expected, one-line failure: the message names the file, URL or key and what is wrong.

    Whatever raised it has left the previous outputs as they were.
    """


class DataRefused(ExpectedFailure):
    """A new data snapshot failed a data check (tasks/data/checks.py) and was not taken: nothing retrains.

    The message is one line naming the check and its numbers; `report` is the whole check report.
    """

    def __init__(self, message: str, report: dict | None = None) -> None:
        super().__init__(message)
        self.report = report or {}
