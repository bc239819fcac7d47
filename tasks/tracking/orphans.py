"""Orphaned runs: MLflow runs left RUNNING by a process that was killed, marked KILLED with the reason.

Every run lockstep opens records its owner as tags (tasks/tracking/owners.py `owner_tags`): the host
name, the pid namespace, the pid and the process's start time. The owner is the process that ends the
run: the flow process for the pipeline's parent run, the stage process for a stage run, and for the
parent run of a `dvc repro` / `dvc exp run` session the dvc process (several stage processes share
that run).

`mark_orphans` looks at the RUNNING runs only (searched page by page) and marks KILLED each one whose
owner was on this host and in this pid namespace and whose process is gone: its pid is not alive,
is a zombie, or belongs to another process (another start time: pids are reused). The reason is the
tag `lockstep.killed_reason`, which the MLflow UI lists under the run's tags, beside its KILLED
status; a run without a description gets the reason as its description too (shown in full). A run
is marked only if it is still RUNNING just before (one that ended meanwhile is left as it ended).

A run owned by another host (or pid namespace) cannot be checked from here, except through the
Prefect server: the pipeline's parent run carries its flow run's id (`lockstep.flow_run`, tagged
when it starts), and its stage runs are its children. If that flow run is over on the server
(PREFECT_API_URL: Crashed, Failed, Cancelled or Completed) while the run is still RUNNING, its owner
is gone, or stopped writing when it lost the pipeline lock (tasks/core/lock.py), and the run is
marked KILLED with that flow run's state in the reason. That is how a trainer that lost its link or
its power has its runs marked by the next run on another trainer: Prefect marks the flow run Crashed
when its heartbeats stop (flows/prefect_env.py, the zombie automation). The server is asked only
about such runs, one request each; if it cannot be asked, they are left alone.

Left alone, since their process cannot be checked from here:
- runs owned by another host, or by another pid namespace on this one (another container), without
  a flow run that Prefect holds as over: their pids mean other processes here. Run the sweep on
  that host.
- runs without owner tags: made by an older lockstep or by someone else's code.
`older_than_s` (the command's `--older-than 7d`) marks those too once they started that long ago,
with a reason that says why: the one way to clear runs of a host that no longer exists, or of an
older lockstep. It is never used automatically, since only a person knows how long a run may last.
Children of a killed parent are judged by their own owner, like every run. Marking changes the record
only, it signals no process: an owner that was alive after all (`--older-than`) ends its run later
with its own status.

It runs by itself at the start of every pipeline execution (tasks/tracking/runs.py: the flow's parent
run, a stage process that creates or resumes the DVC session's parent run), over the pipeline's
experiment, and at the start of `python -m tasks.tools.reproduce`, over every experiment; a failure of the
sweep (a run deleted meanwhile, a store error) is a logged warning there, never a failed pipeline.
By hand, over every experiment:

    python -m tasks.tracking.orphans [--experiment NAME ...] [--older-than AGE] [--dry-run] [--tracking-uri URI]

prints one line per run marked and a count, and exits 0 (1 if the store cannot be read).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tasks.core.cli import configure_logging, exit_code, one_line
from tasks.core.errors import ExpectedFailure
from tasks.core.redact import redact
from tasks.tracking.owners import (
    ALIVE,
    ELSEWHERE,
    GONE,
    STALE,
    UNOWNED,
    flow_run_state,
    iso_time,
    judge_owner,
    owner_of,
    who,
)
from tasks.tracking.store import tracking_uri

log = logging.getLogger("tasks.tracking.orphans")  # not __name__: that is "__main__" under -m

KILLED_REASON = "lockstep.killed_reason"
FLOW_RUN_TAG = "lockstep.flow_run"  # the Prefect flow run of a pipeline's parent run (flows/pipeline_flow.py)
PARENT_TAG = "mlflow.parentRunId"
FINAL_FLOW_RUN_STATES = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")  # Prefect's state types
NOTE = "mlflow.note.content"  # the run's description in the UI, shown in full (a tag's value is cut short)
RUNNING = "attributes.status = 'RUNNING'"
PAGE = 1000  # runs per search request
EXPERIMENTS_PER_SEARCH = 100


@dataclass(frozen=True)
class Judged:
    """One RUNNING run and what the sweep makes of it; `why` is a sentence."""

    run_id: str
    experiment_id: str
    run_name: str
    verdict: str
    why: str

    @property
    def orphaned(self) -> bool:
        return self.verdict in (GONE, STALE)


@dataclass(frozen=True)
class Marked:
    run_id: str
    experiment_id: str
    run_name: str
    reason: str


def judge(run: Any, older_than_s: float | None = None, now: float | None = None) -> Judged:
    """What the sweep makes of one RUNNING run (an mlflow Run)."""
    tags, info = run.data.tags, run.info
    verdict, why = judge_owner(tags)
    # a run written by hand through the REST API may have no start time: then it has no age either
    if verdict in (ELSEWHERE, UNOWNED) and older_than_s is not None and isinstance(info.start_time, int | float):
        age = (now if now is not None else time.time()) - info.start_time / 1000
        if age >= older_than_s:
            verdict = STALE
            why = f"{why}; it started {iso_time(info.start_time / 1000)}, more than {_age_text(older_than_s)} ago"
    return Judged(info.run_id, info.experiment_id, info.run_name or "", verdict, why)


# --------------------------------------------------------------------------- the sweep


def _experiments(client: Any) -> list[str]:
    # heavy: mlflow (~4 s), only when runs are searched; `--help` stays fast
    from mlflow.entities import ViewType

    ids, token = [], None
    while True:
        page = client.search_experiments(view_type=ViewType.ACTIVE_ONLY, max_results=PAGE, page_token=token)
        ids += [experiment.experiment_id for experiment in page]
        token = page.token
        if not token:
            return ids


def _running_runs(client: Any, experiment_ids: list[str]) -> Iterator[Any]:
    """Every active RUNNING run, oldest first (runs started meanwhile come last: no page shifts)."""
    # heavy: mlflow (~4 s), only when runs are searched; `--help` stays fast
    from mlflow.entities import ViewType

    for start in range(0, len(experiment_ids), EXPERIMENTS_PER_SEARCH):
        chunk, token = experiment_ids[start : start + EXPERIMENTS_PER_SEARCH], None
        while True:
            page = client.search_runs(
                chunk,
                RUNNING,
                run_view_type=ViewType.ACTIVE_ONLY,
                max_results=PAGE,
                order_by=["attributes.start_time ASC"],
                page_token=token,
            )
            yield from page
            token = page.token
            if not token:
                break


def survey(client: Any, experiment_ids: Iterable[str] | None = None, older_than_s: float | None = None) -> list[Judged]:
    """Every RUNNING run of these experiments (default: all active ones), judged."""
    ids = _experiments(client) if experiment_ids is None else list(experiment_ids)
    now = time.time()
    # all pages read before any run is marked: a marked run leaves the result, and pages are offsets
    runs = list(_running_runs(client, ids))
    return _ended_flow_runs(client, runs, [judge(run, older_than_s, now) for run in runs])


def _ended_flow_runs(client: Any, runs: list[Any], judged: list[Judged]) -> list[Judged]:
    """`judged`, with each run of another host whose Prefect flow run is over made GONE (module doc)."""
    if not os.environ.get("PREFECT_API_URL") or all(j.verdict != ELSEWHERE for j in judged):
        return judged
    tags_of = {run.info.run_id: run.data.tags for run in runs}

    def flow_run_of(tags: dict[str, str]) -> str | None:
        parent = tags.get(PARENT_TAG)
        if FLOW_RUN_TAG in tags or not parent:
            return tags.get(FLOW_RUN_TAG)
        if parent not in tags_of:  # a parent that ended already
            try:
                tags_of[parent] = client.get_run(parent).data.tags
            except Exception:  # noqa: BLE001 - deleted meanwhile: no flow run known
                tags_of[parent] = {}
        return tags_of[parent].get(FLOW_RUN_TAG)

    flow_runs = {j.run_id: flow_run_of(tags_of[j.run_id]) for j in judged if j.verdict == ELSEWHERE}
    states = {flow_run: flow_run_state(flow_run) for flow_run in set(flow_runs.values()) if flow_run}
    result = []
    for one in judged:
        flow_run = flow_runs.get(one.run_id)
        state = states.get(flow_run) if flow_run else None
        if state is not None and state[0] in FINAL_FLOW_RUN_STATES:
            why = f"{owner_of(tags_of[one.run_id])} ran Prefect flow run {flow_run}, which is {state[1]} on the server"
            one = replace(one, verdict=GONE, why=why + (f" ({state[2]})" if state[2] else ""))
        result.append(one)
    return result


def mark(client: Any, orphans: Iterable[Judged], marked_by: str) -> list[Marked]:
    """Mark each orphan KILLED with its reason; one that cannot be marked is a warning, not an error."""
    stamp = f"marked KILLED by {marked_by} at {iso_time(time.time())}"
    marked = []
    for run in orphans:
        reason = redact(f"{run.why}; {stamp}")
        try:
            current = client.get_run(run.run_id)
            if current.info.status != "RUNNING":
                continue  # ended meanwhile, as its owner said
            client.set_tag(run.run_id, KILLED_REASON, reason)
            if not current.data.tags.get(NOTE):  # a description someone wrote stays
                client.set_tag(run.run_id, NOTE, f"Marked KILLED: {reason}")
            client.set_terminated(run.run_id, "KILLED")
        except Exception as exc:  # noqa: BLE001 - a run deleted meanwhile, a store error: the next run
            log.warning("orphaned run %s (%s) not marked KILLED: %s", run.run_id, run.run_name, one_line(str(exc)))
            continue
        log.info("marked orphaned run %s (%s) KILLED: %s", run.run_id, run.run_name, reason)
        marked.append(Marked(run.run_id, run.experiment_id, run.run_name, reason))
    return marked


def mark_orphans(
    client: Any,
    experiment_ids: Iterable[str] | None = None,
    *,
    marked_by: str | None = None,
    older_than_s: float | None = None,
) -> list[Marked]:
    """Mark KILLED every RUNNING run of these experiments (default: all) whose owner is gone (module doc)."""
    orphans = [run for run in survey(client, experiment_ids, older_than_s) if run.orphaned]
    return mark(client, orphans, marked_by or who("lockstep"))


def mark_orphans_or_warn(client: Any, experiment_ids: Iterable[str] | None, marked_by: str) -> list[Marked]:
    """`mark_orphans` at the start of a pipeline execution: its failure is a warning, never the pipeline's."""
    try:
        return mark_orphans(client, experiment_ids, marked_by=who(marked_by))
    except Exception as exc:  # noqa: BLE001 - whatever the store raised, the pipeline goes on
        log.warning("orphaned runs not checked: %s", one_line(str(exc)))
        return []


