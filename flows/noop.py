"""A `make run` with nothing stale: decided by DVC and recorded in MLflow before Prefect is imported.

Most runs of a trained project find nothing to do (a nightly retrain with no new data, a second
`make run`), and such a run used to pay for everything a real one needs first: Prefect's import and
a server of its own, seven task runs, each opening DVC's repository: 16-23 s on 2 cores to report
that nothing changed (B3-flow in benchmarks/). DVC alone answers the question (`dvc repro` takes
1.4 s for it), so the command asks DVC first, in one status call for all seven stages, and only
starts Prefect when a stage is stale.

What the run keeps is what a no-op flow run kept: the pipeline run in MLflow, named
`prefect: nothing stale · data …`, with its lineage, key params, headline numbers, dataset and
summary tags (written without MLflow's ~3 s client where that is safe: tasks/tracking/sqlite_record.py;
a flow run in which no stage runs is recorded the same way, `record`). What it leaves out is a Prefect
flow run whose seven tasks say "up to date": with no server of the user's, `make run`'s flow runs
land in a database only a later `make schedule` shows. So the shortcut is taken only then: with
PREFECT_API_URL set (the team's server, `make schedule`'s), and with --force or --set, the flow runs
as before. With --reingest the source is read again first (`source_unchanged`), and the shortcut is
taken when it gives data/ byte for byte. The MLflow run names its Prefect flow run, or says there
was none (`lockstep.flow_run`).

The decision is taken under the project's pipeline lock (tasks/core/lock.py), without waiting: a
run in progress could make a stage stale, so then the flow starts, waits for the lock as it always
has, and asks DVC again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from flows.summary import NOTHING_RAN, summarize
from tasks.core.cli import dvc_logs_once
from tasks.core.config.params import STAGES, Params
from tasks.core.errors import ExpectedFailure
from tasks.core.hashing import data_md5
from tasks.core.layout import DATA_DIR, ROOT, download_cache
from tasks.core.lock import PipelineBusy, pipeline_lock
from tasks.tracking.runs import pipeline_run, tag_run
from tasks.tracking.sqlite_record import record_pipeline_run
from tasks.tracking.store import tracking_uri

NO_FLOW_RUN = "none: nothing was stale (dvc status), so no Prefect flow run was started"

log = logging.getLogger(__name__)

# The lock's "waiting up to 0 s" line is not for the person at the prompt: the flow then waits, and says so.
_lock_log = logging.getLogger("flows.noop.lock")
_lock_log.addHandler(logging.NullHandler())
_lock_log.propagate = False


def stale_stages(stages: Iterable[str]) -> list[str]:
    """The stages among `stages` whose dvc.lock entry no longer matches their deps, params or outs,
    each asked of DVC alone (`dvc status <stage>`), in one opening of the repository."""
    # heavy: dvc (~0.7 s), only when the no-op path asks DVC what is stale
    from dvc.repo import Repo

    dvc_logs_once()
    with Repo(str(ROOT)) as repo:
        return [stage for stage in stages if repo.status(targets=[stage])]


def anything_stale() -> bool:
    """Whether DVC finds anything in the project not as dvc.lock and the .dvc files record it (`dvc
    status` of every stage at once: ~0.4 s, against ~0.8 s asked stage by stage). Nothing at all is
    nothing for any stage; anything is for the flow to sort out, stage by stage."""
    # heavy: dvc (~0.7 s), only when the no-op path asks DVC what is stale
    from dvc.repo import Repo

    dvc_logs_once()
    with Repo(str(ROOT)) as repo:
        return bool(repo.status())


def source_unchanged(params: Params, log: logging.Logger | logging.LoggerAdapter) -> bool:
    """The re-read (`--reingest`, a deployment's nightly run) of a project in which nothing is stale: whether
    the source gives data/ again, byte for byte. Asked before anything is recorded: such a night, the
    most common one, is then a run in which no stage ran (`record`: without MLflow's client where it
    may), not a download stage writing the same files again (3-4 CPU-seconds of MLflow's client, a `dvc
    add`, DVC hashing data/ anew: benchmarks/results/deployment-noop.json). A changed source is read a
    second time by the download stage, which checks, records and swaps it in: the rare night, which
    retrains anyway. A source that cannot be read is the download stage's to report, as on any night: its
    task retries an unreachable one, and fails naming the file or URL."""
    # heavy: numpy and the source loaders (~0.3 s), only for a re-read
    from tasks.data.download import source_unchanged as gives_the_same

    asked = (data_md5(), repr(params.data))
    if asked in _found_changed:  # `make run --reingest` asked, then started the flow, which asks again
        log.info("download: source re-read before the flow started, data changed: ingesting it")
        return False
    try:
        unchanged = gives_the_same(params.data, ROOT / DATA_DIR, download_cache())
    except ExpectedFailure as exc:
        log.warning("download: the source could not be re-read (%s): the download stage will try", exc)
        return False
    log.info("download: source re-read, %s", "data unchanged" if unchanged else "data changed: ingesting it")
    if not unchanged:
        _found_changed.add(asked)
    return unchanged


# (data/'s md5, the data params) for which this process found the source changed: a later "changed" for
# the same data/ only costs the download stage a read it would do anyway, while "unchanged" is never
# remembered (data/ or the source may change between two questions; a source read once per question)
_found_changed: set[tuple[str, str]] = set()


def eligible(force: bool, overrides: object) -> bool:
    """Whether this command may settle a no-op run without Prefect (the module's docstring says when)."""
    return not (force or overrides or os.environ.get("PREFECT_API_URL"))


def record_if_nothing_stale(params: Params, reingest: bool = False) -> tuple[dict[str, dict[str, object]], str] | None:
    """The run's results (every stage `ran: False`) and its summary once recorded in MLflow, if DVC finds
    nothing stale, the source re-read (`reingest`) gives data/ again, and no other run holds the
    pipeline lock; None when the flow has to run."""
    results: dict[str, dict[str, object]] = {name: {"ran": False} for name in STAGES}
    try:
        with pipeline_lock("make run (checking what is stale)", 0, logger=_lock_log):
            if anything_stale() or (reingest and not source_unchanged(params, log)):
                return None
            if reingest:
                results["download"]["reread"] = "unchanged"
            md5 = data_md5()
            summary = summarize(results, md5, md5)
            record(params, NO_FLOW_RUN, summary)
    except PipelineBusy:
        return None
    return results, summary


def record(params: Params, flow_run: str, summary: str = NOTHING_RAN) -> None:
    """The MLflow pipeline run of a run in which no stage ran, `flow_run` naming its Prefect flow run (or
    saying there was none), `summary` saying what it did (flows/summary.py). Written into the project's
    sqlite store directly where that is safe (tasks/tracking/sqlite_record.py says why and when), else
    by MLflow's client, with the code the flow uses when stages run (tasks/tracking/runs.py `pipeline_run`)."""
    if not params.tracking.enabled:
        return
    tags = {"lockstep.summary": summary, "lockstep.retrained": "false", "lockstep.flow_run": flow_run}
    if record_pipeline_run(tracking_uri(), params, "prefect", tags) is not None:
        return

    with pipeline_run(params.tracking, entry_point="prefect", params=params) as run_id:
        if run_id:
            tag_run(run_id, tags)
