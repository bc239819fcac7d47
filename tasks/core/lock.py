"""At most one pipeline run at a time in a project, whichever entry point started it.

DVC's own repo lock does not give this: `dvc repro` releases it while a stage's command runs, and
the Prefect flow runs its stages in-process. So the project has one more lock, a file lock
(`filelock`: flock on POSIX, released by the kernel if the holder dies, so a SIGKILLed run never
leaves a stale lock behind):

- the Prefect flow (`make run`, deployment runs) holds it for its whole run;
- `python -m tasks <stage>`, the command `dvc repro` runs, holds it for its stage.

A run that finds the lock taken waits up to `orchestration.lock_wait_s` for the other to finish,
saying who holds it, then is refused with `PipelineBusy`: nothing is written, so `data/`,
`dvc.lock` and the MLflow store only ever see one writer.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from tasks.core.atomic import write_text
from tasks.core.errors import Refused
from tasks.core.layout import ROOT

LOCK_FILE = Path(".dvc/tmp/lockstep-pipeline.lock")
# Who holds it, for the message a waiting run prints. A separate file: filelock truncates the lock
# file itself on every attempt to take it.
HOLDER_FILE = Path(".dvc/tmp/lockstep-pipeline.holder.json")

log = logging.getLogger(__name__)


class PipelineBusy(Refused):
    """Another pipeline run held the project lock for longer than we were allowed to wait."""


def _holder(root: Path) -> str:
    try:
        info = json.loads((root / HOLDER_FILE).read_text())
    except (OSError, ValueError):
        return "another pipeline run"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
    return f"{info['holder']} (pid {info['pid']}, since {since})"


@contextmanager
def pipeline_lock(
    holder: str, wait_s: float, root: Path = ROOT, logger: logging.Logger | logging.LoggerAdapter[Any] = log
) -> Iterator[None]:
    """Hold the project's pipeline lock for the block; `holder` names this run in others' messages.
    A wait is reported on `logger` (the flow passes its run logger, so the wait shows in Prefect)."""
    (root / LOCK_FILE).parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(root / LOCK_FILE)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.warning("waiting up to %g s for the pipeline run in progress: %s", wait_s, _holder(root))
        try:
            lock.acquire(timeout=wait_s)
        except Timeout:
            message = (
                f"{LOCK_FILE}: another pipeline run is in progress: {_holder(root)}; waited {wait_s:g} s "
                "(orchestration.lock_wait_s), try again when it ends"
            )
            raise PipelineBusy(message) from None
    try:
        write_text(root / HOLDER_FILE, json.dumps({"holder": holder, "pid": os.getpid(), "since": time.time()}))
        yield
    finally:
        (root / HOLDER_FILE).unlink(missing_ok=True)
        lock.release()
