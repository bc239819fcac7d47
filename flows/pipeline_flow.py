"""The pipeline as a Prefect flow: one task per stage, DVC deciding what is stale.

DVC owns caching. For each stage in order, the task asks DVC whether the stage is stale
(`Repo.status`); if it is, it runs the stage function in this process (torch and MLflow are
imported once, not once per stage), and the flow records it in dvc.lock as `dvc commit` does: the
same entry `dvc repro` would write, quick stages together with the next (flows/commits.py). So a
stage reproduced by one entry point is not redone by the other, and both give the same weights.

A run holds the project's pipeline lock (tasks/core/lock.py) from start to end: an
overlapping run, from any entry point, waits for it or is refused.

The command line (`make run`, `python -m flows.pipeline`) is flows/pipeline.py, which imports this
module only once a stage is stale or a Prefect server is in use (flows/noop.py); deployments load
the flow as `flows/pipeline.py:pipeline`, which resolves to `pipeline` here.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import deployment as this_deployment
from prefect.runtime import flow_run
from prefect.tasks import exponential_backoff

from flows import noop, notify, prefect_env, prefect_settings
from flows.commits import PendingCommits
from flows.noop import anything_stale, stale_stages
from flows.run_params import check_run_params, recheck
from flows.summary import brief, summarize
from tasks.core.atomic import write_text
from tasks.core.config.params import STAGES, Params
from tasks.core.config.yaml_io import PARAMS_FILE
from tasks.core.fetch import DownloadError
from tasks.core.hashing import data_md5
from tasks.core.layout import ROOT
from tasks.core.lock import pipeline_lock
from tasks.core.remote import push_outputs
from tasks.determinism.bootstrap import prepare
from tasks.tracking import registrar
from tasks.tracking.orphans import FLOW_RUN_TAG
from tasks.tracking.runs import pipeline_run, tag_run

FLOW_NAME = "lockstep-pipeline"


def _is_stale(stage: str) -> bool:
    return bool(stale_stages([stage]))


def _run_if_stale(stage: str, params: Params, force: bool, up_to_date: bool = False) -> dict[str, Any]:
    """`up_to_date`: the flow found this stage up to date already, asking DVC about several stages at
    once (before the first ran, or after a re-read left the data unchanged: `_stages`); otherwise DVC
    is asked here, after the stages before this one have run."""
    logger = get_run_logger()
    if not force and (up_to_date or not _is_stale(stage)):
        logger.info("%s: up to date (dvc.lock), skipped", stage)
        return {"ran": False}
    from tasks.runner import run_stage  # imports torch (~1.7 s): only once a stage has to run, pinned (prepare)

    metrics = run_stage(stage, params)  # recorded in dvc.lock by the flow (_stages: flows/commits.py)
    logger.info("%s: %s", stage, brief(metrics))
    return {"ran": True, **metrics}


def _source_was_unreachable(task: Any, task_run: Any, state: Any) -> bool:
    """Retry the download task only when the source itself failed after the fetcher's own retries
    (a mirror rebooting at 3 a.m.); bad params, 404s and checksum mismatches fail at once."""
    try:
        state.result()
    except DownloadError as exc:
        return exc.transient
    except Exception:  # any other failure is not the source's: no retry (it is re-raised by Prefect)
        return False
    return False


# One Prefect task per stage, named after it. Prefect's own result cache is off on purpose: DVC is
# the one cache, shared with `dvc repro`. Download retries transient outages (tasks/core/fetch.py already
# retries each file with backoff; this retries the whole stage minutes later).
STAGE_TASKS = {
    name: task(
        _run_if_stale,
        name=name,
        task_run_name=name,
        cache_policy=NO_CACHE,
        **(
            {
                "retries": 2,
                "retry_delay_seconds": exponential_backoff(backoff_factor=60),
                "retry_jitter_factor": 0.5,
                "retry_condition_fn": _source_was_unreachable,
            }
            if name == "download"
            else {}
        ),
    )
    for name in STAGES
}


@flow(
    name=FLOW_NAME,
    log_prints=True,
    # who runs the service is told of failed, refused and crashed runs and of promotions (flows/notify.py)
    on_running=[notify.announce],
    on_failure=[notify.on_failure],
    on_crashed=[notify.on_crashed],
    on_completion=[notify.on_completion],
)
def pipeline(
    params_file: str = PARAMS_FILE, force: bool = False, reingest: bool = False, overrides: dict[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    """Run download -> stats -> preprocess -> train -> evaluate -> compress -> export, skipping what DVC
    finds up to date.

    Args:
        params_file: the params file, relative to the project root.
        force: re-run every stage, stale or not.
        reingest: re-read the data source even if its params did not change (scheduled retraining);
            unchanged data leaves every later stage up to date.
        overrides: dotted keys written into params.yaml before the run, e.g. {"train.lr": 0.01}.
    """
    # a work pool's flow-run process starts in Prefect's engine, not at flows.pipeline's main
    prefect_settings.send_logs()
    os.chdir(ROOT)
    logger = get_run_logger()
    # A run started through the API changes only the keys it may (tasks/core/config/policy.py), be it
    # with `overrides` or with a `params_file` that differs from params.yaml; `--set` and `--params` at
    # the prompt allow theirs (_run). The allow-list comes from where no run can set it, and the file
    # is read before the lock and, if it changed meanwhile, again under it: what was checked is what
    # runs, whatever happens to the file (run_params.py).
    allowed = prefect_env.run_allow_list()
    checked = check_run_params(params_file, overrides, allowed)
    notify.checked(checked.params.orchestration.notify)  # the hooks route by these, not by the file
    params = checked.params
    prepare(params.determinism.cpu)  # the stages run in this process, on these params: before torch loads
    with pipeline_lock(
        f"Prefect flow run {flow_run.name or FLOW_NAME}", params.orchestration.lock_wait_s, logger=logger
    ):
        checked = recheck(checked, allowed)  # the file DVC will record is the one used
        if checked.params is not params:  # written while this run waited (a sweep's --apply, another run)
            params = checked.params
            notify.checked(params.orchestration.notify)
            logger.info("%s was changed while this run waited for the lock: running what it holds now", params_file)
        if overrides:  # written as checked, like `dvc exp run -S`: the file is the record of what ran
            write_text(checked.path, checked.text)
            logger.info("%s updated: %s", params_file, json.dumps(overrides))
        results, summary = _stages(params, force, reingest, str(flow_run.id), logger)
    logger.info(summary)
    create_markdown_artifact(
        key="pipeline-summary", markdown=_summary_table(results, summary), description="what this pipeline run did"
    )
    return results


def _stages(
    params: Params, force: bool, reingest: bool, flow_run_id: str, logger: Any
) -> tuple[dict[str, dict[str, Any]], str]:
    """The seven stage tasks, under the pipeline lock; their results and the run's one-line summary."""
    before = data_md5()
    results: dict[str, dict[str, Any]] = {}
    # Nothing stale now (the lock is held: nothing changes it) is nothing stale at every task, and a
    # run in which no stage runs is recorded once it is over, as `make run` records one (noop.py).
    # With a stale stage, each later one is asked again once those before it ran.
    if not (force or anything_stale() or (reingest and not _source_unchanged(params, logger))):
        for name in STAGES:
            with notify.stage(name):
                results[name] = STAGE_TASKS[name](name, params, False, up_to_date=True)
        if reingest:
            results["download"]["reread"] = "unchanged"
        summary = summarize(results, before, before)
        noop.record(params, flow_run_id, summary)
        return results, summary
    # (registrar.py: started here for a run a worker started; `make run` has started it already)
    with (
        registrar.helping(params.tracking),
        pipeline_run(params.tracking, entry_point="prefect", params=params) as run_id,
    ):
        if run_id:  # from the start: a run on another host asks Prefect whether this one is over (orphans.py)
            tag_run(run_id, {FLOW_RUN_TAG: flow_run_id})
        with PendingCommits(ROOT).flushed() as commits:  # before the push below: dvc.lock names what to push
            rest_up_to_date = False
            for at, name in enumerate(STAGES):
                began = time.monotonic()
                with notify.stage(name):  # a failure or crash inside names the stage
                    forced = force or (reingest and name == "download")
                    results[name] = STAGE_TASKS[name](name, params, forced, up_to_date=rest_up_to_date)
                if results[name]["ran"]:
                    commits.ran(name, time.monotonic() - began)
                    # A re-read that came out unchanged in a run with something else stale (an unchanged
                    # source and nothing stale never gets here: _source_unchanged): DVC is asked about the
                    # six stages after it in one opening of the repository, not one each.
                    if name == "download" and not force and data_md5() == before:
                        rest_up_to_date = not stale_stages(STAGES[at + 1 :])
        summary = summarize(results, before, data_md5())
        if run_id:
            retrained = str(results["train"]["ran"]).lower()
            tags = {"lockstep.summary": summary, "lockstep.retrained": retrained}
            tag_run(run_id, {**tags, FLOW_RUN_TAG: flow_run_id})
        # A worker's checkout may be a temporary clone (deploy --git) that Prefect deletes after the
        # run: what it made goes to the DVC remote now, under the lock (tasks/core/remote.py).
        if this_deployment.id:
            push_outputs(logger=logger)
    return results, summary


def _source_unchanged(params: Params, logger: Any) -> bool:
    """Whether the re-read source gives data/ byte for byte (flows/noop.py `source_unchanged`)."""
    with notify.stage("download"):  # anything but a source that cannot be read fails the run naming the stage
        return noop.source_unchanged(params, logger)


def _summary_table(results: dict[str, dict[str, Any]], summary: str) -> str:
    rows = [
        f"| {name} | {'ran' if r['ran'] else 'up to date'} | "
        + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "ran")
        + " |"
        for name, r in results.items()
    ]
    return "\n".join([f"**{summary}**", "", "| stage | | metrics |", "| --- | --- | --- |", *rows])
