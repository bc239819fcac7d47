"""`make sweep` / `python -m flows.sweep`: the `sweep` section of params.yaml as a Prefect flow.

The flow brings the data up to date (download, stats, preprocess, skipped by DVC when current),
then runs an Optuna study in batches (tasks/tools/sweep/study.py: results depend on the params and the data,
never on timing). Each trial is a Prefect task on a Dask cluster: `sweep.address` (or env
LOCKSTEP_DASK_ADDRESS) names its scheduler; without one, a local cluster of `sweep.workers`
processes. Each trial trains as the train stage does, logged as an MLflow train run nested in the
sweep's run; the sweep's run records the study (best trial, a table of every trial, plots).

    python -m flows.sweep                     # run (or resume) the study sweep.name
    python -m flows.sweep --apply             # ... then write the best trial's params into params.yaml
    python -m flows.sweep --address tls://10.0.0.5:8786 --tls DIR --set sweep.trials=32
    python -m flows.sweep tls DIR                        # a cluster's TLS credentials (copy DIR to each machine)
    python -m flows.sweep scheduler --host 10.0.0.5 --port 8786 --tls DIR   # a Dask scheduler for trials
    python -m flows.sweep worker tls://10.0.0.5:8786 --tls DIR              # a Dask worker, on each machine

Off loopback, Dask's mutual TLS is required (tasks/tools/sweep/cluster.py: a Dask port runs code).

Each worker runs trials in its own clone (wherever it is) with the same preprocessed data: a clone at
the same commit after `dvc pull data.dvc && dvc repro preprocess` (or `dvc pull preprocess`); a
trial refuses other data (it checks its digest). Machines share no disk: a trial writes its
checkpoints into its worker's clone and logs them to its MLflow run, and the coordinator fetches the
winner's weights from that run into its own artifacts/sweep/<name>/trial-NNNN/.
The study survives the coordinator (a journal file in artifacts/sweep/<name>/, or `sweep.storage`):
run the same command again and it resumes, without repeating a finished trial.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.context import FlowRunContext

from flows import prefect_env, prefect_settings
from flows.local_records import wait_recorded
from flows.pipeline import STAGE_TASKS, _override
from flows.sweep_worker import SweepContext, run_batch, warm_up
from tasks.core import layout
from tasks.core.cli import exit_code
from tasks.core.config.base import ConfigError
from tasks.core.config.params import Params
from tasks.core.config.yaml_io import PARAMS_FILE, set_params
from tasks.core.layout import ROOT
from tasks.core.lock import pipeline_lock
from tasks.core.redact import redact_mapping
from tasks.determinism import cpu_mode
from tasks.determinism.bootstrap import bootstrap
from tasks.determinism.threads import cores_given, resolve, shared_env
from tasks.tools.sweep import cluster
from tasks.tools.sweep.cluster import check_scheduler_address, security, tls_dir, write_credentials
from tasks.tools.sweep.results import summarise, winner_weights, write_study
from tasks.tools.sweep.study import check_storage, data_digest, open_study, run_study, study_digest
from tasks.tracking.orphans import mark_orphans_or_warn
from tasks.tracking.runs import pipeline_run
from tasks.tracking.store import check_store, tracking_uri

FLOW_NAME = "lockstep-sweep"
ADDRESS_ENV = "LOCKSTEP_DASK_ADDRESS"
STORAGE_ENV = "LOCKSTEP_SWEEP_STORAGE"  # an Optuna RDB URL with credentials: never in params.yaml
PRELOAD = "flows.sweep_worker"  # each worker imports a trial's libraries while it waits for its first
SWEEP_DIR = layout.ARTIFACTS / "sweep"

log = logging.getLogger("flows.sweep")  # by name: under `python -m flows.sweep` the module is __main__


@flow(name=FLOW_NAME, log_prints=True)
def sweep(
    params_file: str = PARAMS_FILE, apply: bool = False, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Run (or resume) the Optuna study `sweep.name` over `sweep.space`; with `apply`, write the best
    trial's params into params.yaml.

    Args:
        params_file: the params file, relative to the project root.
        apply: write the best trial's values, its seed and `sweep.applied` into params.yaml.
        overrides: dotted keys written into params.yaml first (`--set`), e.g. {"sweep.trials": 16}.
    """
    os.chdir(ROOT)
    logger = get_run_logger()
    loaded = bootstrap(params_file, overrides)
    params = _trial_threads(loaded, logger)
    cfg = params.sweep
    if not cfg.space:
        raise ConfigError(f"{params_file}: sweep.space is empty: name the train keys to search (docs/sweeps.md)")
    # Held for the whole sweep: a pipeline run must not swap the data under the trials.
    client = _dask_client()
    # params.yaml is written under the lock too (`--set` first, `--apply` last), as the pipeline flow
    # writes its own: a pipeline run never trains on one version of the file and records another in dvc.lock
    with pipeline_lock(f"sweep {cfg.name}", params.orchestration.lock_wait_s, logger=logger):
        if overrides:
            set_params(params_file, overrides)
        with pipeline_run(params.tracking, entry_point="sweep") as parent_id:
            for name in ("download", "stats", "preprocess"):
                STAGE_TASKS[name](name, params, False)
            digest = data_digest(layout.PREPROCESSED_DIR)
            study_dir = SWEEP_DIR / cfg.name
            study_key = study_digest(params, digest)
            study = open_study(cfg, os.environ.get(STORAGE_ENV) or cfg.storage, study_dir, study_key)
            context = SweepContext(params, parent_id, tracking_uri(), digest, study_dir.as_posix())
            client.run(warm_up)  # every worker has what a trial needs: the clock starts with the trials
            started = time.monotonic()
            run_study(study, cfg, study_key, lambda specs: run_batch(specs, context, cfg.retries))
            summary = summarise(study, cfg, round(time.monotonic() - started, 2))
            # the winner's weights here, whichever machine trained them (from its MLflow run)
            weights = winner_weights(summary, study_dir, tracking_uri() if params.tracking.enabled else None)
            if weights is not None:
                summary["best"]["weights"] = weights.as_posix()  # relative to the project
            _record(study, summary, study_dir, parent_id, params)
        logger.info("sweep %s: %s", cfg.name, summary["line"])
        if apply:  # a thread count fixed for native trials goes with their values
            _apply(params_file, summary, cfg.name, None if params is loaded else params.determinism.num_threads)
    return summary


