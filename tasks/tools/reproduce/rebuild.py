"""The rebuild, start to end: `reproduce(run_id)` reads the run's record, prepares the workspace,
runs stats -> preprocess -> train there as `python -m tasks <stage>` processes, and compares.

download is not re-run: the data comes from DVC by hash, the source may have changed since. The
project is left as it was, except for data a remote fetch adds to the DVC cache and the MLflow run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from tasks.core import layout
from tasks.core.config.base import shown
from tasks.core.config.params import Params
from tasks.core.credentials import AUTH_ENV, TOKEN_ENV
from tasks.core.hashing import data_md5
from tasks.core.lock import LOCK_URL_ENV
from tasks.core.redact import SECRET_NAME
from tasks.determinism import cpu_mode
from tasks.tools.reproduce import record as records
from tasks.tools.reproduce import report as reports
from tasks.tools.reproduce import weights as pretrained
from tasks.tools.reproduce import workspace as workspaces
from tasks.tools.reproduce.record import LOGGED_DIR
from tasks.tools.reproduce.report import ReproduceReport
from tasks.tracking import runs, store

log = logging.getLogger("tasks.tools.reproduce")  # not __name__: the CLI configures the package's logger

STAGES = ("stats", "preprocess", "train")
TAIL_LINES = 25
# Every HTTP(S) request the rebuilt stages make goes here: a closed port on loopback. They need none (the
# data comes from DVC, the weights from the workspace's cache: weights.py), and whatever a run's commit
# would fetch because its record said so (torch.hub, an old downloader) reaches no host the record named.
NO_ROUTE = "http://127.0.0.1:9"
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
# Run in the workspace, by its code and with the stages' environment: what the rebuilt train saw.
# The pinning values come from the record as validated here (argv), not through the workspace's
# params reader, whose module has moved between commits (tasks/core/config.py, then a package). It
# starts as every entry point does (tasks/determinism/bootstrap.py `start`); a commit from before
# `start` pinned with the two functions it is made of, and one from before `lineage_tags(torch=...)`
# read torch's versions from what it had loaded.
_PROBE = """
import json, sys
pinned = json.loads(sys.argv[1])
seed, threads, strict, cpu = (pinned[key] for key in ("seed", "num_threads", "strict", "cpu"))
try:
    from tasks.determinism.bootstrap import start
except ImportError:
    from tasks.determinism.cpu_mode import pin_env
    pin_env(cpu)  # before torch and numpy load
    from tasks.determinism.pinning import pin_everything
    settings = pin_everything(seed, threads, strict, cpu)
else:
    settings = start(seed, threads, strict=strict, cpu=cpu)
from tasks.determinism.fingerprint import fingerprint
from tasks.tracking.lineage import lineage_tags
try:
    lineage = lineage_tags(torch=True)
except TypeError:  # a commit from before the flag: it read torch's versions from sys.modules
    lineage = lineage_tags()
