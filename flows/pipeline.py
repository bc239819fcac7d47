"""The pipeline's command line: `make run`, `python -m flows.pipeline`.

The pipeline itself is a Prefect flow, one task per stage, DVC deciding what is stale
(flows/pipeline_flow.py). A run with nothing stale is settled before Prefect is imported
(flows/noop.py): DVC says so, MLflow records the run, in ~2 s instead of ~17 s. Everything else runs
the flow, against PREFECT_API_URL if set, else a server of its own (flows/prefect_env.py).

A run holds the project's pipeline lock (tasks/core/lock.py) from start to end: an
overlapping run, from any entry point, waits for it or is refused.

    python -m flows.pipeline                 # what `make run` does (Prefect's local mode, no server)
    python -m flows.pipeline --force         # re-run every stage
    python -m flows.pipeline --reingest      # re-read the source first, as scheduled runs do
    python -m flows.pipeline --set train.lr=0.01   # written into params.yaml first, like `dvc exp run -S`

As a service: flows/deployments.py (`make schedule`, and work pools), which loads the flow as
`flows/pipeline.py:pipeline`: the names of flows/pipeline_flow.py are reachable from here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext
from typing import Any

from flows import noop, prefect_env, prefect_settings
from flows.local_records import wait_recorded
from flows.prefect_env import ALLOW_OVERRIDES_ENV, allowed_overrides
from flows.run_params import params_file_changes
from flows.summary import REREAD_UNCHANGED, reread_unchanged
from tasks.core.cli import exit_code
from tasks.core.config.params import STAGES, Params
from tasks.core.config.yaml_io import PARAMS_FILE, load_yaml
from tasks.core.layout import ROOT
from tasks.core.redact import redact
from tasks.determinism.bootstrap import bootstrap
from tasks.tracking import registrar, sqlite_record
from tasks.tracking.dashboard import headline, runs_page
from tasks.tracking.store import check_store, tracking_uri


def __getattr__(name: str) -> Any:
    """The flow's names (`pipeline`, `STAGE_TASKS`, `FLOW_NAME`...), imported with Prefect on first use:
    deployments load `flows/pipeline.py:pipeline`, and a no-op run never needs them."""
    if name.startswith("__"):
        raise AttributeError(name)
    # Prefect loads with the flow, on first use: a no-op run never needs it (flows/noop.py)
    from flows import pipeline_flow

    try:
        return getattr(pipeline_flow, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def _warm_imports() -> None:
    # What the flow's stages need, loaded in a thread while the server starts (prefect_env.local_api): DVC
    # for the first, torch for every stage from train on (~2 s), in a run that will train (B2's flow side,
    # 2026-12-05: 29.8 -> 28.6 s, median of 6; same bytes); MLflow only where no helper registers export's
    # models (tasks/tracking/registrar.py). `_run` prepared the process for it (`bootstrap`: before torch
    # loads); what a run records does not depend on what is loaded when (tasks/tracking/lineage.py).
    import dvc.repo  # noqa: F401

    import tasks.determinism.pinning  # noqa: F401

    if not registrar.helped():
        import mlflow  # noqa: F401


def _run_with_local_api(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    # The flow runs here when a stage is stale or a re-read source changed (flows/noop.py): to train, mostly.
    with prefect_env.local_api(while_starting=_warm_imports) as own_server:
        # Prefect loads with the flow, on first use (a no-op run never needs it: flows/noop.py), and once
        # the server is starting: what local_api has not loaded yet of it is ~0.2 s
        from flows.pipeline_flow import pipeline

        state = pipeline(
            params_file=args.params,
            force=args.force,
            reingest=args.reingest,
            overrides=dict(args.overrides) or None,
            return_state=True,
        )
        if own_server:  # recorded before the server stops with this process; a completed run ran a task per stage
            wait_recorded(state.state_details.flow_run_id, task_runs=len(STAGES) if state.is_completed() else 0)
        return state.result()  # raises what the flow raised


def _override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. train.lr=0.01), got {text!r}")
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
    prefect_settings.configure()  # before Prefect loads
    return exit_code(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    params = bootstrap(ROOT / args.params, dict(args.overrides))  # fail fast, before a server starts
    # the user at this prompt may change any key, with --set or --params: only API-started runs are restricted
    typed = [key for key, _ in args.overrides] + params_file_changes(args.params)
    os.environ[ALLOW_OVERRIDES_ENV] = ",".join([*allowed_overrides(), *typed])
    check_store(params.tracking)  # a tracking server that is down fails the run now, not after training
    started = time.monotonic()
    results = None
    eligible = noop.eligible(args.force, args.overrides)
    if eligible:
        settled = noop.record_if_nothing_stale(params, args.reingest)
        if settled is not None:
            results, summary = settled
            print(f"up to date (dvc.lock), skipped: {', '.join(results)}\n{summary}")
    if results is None:
        # Stages will run (forced, new values, or found stale): export's MLflow client loads in a helper while
        # this process loads Prefect and torch (registrar.py). Otherwise (a Prefect server's run, which asks
        # DVC inside the flow) the flow starts one once it finds a stage stale.
        will_run = args.force or bool(args.overrides) or eligible
        with registrar.helping(params.tracking) if will_run else nullcontext():
            results = _run_with_local_api(args)
    print("\n".join(closing_summary(results, time.monotonic() - started, params)))
    return 0


def closing_summary(results: dict[str, dict[str, Any]], seconds: float, params: Params) -> list[str]:
    """What a person reads at the end of a run: what ran, how good the model is, what shipped, where."""
    ran = [name for name, result in results.items() if result["ran"]]
    none = f"none; {REREAD_UNCHANGED}" if reread_unchanged(results) else "none (everything up to date)"
    lines = [f"done in {seconds:.0f} s; stages run: {', '.join(ran) or none}"]
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
    uri = tracking_uri()
    # read from the sqlite file where it can be: MLflow's client costs ~3 s to start (sqlite_record.py)
    experiment_id = sqlite_record.experiment_id(uri, params.tracking.experiment)
    if experiment_id is None:
        from mlflow import MlflowClient  # ~3 s to load: only where the sqlite file cannot be read

        experiment_id = MlflowClient(uri).get_experiment_by_name(params.tracking.experiment).experiment_id
    served = uri.startswith(("http://", "https://"))
    page = runs_page(redact(uri).rstrip("/") if served else "http://127.0.0.1:5000", experiment_id)
    return page if served else f"make ui, then {page}"


if __name__ == "__main__":
    sys.exit(main())
