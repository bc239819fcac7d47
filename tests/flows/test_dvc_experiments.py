"""DVC's experiments, as their users run them: `dvc exp run --queue` twice, then `dvc queue start -j 2`.
Both experiments run at once and finish (the weak one too: its int8 copy fails the export gates and fp32
ships instead), show their metrics in `dvc exp show`, and land in the project's MLflow store, which the
two create and write at the same time without "database is locked". `dvc plots diff` then draws the
baseline and an experiment side by side, offline, in headless Chromium. (One queue run serves every
test here: each experiment is four stage processes. A third experiment waiting for a free queue worker
would test DVC's scheduling, not ours: left out.)

Where its CPU goes (measured 2026-12-02, 2 cores shared with other work): each experiment's four stage
processes took ~34 CPU-s, nearly all of it each process's start (torch, MLflow and its SQLite store, the
ONNX exporter) and MLflow's model logging, little of it training: six epochs instead of one cost ~1.3 of
those seconds. DVC's `exp exec-run` behind each experiment took ~5, each `dvc` command the test runs ~1. So
the queued config drops what no test here reads (the pt2 copy), and the test runs no `dvc` process it can
do without.

The store's part alone, without DVC, is the fast test: two processes opening a new store at once."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from tests.conftest import ROOT, client_for, clone_project, commit_all, run, subprocess_env, write_params
from tests.support.plots_page import SCREENSHOTS, classes, every_plot_drawn, open_page

WEAK, LEARNT = "weak", "normal"
# name -> train.lr; the weak one barely moves from its initialisation (test accuracy ~0.1). None is
# the baseline's 0.05: DVC would skip that one's train and evaluate as unchanged.
EXPERIMENTS = {WEAK: 1e-5, LEARNT: 0.1}
# Hang guards, not timings: two took ~2.5 min on 2 cores beside one other job, but in the full tier
# (three test workers on 2 cores) the module's set-up, the session's project included, took ~13 min.
QUEUE_TIMEOUT_S = 900
# Each `dvc queue status` is a process that imports DVC (about a second of CPU, taken from the
# experiments it waits for). The wait asks git instead (milliseconds): an experiment that ran to its end
# leaves its ref under refs/exps/; `dvc queue status` is asked once both refs are there (again every
# REASK_S while it still shows one running), and every STATUS_EVERY_S meanwhile, for an experiment that
# failed (it leaves no ref). That interval only delays a failing run's report: at 60 s, a passing run
# under the full tier's load (the queue a few minutes long) paid for several status processes.
POLL_S = 2
REASK_S = 5
STATUS_EVERY_S = 180
# The queued runs' own config on top of TINY:
# - confidence 0 and agreement 1.0: the agreement gate counts every test image, and one the int8 copy
#   answers otherwise than fp32 fails it. With the default confidence 0.5 a model that never trained has
#   no confident image at all, so its int8 copy passes vacuously and nothing falls back. The weak model's
#   logits are nearly equal, so int8's rounding turns some answers: 2 of 271 with float logits (7 when the
#   logits were rounded to 8 bits too, with ties; 2026-12-07). The learnt one's copy turned 4 and falls
#   back too; nothing here reads its export.
# - one compressed variant: the export candidates need static_int8 alone (saves ~4 s per experiment).
# - ONNX alone among the export formats: nothing here reads the pt2 copy, and torch.export's tracing cost
#   the export stage ~2.7 of its ~8 CPU-s per experiment (measured 2026-12-02).
# (TINY's six epochs stay: with fewer, the weak model's int8 copy agreed with fp32 often enough to pass
# the gates and nothing fell back: 0.996 after one epoch (measured 2026-12-02), as after two before; and
# the five epochs cost ~1.3 CPU-s per experiment, against the ~8 each of its four stage processes takes.)
QUEUED_CONFIG = {
    "export": {
        "confidence": 0.0,
        "min_top1_agreement": 1.0,
        "candidates": ["static_int8", "fp32"],
        "formats": ["onnx"],
    },
    "compress": {"variants": ["static_int8"]},
}
UNFINISHED = ("Queued", "Running")
pytestmark = pytest.mark.timeout(1800)  # the set-up above, in the full tier's load


@dataclass(frozen=True)
class Queued:
    """What the queue left: the project, the states `dvc queue status` showed before the start and at
    the end, each experiment's `dvc queue logs`, and what `dvc exp show --json` then listed."""

    repo: Path
    before_start: dict[str, str]
    states: dict[str, str]
    logs: dict[str, str]
    shown: list[dict[str, Any]]