def _trial_threads(params: Params, logger: Any) -> Params:
    """In native mode the thread count changes the weights, so every trial gets the same one, said
    once; in portable mode each worker takes its share of the cores (`_task_runner`)."""
    if params.determinism.num_threads != "auto" or cpu_mode.current() != "native":
        return params
    threads = resolve("auto", params.sweep.workers)
    logger.info(
        "determinism.cpu is native here, where the thread count changes the weights: every trial trains "
        "with %d thread(s) (determinism.num_threads: %d reproduces one)",
        threads,
        threads,
    )
    return params.model_copy(update={"determinism": params.determinism.model_copy(update={"num_threads": threads})})


def _dask_client() -> Any:
    """The task runner's Dask client, which starts (or connects to) the cluster on first use: called
    before the data stages, so that new workers load torch meanwhile (`flows.sweep_worker.dask_setup`)."""
    context = FlowRunContext.get()
    assert context is not None, "called outside the flow"
    return context.task_runner.client


def _record(study: Any, summary: dict[str, Any], study_dir: Path, parent_id: str | None, params: Params) -> None:
    """The study on disk (artifacts/sweep/<name>/study/) and on the sweep's MLflow run."""
    written = write_study(study, summary, study_dir / "study")
    if parent_id is not None:
        _record_in_mlflow(parent_id, summary, written, params)


def _record_in_mlflow(run_id: str, summary: dict[str, Any], files: list[Path], params: Params) -> None:
    # heavy: mlflow (~4 s), only when the study is recorded on a run
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri())
    # A trial whose worker died was run again elsewhere; the dead attempt's run is marked KILLED now.
    mark_orphans_or_warn(client, [client.get_run(run_id).info.experiment_id], f"sweep {summary['study']}")
    flat = {f"sweep.{k}": v for k, v in params.sweep.model_dump(exclude={"space", "applied"}).items()}
    flat["sweep.space"] = json.dumps(params.sweep.model_dump(mode="json")["space"], sort_keys=True)[:6000]
    for key, value in redact_mapping(flat).items():
        client.log_param(run_id, key, value)
    tags = {"lockstep.summary": summary["line"], "sweep.study": summary["study"]}
    best = summary["best"]
    if best is not None:
        tags.update({"sweep.best_trial": best["trial"], "sweep.best_run_id": best["run_id"] or ""})
        client.log_metric(run_id, f"best_{params.sweep.metric}", best["value"])
    for key, value in tags.items():
        client.set_tag(run_id, key, str(value))
    for state, count in summary["states"].items():
        client.log_metric(run_id, f"trials_{state}", count)
    client.log_metric(run_id, "sweep_seconds", summary["seconds"])
    for path in files:
        client.log_artifact(run_id, str(path), "sweep")


