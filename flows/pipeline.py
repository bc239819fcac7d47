"""The pipeline as a Prefect flow: one task per stage, DVC deciding what is stale.

DVC owns caching. For each stage in order, the task asks DVC whether the stage is stale
(`Repo.status`); if it is, it runs the stage function in this process (torch and MLflow are
imported once, not once per stage) and records the result with `Repo.commit`, which writes the
same dvc.lock entry `dvc repro` would. So a stage reproduced by one entry point is not redone by
the other, and both give the same weights.

    python -m flows.pipeline            # what `make run` does (Prefect's ephemeral mode, no server)
    python -m flows.pipeline --force    # re-run every stage
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from tasks.layout import ROOT

# Before Prefect is imported: analytics off (else sqlite "database is locked" tracebacks), a
# longer ephemeral-server start (a cold start takes ~17 s on 2 cores; the default is 20 s), and
# Prefect's state inside the project unless the user points PREFECT_HOME/PREFECT_API_URL elsewhere.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_HOME", str(ROOT / ".prefect"))

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402

from tasks.config import PARAMS_FILE, STAGES, ConfigError, Params, load_params  # noqa: E402
from tasks.data_format import DataError  # noqa: E402


def _is_stale(stage: str) -> bool:
    from dvc.repo import Repo

    with Repo(str(ROOT)) as repo:
        return bool(repo.status(targets=[stage]))


def _commit(stage: str) -> None:
    from dvc.repo import Repo

    with Repo(str(ROOT)) as repo:
        repo.commit(stage, force=True)


def _run_if_stale(stage: str, params: Params, force: bool) -> dict[str, Any]:
    from tasks.stages import run_stage

    logger = get_run_logger()
    if not force and not _is_stale(stage):
        logger.info("%s: up to date (dvc.lock), skipped", stage)
        return {"ran": False}
    metrics = run_stage(stage, params)
    _commit(stage)
    logger.info("%s: %s", stage, metrics)
    return {"ran": True, **metrics}


# One Prefect task per stage, named after it. Prefect's own result cache is off on purpose: DVC is
# the one cache, shared with `dvc repro`.
STAGE_TASKS = {
    name: task(_run_if_stale, name=name, task_run_name=name, cache_policy=NO_CACHE, retries=0)
    for name in STAGES
}


@flow(name="lockstep-pipeline", log_prints=True)
def pipeline(params_file: str = PARAMS_FILE, force: bool = False) -> dict[str, dict[str, Any]]:
    """Run download -> stats -> preprocess -> train -> evaluate -> compress -> export, skipping what DVC
    finds up to date."""
    from tasks.tracking import pipeline_run

    os.chdir(ROOT)
    params = load_params(params_file)  # validated before anything is written
    results: dict[str, dict[str, Any]] = {}
    with pipeline_run(params.tracking, entry_point="prefect"):
        for name in STAGES:
            results[name] = STAGE_TASKS[name](name, params, force)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--params", default=PARAMS_FILE, help="params file (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="re-run every stage, stale or not")
    args = parser.parse_args(argv)
    try:
        load_params(ROOT / args.params)  # fail fast, exit 2, before Prefect starts a server
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        results = pipeline(params_file=args.params, force=args.force)
    except DataError as exc:  # bad data or a failed download: one line naming the file or URL
        print(f"error: {exc}", file=sys.stderr)
        return 1
    ran = [name for name, result in results.items() if result["ran"]]
    print(f"stages run: {', '.join(ran) or 'none (everything up to date)'}")
    if "test_accuracy" in results["evaluate"]:
        print(f"test accuracy: {results['evaluate']['test_accuracy']:.4f}")
    if "test_accuracy" in results["export"]:
        print(f"shipped: artifacts/export/model.onnx, test accuracy {results['export']['test_accuracy']:.4f} "
              "(model card: artifacts/export/model_card.md)")
    print("browse the runs: make ui   (MLflow UI on http://127.0.0.1:5000)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
