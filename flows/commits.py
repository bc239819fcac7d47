"""The flow's records in dvc.lock: the stages it ran, committed the way `dvc commit -f` commits them, in
as few writes of dvc.lock as losing little work to a kill allows.

Why not one `Repo.commit` per stage, as `dvc repro` writes dvc.lock after each: every write reads the
whole file twice and writes it back through ruamel's round-trip YAML, which costs about a second on 2 cores
whatever the stage cost (dvc.lock lists every stage's code with its md5: ~2,900 YAML nodes). Seven stages
spent 8.4 s of a 49-s forced digits run on it (2026-12-03, sampled with py-spy). So stages are committed
together, with one write: at once when the work not yet committed took `COMMIT_AFTER_S` or more (a
training), else with the next one, and when the run ends or fails. A run killed outright (SIGKILL, power)
then redoes at most that much work; one that fails commits what ran before the failure. Stages whose
entries come out as dvc.lock holds them (a re-read source that had not changed) leave the file as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tasks.core.cli import dvc_logs_once

COMMIT_AFTER_S = 30.0  # seconds of stage work that are committed at once (~1 s a commit: 3% of it at most)

log = logging.getLogger(__name__)


def commit_stages(root: Path, stages: list[str]) -> None:
    """`dvc commit -f` of each of `stages` (dvc.yaml names), with one write of dvc.lock; run from `root`,
    as DVC's commands are (the flow works there).

    What DVC's `Repo.commit` does for one target (dvc/repo/commit.py, DVC 3.x), for several: each stage's
    deps, params and outs hashed into its entry and its outs put in the cache, then the entries written
    together. The entries are the ones `dvc commit` and `dvc repro` write (tests/flows/test_commits.py).
    """
    if not stages:
        return
    # heavy: dvc (~0.7 s), only once a stage ran (a no-op flow run commits nothing)
    from dvc.dvcfile import PROJECT_FILE, load_file
    from dvc.repo import Repo, lock_repo
    from dvc.stage.serialize import to_lockfile

    dvc_logs_once()
    with Repo(str(root)) as repo, lock_repo(repo):
        # dvc.yaml and dvc.lock parsed once for all of them: `repo.stage.collect_granular(name)` parses
        # both again for each name (~0.2 s each on 2 cores: ~1 s of a forced digits flow run, 2026-12-07)
        dvcfile = load_file(repo, PROJECT_FILE)
        loaded = [dvcfile.stages[name] for name in stages]
        for stage in loaded:
            stage.save()
            stage.commit()
        # Entries the file holds already are not written again (DVC rewrites it whatever changed):
        # the nightly re-read of an unchanged source ran the download stage to the same outputs.
        recorded = dvcfile.lockfile_contents.get("stages", {})
        if any(recorded.get(stage.name) != to_lockfile(stage)[stage.name] for stage in loaded):
            dvcfile.dump_stages(loaded, update_pipeline=False)


class PendingCommits:
    """The stages a flow ran and has not committed yet (module docstring): `ran` after each stage that ran
    (with the seconds it took), `flushed` around them all."""

    def __init__(self, root: Path, commit_after_s: float = COMMIT_AFTER_S) -> None:
        self.root, self.commit_after_s = root, commit_after_s
        self.pending: list[str] = []
        self.seconds = 0.0

    def ran(self, stage: str, seconds: float) -> None:
        self.pending.append(stage)
        self.seconds += seconds
        if self.seconds >= self.commit_after_s:
            self.flush()

    def flush(self) -> None:
        stages, self.pending, self.seconds = self.pending, [], 0.0
        commit_stages(self.root, stages)

    @contextmanager
    def flushed(self) -> Iterator[PendingCommits]:
        """Commits what is pending when the block ends. If it ends by an exception, that one is raised: a
        failure to commit then is logged (the stages will run again), not raised in its place."""
        try:
            yield self
        except BaseException:
            try:
                self.flush()
            except Exception:
                log.exception("could not record the stages that ran before the failure in dvc.lock")
            raise
        self.flush()