def _apply(params_file: str, summary: dict[str, Any], study: str, threads: int | str | None = None) -> None:
    """The best trial's values and seed into params.yaml, with `sweep.applied` naming the trial: the
    pipeline's next train run then rebuilds that trial's weights, and DVC records where they came from."""
    best = summary["best"]
    if best is None:
        raise ConfigError(f"sweep {study}: no complete trial to apply")
    overrides: dict[str, Any] = dict(best["params"])
    overrides["train.seed"] = best["seed"]
    if threads is not None:
        overrides["determinism.num_threads"] = threads
    overrides["sweep.applied"] = {"study": study, "trial": best["trial"], "run_id": best["run_id"]}
    set_params(params_file, overrides)
    print(f"params.yaml: {', '.join(f'{k}={v}' for k, v in overrides.items() if k != 'sweep.applied')}")


# --------------------------------------------------------------------------- entry points


def _task_runner(params: Params, address: str | None, tls: Path | None) -> Any:
    # after bootstrap: prefect_dask loads numpy and distributed (~4 s)
    from prefect_dask import DaskTaskRunner

    if address:
        return DaskTaskRunner(address=address, client_kwargs={"security": security(tls)} if tls else None)
    _keep_malloc_defaults()
    # worker processes, one trial at a time each (one Dask thread) with its share of the cores
    # (`determinism.num_threads: auto`), on loopback with Dask's temporary TLS credentials (in memory:
    # another local user cannot join); the dashboard on a free loopback port
    workers = local_workers(params.sweep.workers)
    cluster = {"n_workers": workers, "threads_per_worker": 1, "processes": True, "preload": [PRELOAD]}
    cluster["env"] = shared_env(workers)
    return DaskTaskRunner(cluster_kwargs={**cluster, "security": True, "dashboard_address": "127.0.0.1:0"})


def local_workers(requested: int) -> int:
    """The local cluster's worker processes: `sweep.workers`, at most one a core this process is given.

    A trial's training keeps its core busy, so workers beyond the cores only share them, and each one
    pays its own start-up (it preloads torch, MLflow and the stages). Measured on 2 cores (Intel Xeon,
    8 trials in batches of 4, 2026-12-04): 4 workers ran the trials no faster than 1 (31.9-33.7 s
    against 33.3-33.5 s) and the whole sweep 1.2x slower (62-65 s against 52 s); 2 workers took 24-25 s.
    The study's results do not change: `sweep.batch` decides them, and a trial trains with one thread
    either way (`_trial_threads`).
    """
    cores = cores_given()
    if requested <= cores:
        return requested
    log.warning(
        "sweep.workers is %d, and this machine gives %d core(s): starting %d local workers, one a core "
        "(more would share the cores and only add their start-up; the results are the same)",
        requested,
        cores,
        cores,
    )
    return cores


