"""The exceptions a user can act on, and the one exit-code table every entry point follows.

Entry points (tasks/core/cli.py `exit_code`) print them as one line naming the file, URL or key,
without a traceback, and exit with the exception's `exit_code`. Anything else is a bug: it keeps
its traceback and exits 1. docs/reliability.md has the table for users.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """What a command's exit status tells a script or a scheduler that ran it."""

    OK = 0
    # The work failed: a download, a corrupt or unreadable file, a diverging run, a full disk, an
    # unreachable server; and bugs (with their traceback).
    FAILED = 1
    # params.yaml, an override or a command-line argument is invalid: nothing was written.
    BAD_INPUT = 2
    # A safeguard said no, on purpose: another run holds the project lock, a data snapshot failed its
    # checks, no export candidate passed its gates, an unsafe archive, an untrusted run record, an
    # override of a key that runs started through the API may not change. Nothing was written.
    REFUSED = 3
    # This machine lacks what the settings need: a CUDA device, a CPU the portable mode runs on.
    NO_HARDWARE = 4


class ExpectedFailure(RuntimeError):
    """An expected, one-line failure: the message names the file, URL or key and what is wrong.

    Whatever raised it has left the previous outputs as they were.
    """

    exit_code = ExitCode.FAILED


class Refused(ExpectedFailure):
    """A safeguard refused the work (exit 3): the message says which, and how to go on if one may."""

    exit_code = ExitCode.REFUSED


class HardwareMissing(ExpectedFailure):
    """The settings need hardware this machine lacks (exit 4): the message names it and the way out."""

    exit_code = ExitCode.NO_HARDWARE


class DataRefused(Refused):
    """A new data snapshot failed a data check (tasks/data/checks.py) and was not taken: nothing retrains.

    The message is one line naming the check and its numbers; `report` is the whole check report.
    """

    def __init__(self, message: str, report: dict | None = None) -> None:
        super().__init__(message)
        self.report = report or {}
