"""The pipeline as a Prefect flow: one task per stage, DVC deciding what is stale.

DVC owns caching. For each stage in order, the task asks DVC whether the stage is stale
(`Repo.status`); if it is, it runs the stage function in this process (torch and MLflow are
imported once, not once per stage) and records the result with `Repo.commit`, which writes the
same dvc.lock entry `dvc repro` would. So a stage reproduced by one entry point is not redone by
the other, and both give the same weights.

A run holds the project's pipeline lock (tasks/core/lock.py) from start to end: an
overlapping run, from any entry point, waits for it or is refused.

    python -m flows.pipeline                 # what `make run` does (Prefect's ephemeral mode, no server)
    python -m flows.pipeline --force         # re-run every stage
    python -m flows.pipeline --reingest      # re-read the source first, as scheduled runs do
    python -m flows.pipeline --set train.lr=0.01   # written into params.yaml first, like `dvc exp run -S`

As a service: flows/deployments.py (`make schedule`, and work pools).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from flows import notify, prefect_env
from flows.prefect_env import ALLOW_OVERRIDES_ENV, allowed_overrides
from flows.run_params import check_run_params, params_file_changes
from tasks.core.atomic import write_text
from tasks.core.cli import dvc_logs_once, exit_code
from tasks.core.config.params import STAGES, Params
from tasks.core.config.yaml_io import PARAMS_FILE
from tasks.core.layout import ROOT
from tasks.determinism.bootstrap import bootstrap, pin

FLOW_NAME = "lockstep-pipeline"


def _is_stale(stage: str) -> bool:
    from dvc.repo import Repo

    dvc_logs_once()
    with Repo(str(ROOT)) as repo:
        return bool(repo.status(targets=[stage]))


def _commit(stage: str) -> None:
    from dvc.repo import Repo

    dvc_logs_once()
    with Repo(str(ROOT)) as repo:
        repo.commit(stage, force=True)


def _run_if_stale(stage: str, params: Params, force: bool) -> dict[str, Any]:
    logger = get_run_logger()
    if not force and not _is_stale(stage):
        logger.info("%s: up to date (dvc.lock), skipped", stage)
        return {"ran": False}
    from tasks.stages import run_stage  # imports torch (~1.7 s): only once a stage has to run

    metrics = run_stage(stage, params)
    _commit(stage)
    logger.info("%s: %s", stage, brief(metrics))
    return {"ran": True, **metrics}


def brief(metrics: dict[str, Any], limit: int = 6) -> str:
    """A stage's summary metrics for a person: numbers to 4 digits, the first few (all are in MLflow)."""
    first = sorted(metrics, key=lambda key: "accuracy" not in key)  # the number a person looks for first
    shown = [f"{k} {metrics[k]:.4g}" if isinstance(metrics[k], float) else f"{k} {metrics[k]}" for k in first]
    more = f", … {len(shown) - limit} more in its MLflow run" if len(shown) > limit else ""
    return ", ".join(shown[:limit]) + more


def _source_was_unreachable(task: Any, task_run: Any, state: Any) -> bool:
    """Retry the download task only when the source itself failed after the fetcher's own retries
    (a mirror rebooting at 3 a.m.); bad params, 404s and checksum mismatches fail at once."""
    from tasks.data.fetch import DownloadError

    try:
        state.result()
    except DownloadError as exc:
        return exc.transient
    except Exception:  # any other failure is not the source's: no retry (it is re-raised by Prefect)
        return False
    return False


# One Prefect task per stage, named after it. Prefect's own result cache is off on purpose: DVC is
# the one cache, shared with `dvc repro`. Download retries transient outages (tasks/data/fetch.py already
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


def summarize(results: dict[str, dict[str, Any]], data_md5_before: str, data_md5_after: str) -> str:
    """One line that says what this run did: a scheduled run must say when it retrained nothing."""
    ran = [name for name, result in results.items() if result["ran"]]
    retrained = [name for name in ran if name != "download"]
    if retrained:
        data = "new data" if data_md5_after != data_md5_before else "same data"
        return f"stages run: {', '.join(ran)} ({data}, md5 {data_md5_after})"
    if ran:
        return f"stages run: download; source re-read, data unchanged (md5 {data_md5_after}): nothing retrained"
    return "stages run: none (everything up to date): nothing retrained"


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
    from prefect.artifacts import create_markdown_artifact
    from prefect.runtime import flow_run

    from tasks.core.hashing import data_md5
    from tasks.core.lock import pipeline_lock
    from tasks.tracking.runs import pipeline_run, tag_run

    os.chdir(ROOT)
    logger = get_run_logger()
    # A run started through the API changes only the keys it may (tasks/core/config/policy.py), be it
    # with `overrides` or with a `params_file` that differs from params.yaml; `--set` and `--params` at
    # the prompt allow theirs (_run). The allow-list comes from where no run can set it, and the file
    # is read once: what was checked is what runs, whatever happens to the file meanwhile (run_params.py).
    checked = check_run_params(params_file, overrides, prefect_env.run_allow_list())
    notify.checked(checked.params.orchestration.notify)  # the hooks route by these, not by the file
    params = pin(checked.params)  # the stages run in this process, on these params
    with pipeline_lock(
        f"Prefect flow run {flow_run.name or FLOW_NAME}", params.orchestration.lock_wait_s, logger=logger
    ):
        if overrides:  # written as checked, like `dvc exp run -S`: the file is the record of what ran
            write_text(checked.path, checked.text)
            logger.info("%s updated: %s", params_file, json.dumps(overrides))
        before = data_md5()
        results: dict[str, dict[str, Any]] = {}
        with pipeline_run(params.tracking, entry_point="prefect", params=params) as run_id:
            for name in STAGES:
                with notify.stage(name):  # a failure or crash inside names the stage
                    results[name] = STAGE_TASKS[name](name, params, force or (reingest and name == "download"))
            summary = summarize(results, before, data_md5())
            if run_id:
                retrained = str(results["train"]["ran"]).lower()
                tag_run(run_id, {"lockstep.summary": summary, "lockstep.retrained": retrained})
    logger.info(summary)
    create_markdown_artifact(
        key="pipeline-summary", markdown=_summary_table(results, summary), description="what this pipeline run did"
    )
    return results