@pytest.fixture(scope="module")
def queued(dvc_repo: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Queued]:
    """The session's reproduced project, committed as the experiments' baseline without an MLflow store,
    and the two experiments queued, run two at a time, and waited for.

    No store: like a fresh clone that pulled its outputs from a DVC remote, so the first two experiments
    create it at the same time. Queue workers are killed once the queue is done and read (idle, they would
    poll their broker for another minute while the tests run), and at the end whatever happened, with
    `dvc queue stop --kill` first (a process of its own) only where experiments may still be running.
    """
    repo = clone_project(dvc_repo["repo"], tmp_path_factory.mktemp("experiments") / "repo")
    write_params(repo / "params.yaml", QUEUED_CONFIG, base=repo / "params.yaml")
    (repo / "mlflow.db").unlink()
    shutil.rmtree(repo / "mlartifacts")
    commit_all(repo, "baseline: dvc.lock of the reproduced pipeline")
    done = False
    try:
        for name, lr in EXPERIMENTS.items():
            run(["dvc", "exp", "run", "--queue", "-n", name, "-S", f"train.lr={lr}"], repo)
        before_start = queue_states(repo)
        start_queue(repo, repo.parent / "queue-start.log")
        states = wait_for_queue(repo)
        done = True
        logs = {name: run(["dvc", "queue", "logs", name], repo).stdout for name in EXPERIMENTS}
        shown = json.loads(run(["dvc", "exp", "show", "--json"], repo).stdout)
        kill_workers(repo)
        yield Queued(repo, before_start, states, logs, shown)
    finally:
        if not done:
            run(["dvc", "queue", "stop", "--kill"], repo, check=False)
        kill_workers(repo)


def start_queue(repo: Path, log: Path) -> None:
    """`dvc queue start -j 2` with its output in `log`, not a pipe: the workers it forks inherit its
    stdout and stderr, so reading a pipe to its end waits for the last worker to exit, which is a
    minute after the queue empties (on a busy machine that wait outlasted the test's timeout)."""
    with log.open("wb") as out:
        started = subprocess.run(
            ["dvc", "queue", "start", "-j", "2"], cwd=repo, env=subprocess_env(), stdout=out, stderr=out, timeout=120
        )
    assert started.returncode == 0, f"dvc queue start exited {started.returncode}:\n{log.read_text()}"


def worker_files(repo: Path, suffix: str) -> list[Path]:
    """What DVC keeps of each queue worker: `json` (its PID) or `out` (its log)."""
    return sorted((repo / ".dvc" / "tmp" / "exps" / "celery").glob(f"dvc-exp-worker-*.{suffix}"))


def kill_workers(repo: Path) -> None:
    """Kill what is left of the queue's workers, each with its process group (the worker and the
    experiment it runs), by the PIDs DVC recorded: a worker must not outlive its test and take the
    cores from the tests after it."""
    for info in worker_files(repo, "json"):
        pid = json.loads(info.read_text())["pid"]
        try:
            worker = psutil.Process(pid)
            group = os.getpgid(pid)
            # not a later process that reused the PID, and never our own group
            if "queue-worker" in " ".join(worker.cmdline()) and group != os.getpgrp():
                os.killpg(group, signal.SIGKILL)
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass  # exited already


# `dvc queue status` prints the tasks' table, then asks the workers what they run through kombu's
# filesystem broker, whose reader can open a reply file its writer has created but not yet written
# (kombu/transport/filesystem.py: `_put` opens, then locks and writes; `_get` reads without the lock).
# The command then fails with this JSON error after a complete table. Only that error is retried.
KOMBU_EMPTY_REPLY = "unexpected error - Expecting value: line 1 column 1 (char 0)"
STATUS_TRIES = 3


def queue_states(repo: Path) -> dict[str, str]:
    """Experiment name -> its task's status, from `dvc queue status`'s table."""
    for _ in range(STATUS_TRIES):
        done = run(["dvc", "queue", "status"], repo, check=False)
        if done.returncode == 0 or KOMBU_EMPTY_REPLY not in done.stderr:
            break
    if done.returncode != 0:
        raise AssertionError(f"dvc queue status exited {done.returncode}\n{done.stdout}\n{done.stderr}")
    table = done.stdout
    states = {}
    for line in table.splitlines():
        words = line.split()
        if len(words) >= 3 and words[1] in EXPERIMENTS:
            states[words[1]] = words[-1]
    return states


def experiment_refs(repo: Path) -> set[str]:
    """The names of the experiments that ran to their end: their refs, refs/exps/<baseline>/<name>."""
    listed = subprocess.run(
        ["git", "for-each-ref", "--format=%(refname)", "refs/exps/"], cwd=repo, capture_output=True, text=True
    ).stdout
    return {ref.rsplit("/", 1)[-1] for ref in listed.split()} & set(EXPERIMENTS)


