"""What a failed command must look like to its user: one line, no traceback (tasks/core/cli.py)."""

from __future__ import annotations

import subprocess


def one_line_error(done: subprocess.CompletedProcess[str], launcher_log: bool = False) -> str:
    """The failure's message: exit 1, one line on stderr that starts "error: ", no traceback.

    With `launcher_log`, the log of an engine in between (Prefect's log of the failed task, as its UI
    shows it; torchrun's report of the failed ranks) may show a traceback before it: the message is
    then the last line.
    """
    assert done.returncode == 1, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    lines = done.stderr.splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr
    if launcher_log:
        assert lines[-1] == errors[0], done.stderr
    else:
        assert "Traceback" not in done.stderr + done.stdout, done.stderr
    return errors[0]
