"""A pipeline run's outputs, pushed to the project's default DVC remote before the run lets go.

A deployment run on a worker of another host (`deploy --git`) works in a temporary clone that the
worker deletes when the run ends: what is not in the DVC remote by then is lost, though MLflow's
records point at it. So such a run pushes last, still holding the pipeline lock (tasks/core/lock.py):
two runs never push at once, and the next run finds the remote as the last one left it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tasks.core.cli import dvc_logs_once
from tasks.core.errors import ExpectedFailure
from tasks.core.layout import ROOT

log = logging.getLogger(__name__)


class PushFailed(ExpectedFailure):
    """The DVC remote did not take this run's outputs (down, full, refused the keys)."""


def push_outputs(root: Path = ROOT, logger: logging.Logger | logging.LoggerAdapter[Any] = log) -> int:
    """Push this checkout's data and pipeline outputs to its default DVC remote, if it has one; the
    number of files pushed. A deployment run calls it last, under the pipeline lock: a worker's
    checkout is temporary, and what is not in the remote when the run ends is lost."""
    # heavy: dvc (~0.7 s), only when outputs are pushed
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    dvc_logs_once()
    with Repo(str(root)) as repo:
        remote = repo.config.get("core", {}).get("remote")
        if not remote:
            logger.info("no default DVC remote: the outputs stay in %s", root)
            return 0
        try:
            pushed = repo.push()
        except (DvcException, OSError) as exc:  # DVC's errors, and the filesystems' (OSError), name the cause
            line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise PushFailed(f"dvc push to remote {remote!r} failed: {line}; run again to push the rest") from None
    logger.info("dvc push: %d file(s) to remote %r", pushed, remote)
    return int(pushed)