tags = {k: v for k, v in lineage.items() if k.startswith("version.")}
print(json.dumps({**tags, **{f"determinism.{k}": str(v) for k, v in settings.items()}, **fingerprint()}))
"""


# Addresses that may carry a login (a database URL's password): the sweep's study (flows/sweep.py
# STORAGE_ENV), the pipeline lock's database, the tracking server, a libpq password file
CREDENTIAL_ADDRESSES = {"LOCKSTEP_SWEEP_STORAGE", LOCK_URL_ENV, "MLFLOW_TRACKING_URI", "PGPASSFILE"}


def _stage_env() -> dict[str, str]:
    # The rebuild must not nest under, or log into, a run of whatever launched us; and it computes
    # in the mode the run's params name (each stage pins it), not in ours. It holds no credentials
    # (no download token, an empty netrc, nothing named like a secret: cloud keys, PGPASSWORD, MLflow's
    # and Prefect's tokens, nor an address that may hold a login; tracking is off in the workspace)
    # and no route out (NO_ROUTE): a record chose its hosts.
    dropped = {runs.PARENT_ENV, "MLFLOW_RUN_ID", TOKEN_ENV, AUTH_ENV, "no_proxy", "NO_PROXY", *CREDENTIAL_ADDRESSES}
    env = {k: v for k, v in os.environ.items() if k not in dropped and not SECRET_NAME.search(k)}
    env.update({name: NO_ROUTE for name in _PROXY_VARS}, NETRC=os.devnull)
    return cpu_mode.clean_env(env)


def _run_stage(stage: str, workspace: Path, env: dict[str, str]) -> tuple[int, list[str]]:
    """`python -m tasks <stage>` in the workspace, its output passed on to our log; (exit code, output tail)."""
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    with subprocess.Popen(
        [sys.executable, "-m", "tasks", stage],
        cwd=workspace,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            log.info("  %s | %s", stage, tail[-1])
    return proc.returncode, list(tail)


def _run_stages(workspace: Path, report: ReproduceReport, env: dict[str, str]) -> None:
    for stage in STAGES:
        log.info("reproduce: running %s", stage)
        start = time.monotonic()
        code, tail = _run_stage(stage, workspace, env)
        report.stage_seconds[stage] = round(time.monotonic() - start, 2)
        if code != 0:
            report.failed_stage, report.failure_tail = stage, [f"(exit {code})", *tail]
            return


def _machine_now(workspace: Path, env: dict[str, str], params: Params, warnings: list[str]) -> dict[str, str]:
    """The rebuild's library versions, device and determinism settings, named like the run's tags."""
    determinism = params.determinism
    pinned = {"seed": params.train_seed, "num_threads": determinism.num_threads, "strict": determinism.strict}
    pinned["cpu"] = determinism.cpu
    command = [sys.executable, "-c", _PROBE, json.dumps(pinned)]
    probe = subprocess.run(command, cwd=workspace, env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        warnings.append(f"could not read this machine's versions and determinism settings: {last}")
        return {}
    now = json.loads(probe.stdout.strip().splitlines()[-1])
    train_json = workspace / layout.TRAIN_DIR / "train.json"
    if train_json.exists():
        now["device"] = str(json.loads(train_json.read_text()).get("device"))
    return now


def reproduce(
    run_id: str,
    workdir: Path | None = None,
    *,
    keep: bool = False,
    tracking_uri: str | None = None,
    project: Path | None = None,
    log_run: bool = True,
    trust_commit: str | None = None,
    use_current_code: bool = False,
) -> ReproduceReport:
    """Rebuild train run `run_id` (or a pipeline run's one train stage) and compare its weights.

    `workdir` (kept afterwards) holds `record/` (what the run logged) and `workspace/` (the rebuild);
    by default a temporary directory, removed at the end unless `keep`. Raises ReproduceError when
    the run cannot be reproduced, or its record is refused (record.py): before anything is checked
    out or run. `trust_commit` names a commit to rebuild although no local branch or tag holds it;
    `use_current_code` rebuilds with the current tasks/ when the run's commit is not here.
    """
    client = records.tracking_client(tracking_uri or store.tracking_uri())
    project = (project or layout.project_root()).resolve()
    run = records.find_train_run(client, run_id)
    root = workspaces.make_workdir(workdir)
    log.info("reproduce %s: working in %s", run_id, root)
    try:
        train_id = run.info.run_id
        record = records.download_record(client, run, root / "record")
        params, raw_params = records.check_params(record, train_id)
        records.check_record_paths(record, train_id)
        weights = pretrained.plan(params.train, run, layout.download_cache(project))
        commit = workspaces.code_source(project, run, trust_commit, use_current_code)
        workspace = root / "workspace"
        workspace.mkdir()
        report = ReproduceReport(
            requested_run_id=run_id,
            run_id=train_id,
            experiment_id=run.info.experiment_id,
            code="",
            data_md5=data_md5(record / LOGGED_DIR / "data.dvc"),
        )
        report.code = workspaces.checkout_code(project, run, commit, workspace, report.warnings)
        workspaces.write_inputs(record, workspace, raw_params)
        if weights is not None:
            pretrained.place(weights, workspace)
        # shown(): record.py checked the md5, but the record is a stranger's and this reaches a terminal
        log.info("reproduce %s: data %s, code from %s", train_id, shown(report.data_md5), report.code)
        report.data_from = workspaces.bring_data(project, workspace, train_id, report.data_md5)
        _rebuild_and_compare(run, params, record, workspace, report)
        if workdir is not None or keep:
            report.workspace = str(workspace)
        if log_run:
            reports.log_outcome(client, report, root)
        return report
    finally:
        if workdir is None and not keep:
            shutil.rmtree(root, ignore_errors=True)


def _rebuild_and_compare(run: Any, params: Params, record: Path, workspace: Path, report: ReproduceReport) -> None:
    """The stages in the prepared workspace; then, if they all ran, the comparisons and their explanation."""
    env = _stage_env()
    env["LOCKSTEP_DOWNLOAD_CACHE"] = str(workspace / pretrained.WORKSPACE_CACHE)  # not the user's: the copy's
    _run_stages(workspace, report, env)
    if report.failed_stage is not None:
        return
    report.weights = reports.compare_weights(record, workspace)
    report.upstream = reports.compare_upstream(workspace, report.data_md5, report.warnings)
    report.machine_now = _machine_now(workspace, env, params, report.warnings)
    report.machine_differences = reports.machine_differences(run.data.tags, report.machine_now)
    reports.explain_difference(report, run, workspace)