# --------------------------------------------------------------------------- the command

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_age(text: str) -> float:
    """'90m', '12h', '7d', '30s' in seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age such as 30m, 12h or 7d")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _age_text(seconds: float) -> str:
    for unit in ("d", "h", "m"):
        if seconds >= _UNITS[unit] and seconds % _UNITS[unit] == 0:
            return f"{seconds / _UNITS[unit]:g}{unit}"
    return f"{seconds:g}s"


def default_store() -> str:
    """The store lockstep tracks into (tasks/tracking/store.py)."""
    return tracking_uri()


def _client(uri: str) -> Any:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # a server that is down: an error in seconds, not after minutes of retries
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    # heavy: mlflow (~4 s), only when runs are searched; `--help` stays fast
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _experiment_ids(client: Any, names: list[str] | None) -> list[str] | None:
    if not names:
        return None
    ids = []
    for name in names:
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise ExpectedFailure(f"no experiment named {name!r} in the store")
        ids.append(experiment.experiment_id)
    return ids


def _run(args: argparse.Namespace) -> int:
    uri = args.tracking_uri or default_store()
    store = Path(uri.removeprefix("sqlite:///"))
    if uri.startswith("sqlite:///") and not store.exists():  # do not create one
        print(f"no MLflow store at {store}: no runs to check")
        return 0
    # heavy: mlflow (~4 s), only when runs are searched; `--help` stays fast
    from mlflow.exceptions import MlflowException

    try:
        client = _client(uri)
        judged = survey(client, _experiment_ids(client, args.experiment), args.older_than)
        orphans = [run for run in judged if run.orphaned]
        if args.dry_run:
            lines = [f"would mark KILLED {run.run_id} ({run.run_name}): {run.why}" for run in orphans]
        else:
            marked = mark(client, orphans, who("python -m tasks.tracking.orphans"))
            lines = [f"KILLED {run.run_id} ({run.run_name}): {run.reason}" for run in marked]
    except MlflowException as exc:
        raise ExpectedFailure(f"MLflow store {redact(uri)}: {exc.message}") from None
    for line in lines:
        print(one_line(line))
    print(f"{len(lines)} orphaned run(s) {'would be marked' if args.dry_run else 'marked'} KILLED")
    left = Counter(run.verdict for run in judged if not run.orphaned)
    if left:
        print("left RUNNING: " + ", ".join(f"{count} {_LEFT[verdict]}" for verdict, count in sorted(left.items())))
    return 0


_LEFT = {
    ALIVE: "with a live owner",
    ELSEWHERE: "owned by another host or pid namespace (run this there, or see --older-than)",
    UNOWNED: "without owner tags (see --older-than)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tasks.tracking.orphans",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--experiment", action="append", metavar="NAME", help="only this experiment (repeatable)")
    parser.add_argument(
        "--older-than",
        type=parse_age,
        metavar="AGE",
        help="also mark runs that cannot be checked from here (other host, no owner tags) started "
        "more than AGE ago (30m, 12h, 7d)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print what would be marked; change nothing")
    parser.add_argument("--tracking-uri", metavar="URI", help="default: MLFLOW_TRACKING_URI, else the project's store")
    args = parser.parse_args(argv)
    configure_logging("%(message)s")
    logging.getLogger("tasks.tracking.orphans").setLevel(logging.WARNING)  # the lines printed say it already
    return exit_code(lambda: _run(args))


if __name__ == "__main__":
    sys.exit(main())