def wait_for_queue(repo: Path) -> dict[str, str]:
    deadline = time.monotonic() + QUEUE_TIMEOUT_S
    asked, states = time.monotonic(), {}
    while True:
        since = time.monotonic() - asked
        if (experiment_refs(repo) == set(EXPERIMENTS) and since > REASK_S) or since > STATUS_EVERY_S:
            states, asked = queue_states(repo), time.monotonic()
            if set(states) == set(EXPERIMENTS) and not any(state in UNFINISHED for state in states.values()):
                return states
        if time.monotonic() > deadline:
            tails = {out.name: out.read_text(errors="replace")[-2000:] for out in worker_files(repo, "out")}
            raise AssertionError(f"queue not done after {QUEUE_TIMEOUT_S} s: {states}; workers' logs: {tails}")
        time.sleep(POLL_S)


def declared_metrics(repo: Path) -> set[str]:
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    return {path for stage in stages.values() for path in stage.get("metrics", [])}


def shown_experiments(shown: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Experiment name -> its entry in `dvc exp show --json` (rev, params, metrics)."""
    found = {}
    for baseline in shown:
        for experiment in baseline.get("experiments") or []:
            for rev in experiment["revs"]:
                if rev.get("name") in EXPERIMENTS:
                    found[rev["name"]] = rev
    return found


def check_exp_show(queued: Queued) -> dict[str, str]:
    """Each experiment with its lr and every metrics file dvc.yaml declares; returns name -> commit."""
    shown = shown_experiments(queued.shown)
    assert set(shown) == set(EXPERIMENTS), sorted(shown)
    metrics_files = declared_metrics(queued.repo)
    assert {"artifacts/evaluate/metrics.json", "artifacts/export/gates.json"} <= metrics_files
    for name, entry in shown.items():
        data = entry["data"]
        assert data["params"]["params.yaml"]["data"]["train"]["lr"] == pytest.approx(EXPERIMENTS[name])
        for path in metrics_files:
            assert data["metrics"].get(path, {}).get("data"), (name, path, data["metrics"].get(path))
        accuracy = data["metrics"]["artifacts/evaluate/metrics.json"]["data"]["accuracy"]
        assert (accuracy < 0.3) == (name == WEAK), (name, accuracy)  # the weak one is weak, the others learnt
    return {name: entry["rev"] for name, entry in shown.items()}


def check_weak_fell_back(repo: Path, rev: str) -> None:
    """What the weak experiment's export stage wrote (read from its commit): fp32 shipped, and why."""
    import dvc.api

    gates = json.loads(dvc.api.read("artifacts/export/gates.json", repo=str(repo), rev=rev))
    assert gates["requested_variant"] == "static_int8" and gates["variant"] == "fp32", gates
    assert gates["fallback_reason"].startswith("static_int8 failed its gates"), gates["fallback_reason"]
    assert gates["fallback_reason"].endswith("fp32 shipped instead"), gates["fallback_reason"]
    card = dvc.api.read("artifacts/export/model_card.md", repo=str(repo), rev=rev)
    assert "**Fallback:** static_int8 failed its gates" in card


def check_mlflow(repo: Path) -> None:
    """The project's store (not one in DVC's temporary workspaces) holds every experiment's stage runs."""
    client = client_for(repo)
    experiment = client.get_experiment_by_name("lockstep")
    assert experiment is not None, "no lockstep experiment in the project's MLflow store"
    runs = client.search_runs([experiment.experiment_id])
    assert all(r.info.status == "FINISHED" for r in runs), [(r.info.run_name, r.info.status) for r in runs]
    trains = [r for r in runs if r.data.tags.get("lockstep.stage") == "train"]
    assert sorted(float(r.data.params["train.lr"]) for r in trains) == sorted(EXPERIMENTS.values())
    artifacts = (repo / "mlartifacts").as_uri()
    assert all(r.info.artifact_uri.startswith(artifacts) for r in runs), [r.info.artifact_uri for r in runs]
    # one parent run per experiment (its `dvc exp exec-run` process), each with its four stages
    parents = {r.data.tags["mlflow.parentRunId"] for r in trains}
    assert len(parents) == len(EXPERIMENTS)
    # run at once (`-j 2`), not one after the other: each parent run began before the other ended
    spans = [(r.info.start_time, r.info.end_time) for r in runs if r.info.run_id in parents]
    assert len(spans) == len(EXPERIMENTS) and max(s for s, _ in spans) < min(e for _, e in spans), spans
    for parent in parents:
        stages = sorted(r.data.tags["lockstep.stage"] for r in runs if r.data.tags.get("mlflow.parentRunId") == parent)
        assert stages == ["compress", "evaluate", "export", "train"], stages
    exports = {r.data.tags["mlflow.parentRunId"]: r for r in runs if r.data.tags.get("lockstep.stage") == "export"}
    weak = next(r for r in trains if float(r.data.params["train.lr"]) == EXPERIMENTS[WEAK])
    assert exports[weak.data.tags["mlflow.parentRunId"]].data.tags["export.shipped_variant"] == "fp32"


@pytest.mark.slow
def test_two_queued_experiments_run_at_once_and_both_land(queued: Queued) -> None:
    assert queued.before_start == dict.fromkeys(EXPERIMENTS, "Queued")
    logs = queued.logs
    assert queued.states == dict.fromkeys(EXPERIMENTS, "Success"), {n: logs[n][-3000:] for n in queued.states}
    for name, log in logs.items():
        ran = re.findall(r"Running stage '(\w+)'", log)
        assert ran == ["train", "evaluate", "compress", "export"], (name, ran)
        for bad in ("database is locked", "Traceback"):
            assert bad not in log, f"{name}: {bad!r} in its log:\n{log[-3000:]}"

    revs = check_exp_show(queued)
    check_weak_fell_back(queued.repo, revs[WEAK])
    check_mlflow(queued.repo)


@pytest.mark.slow
def test_plots_diff_draws_the_baseline_and_an_experiment(queued: Queued, tmp_path: Path) -> None:
    """`dvc plots diff <baseline> <experiment>`: every plot drawn offline for both, each naming both."""
    run(["dvc", "plots", "diff", "HEAD", LEARNT, "-o", str(tmp_path / "diff")], queued.repo)
    html = tmp_path / "diff" / "index.html"
    page = open_page(html, tmp_path / "profile", every_plot_drawn(), SCREENSHOTS / "dvc-plots-diff.png")
    assert page.offline_problems(revisions=2, classes=classes(queued.repo)) == []
    for plot, drawn in page.plots.items():  # each names both: a legend entry, or a confusion matrix's header
        assert "HEAD" in drawn["text"] and LEARNT in drawn["text"], (plot, drawn["text"])


@pytest.mark.slow
def test_exp_show_lists_the_headline_metrics_of_each_experiment(queued: Queued) -> None:
    """`dvc exp show --json`: the baseline and each experiment with its test accuracy (evaluate) and the
    shipped model's accuracy, size and latency (gates.json's flat `shipped`): the numbers its own
    commit holds."""
    import dvc.api

    baseline = next(entry for entry in queued.shown if entry["rev"] != "workspace")
    rows = {"baseline": baseline, **{exp["name"]: exp["revs"][0] for exp in baseline["experiments"] or []}}
    assert set(rows) == {"baseline", *EXPERIMENTS}, list(rows)
    for name, row in rows.items():
        metrics = row["data"]["metrics"]
        evaluated = metrics["artifacts/evaluate/metrics.json"]["data"]
        shipped = metrics["artifacts/export/gates.json"]["data"]["shipped"]
        assert set(shipped) == {"accuracy", "size_bytes", "latency_b1_ms", "latency_b64_ms"}, (name, shipped)
        committed = {
            path: json.loads(dvc.api.read(path, repo=str(queued.repo), rev=row["rev"]))
            for path in ("artifacts/evaluate/metrics.json", "artifacts/export/gates.json")
        }
        assert evaluated["accuracy"] == committed["artifacts/evaluate/metrics.json"]["accuracy"], name
        assert shipped == committed["artifacts/export/gates.json"]["shipped"], name


# A stage process up to its first MLflow call, held at a barrier so that two of them make the
# store and the experiment at the same moment. Before tasks/tracking/runs.py locked the store's creation,
# one of the two failed in each of 12 tries (a duplicate table or column, or alembic finding the
# other's migration already done); with the store made beforehand, the experiment alone still
# collided in 6 of 6 (UNIQUE constraint) before its get-or-create caught that.
RACER = """
import os, sys, time
from pathlib import Path
import mlflow  # imported before the barrier (~2 s): both then open the store within milliseconds
from tasks.tracking import runs, store
barrier = Path(sys.argv[1])
(barrier / f"ready-{os.getpid()}").touch()
while not (barrier / "go").exists():
    time.sleep(0.002)
print(runs._experiment_id(store.mlflow_module(), "lockstep"))
"""


def test_two_processes_create_the_store_and_the_experiment_at_once(tmp_path: Path) -> None:
    env = subprocess_env(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}", PYTHONPATH=str(ROOT))
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(tmp_path)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("ready-*"))) < 2 and all(r.poll() is None for r in racers):
            assert time.monotonic() < deadline, "the racers never got ready"
            time.sleep(0.01)
        (tmp_path / "go").touch()
        outputs = [racer.communicate(timeout=120) for racer in racers]
    finally:
        for racer in racers:
            racer.kill()
    errors = [err for _, err in outputs]
    assert [r.returncode for r in racers] == [0, 0], [err[-3000:] for err in errors]
    assert not any("database is locked" in err or "Traceback" in err for err in errors), errors
    ids = {out.strip() for out, _ in outputs}
    assert len(ids) == 1 and ids != {""}, ids  # one experiment, found by both