def _keep_malloc_defaults() -> None:
    """Dask's nanny starts each worker with MALLOC_TRIM_THRESHOLD_=65536, to hand freed memory back to
    the OS. Setting it at all also fixes glibc's mmap threshold, so a training's large tensors are
    mapped and unmapped at every allocation: a digits trial took twice as long (10.5 s, not 5.2 s)."""
    # heavy: dask (~0.5 s), only before a local cluster starts
    import dask

    dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    prefect_settings.configure()  # Prefect loaded with this module: it reads its settings again
    if argv[:1] in (["worker"], ["scheduler"]):
        return exit_code(lambda: _dask(argv[0], argv[1:]))
    if argv[:1] == ["tls"]:
        return exit_code(lambda: _tls(argv[1:]))
    parser = argparse.ArgumentParser(
        prog="python -m flows.sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", default=PARAMS_FILE, help="params file (default: %(default)s)")
    parser.add_argument("--apply", action="store_true", help="write the best trial's params into params.yaml")
    parser.add_argument("--address", help=f"Dask scheduler (default: sweep.address, env {ADDRESS_ENV})")
    parser.add_argument("--tls", metavar="DIR", help="the cluster's TLS credentials, for a tls:// scheduler")
    parser.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[])
    args = parser.parse_args(argv)
    return exit_code(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    overrides = dict(_override(text) for text in args.overrides)
    # fail fast, before a server starts; the local cluster's workers inherit the pinned environment
    params = bootstrap(ROOT / args.params, overrides)
    address = args.address or params.sweep.address or os.environ.get(ADDRESS_ENV)
    tls = tls_dir(args.tls)
    if address:
        check_scheduler_address(address, tls, "sweep.address")
        _check_tracking_reaches(address, params)
    check_store(params.tracking)
    check_storage(os.environ.get(STORAGE_ENV) or params.sweep.storage)
    # Not the project's long-lived server where the trials run on other machines: prefect-dask hands each
    # trial the run's Prefect settings, auth string included (a string made for this run alone is sent there)
    api = prefect_env.local_api(find_project_server=not address)
    with api as own_server:  # the flow writes `overrides` into params.yaml once it holds the lock
        runner = _task_runner(params, address, tls)
        state = sweep.with_options(task_runner=runner)(args.params, args.apply, overrides or None, return_state=True)
        if own_server:  # what its tasks began is recorded before the server stops with this process
            wait_recorded(state.state_details.flow_run_id, task_runs=0)
        summary = state.result()  # raises what the flow raised
    print(summary["line"])
    return 0


def _check_tracking_reaches(address: str, params: Params) -> None:
    """Trials log where the coordinator does (SweepContext.tracking_uri): a store that is a file on this
    machine (sqlite, the project's own by default) is no place that another machine's workers reach."""
    uri = tracking_uri()
    if (
        params.tracking.enabled
        and uri.startswith(("sqlite:", "file:"))
        and not cluster.is_loopback(cluster.split_address(address)[1])
    ):
        raise ConfigError(
            f"sweep.address {address}: its workers are on other machines, and the trials would log to {uri}, "
            "a file on this one: set MLFLOW_TRACKING_URI to a tracking server they all reach (docs/sweeps.md), "
            "or tracking.enabled: false"
        )


def _dask(role: str, argv: list[str]) -> int:
    """`dask scheduler` / `dask worker` for trials, able to import this project (the scheduler unpickles
    the trial tasks too), on loopback unless given --host and --tls (tasks/tools/sweep/cluster.py). A
    worker runs in the project directory, one trial (thread) at a time per process, with params.yaml's
    CPU mode pinned before anything loads torch; other arguments go to dask."""
    parser = argparse.ArgumentParser(prog=f"python -m flows.sweep {role}", allow_abbrev=False)
    if role == "worker":
        parser.add_argument("scheduler", help="the Dask scheduler's address, tcp://127.0.0.1:port or tls://host:port")
        parser.add_argument("--params", default=PARAMS_FILE)
    parser.add_argument("--host", help="the address to listen on (default 127.0.0.1; off loopback needs --tls)")
    parser.add_argument("--dashboard-address", help="loopback only (default: scheduler 127.0.0.1:8787, worker none)")
    parser.add_argument("--tls", metavar="DIR", help=f"the cluster's credentials (env {cluster.TLS_ENV})")
    args, rest = parser.parse_known_args(argv)
    tls = cluster.tls_dir(args.tls)
    scheduler = args.scheduler if role == "worker" else None
    options = cluster.dask_arguments(role, args.host, args.dashboard_address, tls, rest, scheduler)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if tls is not None:  # no plain-TCP listener or connection anywhere in this process tree
        os.environ["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] = "True"
    if role == "scheduler":
        # heavy: distributed (~1.3 s, loads numpy), only for `dask scheduler`
        from distributed.cli.dask_scheduler import main as dask_main
    else:
        bootstrap(ROOT / args.params)  # before distributed loads numpy
        # distributed loads numpy: after the bootstrap above
        from distributed.cli.dask_worker import main as dask_main

        os.chdir(ROOT)
        _keep_malloc_defaults()  # in this process: its nanny starts the worker processes
        os.environ.update(shared_env(_worker_count(rest)))  # `--nworkers N` share this machine's cores
        options = [args.scheduler, "--nthreads", "1", "--preload", PRELOAD, *options]
    dask_main(args=options, prog_name=f"dask {role}")  # click: exits itself
    return 0


def _worker_count(options: list[str]) -> int:
    """The worker processes `dask worker` will start (`--nworkers N`, or 1)."""
    for i, option in enumerate(options):
        value = option.split("=", 1)[1] if option.startswith("--nworkers=") else None
        if option == "--nworkers" and i + 1 < len(options):
            value = options[i + 1]
        if value is not None:
            return int(value) if value.isdigit() and int(value) > 0 else 1
    return 1


def _tls(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.sweep tls", description="write a cluster's TLS credentials")
    parser.add_argument("directory", help="a new directory (0700): copy it to every machine of the cluster")
    made = write_credentials(Path(parser.parse_args(argv).directory))
    print(f"{made}: Dask TLS credentials; give --tls {made} to the scheduler, each worker and the coordinator")
    return 0


if __name__ == "__main__":
    sys.exit(main())