def _summary_table(results: dict[str, dict[str, Any]], summary: str) -> str:
    rows = [
        f"| {name} | {'ran' if r['ran'] else 'up to date'} | "
        + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "ran")
        + " |"
        for name, r in results.items()
    ]
    return "\n".join([f"**{summary}**", "", "| stage | | metrics |", "| --- | --- | --- |", *rows])


def _warm_imports() -> None:
    import dvc.repo  # noqa: F401
    import mlflow  # noqa: F401


def _run_with_local_api(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    with prefect_env.local_api(while_starting=_warm_imports):
        return pipeline(
            params_file=args.params, force=args.force, reingest=args.reingest, overrides=dict(args.overrides) or None
        )


def _override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. train.lr=0.01), got {text!r}")
    from tasks.core.config.yaml_io import load_yaml

    return key, load_yaml(value)  # 0.01 -> float, [a, b] -> list, like `dvc exp run -S`


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flows.pipeline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", default=PARAMS_FILE, help="params file (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="re-run every stage, stale or not")
    parser.add_argument("--reingest", action="store_true", help="re-read the data source first")
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        type=_override,
        action="append",
        default=[],
        help="write a value into params.yaml first (repeatable)",
    )
    args = parser.parse_args(argv)
    return exit_code(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    from tasks.tracking.store import check_store

    params = bootstrap(ROOT / args.params, dict(args.overrides))  # fail fast, before a server starts
    # the user at this prompt may change any key, with --set or --params: only API-started runs are restricted
    typed = [key for key, _ in args.overrides] + params_file_changes(args.params)
    os.environ[ALLOW_OVERRIDES_ENV] = ",".join([*allowed_overrides(), *typed])
    check_store(params.tracking)  # a tracking server that is down fails the run now, not after training
    started = time.monotonic()
    results = _run_with_local_api(args)
    print("\n".join(closing_summary(results, time.monotonic() - started, params)))
    return 0


def closing_summary(results: dict[str, dict[str, Any]], seconds: float, params: Params) -> list[str]:
    """What a person reads at the end of a run: what ran, how good the model is, what shipped, where."""
    from tasks.tracking.dashboard import headline

    ran = [name for name, result in results.items() if result["ran"]]
    lines = [f"done in {seconds:.0f} s; stages run: {', '.join(ran) or 'none (everything up to date)'}"]
    numbers = headline()
    if "test_accuracy" in numbers.metrics:
        lines.append(f"  test accuracy {numbers.metrics['test_accuracy']:.4f} (fp32 model, the test split)")
    if numbers.shipped_variant:
        m = numbers.metrics
        size = f", {m['shipped_size_bytes'] / 1024:.0f} KiB" if "shipped_size_bytes" in m else ""
        speed = f", {m['shipped_latency_b1_ms']:.2f} ms per image" if "shipped_latency_b1_ms" in m else ""
        lines.append(
            f"  shipped {numbers.shipped_variant}: test accuracy {m['shipped_test_accuracy']:.4f}{size}{speed}"
            " -> artifacts/export/model.onnx (card: artifacts/export/model_card.md)"
        )
    if "promotion" in results["export"]:
        lines.append(f"  registry: {results['export']['promotion']}")
    if params.tracking.enabled:
        lines.append(f"  runs: {_runs_page(params)}")
    return lines


def _runs_page(params: Params) -> str:
    """Where the runs are: the tracking server's runs table, or the local store's under `make ui`."""
    from mlflow import MlflowClient

    from tasks.core.redact import redact
    from tasks.tracking.dashboard import runs_page
    from tasks.tracking.store import tracking_uri

    uri = tracking_uri()
    experiment = MlflowClient(uri).get_experiment_by_name(params.tracking.experiment)
    served = uri.startswith(("http://", "https://"))
    page = runs_page(redact(uri).rstrip("/") if served else "http://127.0.0.1:5000", experiment.experiment_id)
    return page if served else f"make ui, then {page}"


if __name__ == "__main__":
    sys.exit(main())
