"""Real sweeps on a real Dask cluster: a scheduler and worker processes on 127.0.0.1, started and
killed here by PID (`python -m flows.sweep scheduler|worker`, as a user starts them on each machine).

The same sweep run with one worker, and with two of which one is SIGKILLed mid-trial, gives the same
trial parameters, the same pruned set and byte-identical checkpoints; every trial is
an MLflow run that `tasks.tools.reproduce` rebuilds byte for byte; `--apply` hands the winner to the
pipeline, whose train stage then rebuilds the winner's weights, with `sweep.applied` in dvc.lock.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.core.lock import pipeline_lock
from tests.conftest import (
    PrefectServer,
    client_for,
    copy_project,
    free_port,
    run,
    sha256,
    stop_group,
    subprocess_env,
)

pytestmark = pytest.mark.slow

SWEEP = {
    # Three trials in batches of two: the first batch (0, 1) runs side by side on two workers, where
    # one is killed; the second (trial 2, lr 0.012) is pruned at its epoch 2 against the first's
    # curves. A fourth trial (pruned as well) added a trial run to each sweep and nothing to check.
    "trials": 3,
    "batch": 2,
    "seed": 0,
    "warmup_epochs": 1,
    "space": {"train.lr": {"type": "float", "low": 0.005, "high": 0.5, "log": True}},
}
# Four epochs: a worker is killed once its trial has trained one, and the trial must still be running
# then, so three are left to land in (a digits epoch is ~0.3 CPU-s, ~1 s of wall on two busy cores: a
# trial is mostly its MLflow run, not its epochs); pruning needs two (warmup_epochs + 1).
TRAIN = {"epochs": 4}


class Cluster:
    """A Dask scheduler and its workers, each in its own process group; the sweeps run on it report to
    the test worker's Prefect server (`flow_env`)."""

    def __init__(self, project: Path, flow_env: dict[str, str]) -> None:
        self.project, self.port, self.flow_env = project, free_port(), flow_env
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.workers: list[subprocess.Popen[Any]] = []
        self.scheduler = self._start("scheduler", "--host", "127.0.0.1", "--port", str(self.port), "--no-dashboard")

    def _start(self, role: str, *args: str) -> subprocess.Popen[Any]:
        log = open(self.project / f"dask-{role}-{time.monotonic_ns()}.log", "w")  # noqa: SIM115 - kept with the process
        return subprocess.Popen(
            [sys.executable, "-m", "flows.sweep", role, *args],
            cwd=self.project,
            env=subprocess_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def add_worker(self) -> subprocess.Popen[Any]:
        worker = self._start("worker", self.address, "--no-dashboard", "--death-timeout", "60")
        self.workers.append(worker)
        self.wait_for(len(self.alive()))
        return worker

    def alive(self) -> list[subprocess.Popen[Any]]:
        return [w for w in self.workers if w.poll() is None]

    def wait_for(self, count: int, timeout_s: float = 120) -> None:
        from distributed import Client

        deadline = time.monotonic() + timeout_s
        with Client(self.address, timeout=60) as client:
            while len(client.scheduler_info(n_workers=-1)["workers"]) != count:
                assert time.monotonic() < deadline, f"{count} Dask workers did not connect in {timeout_s} s"
                time.sleep(0.5)

    def stop(self) -> None:
        for proc in [*self.workers, self.scheduler]:
            stop_group(proc)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, prefect_server: PrefectServer) -> Iterator[Cluster]:
    project = copy_project(tmp_path_factory.mktemp("sweep"), {"sweep": SWEEP, "train": TRAIN})
    cluster = Cluster(project, prefect_server.env)
    try:
        cluster.add_worker()
        yield cluster
    finally:
        cluster.stop()


def _sweep(cluster: Cluster, name: str, *extra: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run(
        [sys.executable, "-m", "flows.sweep", "--address", cluster.address, "--set", f"sweep.name={name}", *extra],
        cluster.project,
        check,
        **cluster.flow_env,
    )


def _trials(project: Path, name: str) -> list[dict[str, str]]:
    with open(project / "artifacts" / "sweep" / name / "study" / "trials.csv") as handle:
        return list(csv.DictReader(handle))


def _results(rows: list[dict[str, str]]) -> list[tuple[str, ...]]:
    """What must not depend on the workers: each trial's params, seed, state, value and weights."""
    return [(r["trial"], r["train.lr"], r["seed"], r["state"], r["value"], r["epochs"], r["best_sha256"]) for r in rows]


@pytest.fixture(scope="module")
def one_worker(cluster: Cluster) -> list[dict[str, str]]:
    """The reference: the sweep on one worker (before any test adds a second), with `--apply`: the
    winner goes into params.yaml at the end of the same run (a second coordinator on the finished
    study cost ~7 CPU-s; resuming a finished study is tests/tools/test_sweep.py's). The trials do not
    read what it writes: each trains with its own seed and values, and sweep.applied is no train key."""
    assert len(cluster.alive()) == 1
    _sweep(cluster, "one", "--apply")
    return _trials(cluster.project, "one")


def test_two_workers_one_killed_mid_trial_give_the_same_study(
    cluster: Cluster, one_worker: list[dict[str, str]]
) -> None:
    """The sweep again on two workers, running trials side by side until one worker is SIGKILLed
    mid-trial (one run, both claims: where a trial runs, and a worker lost, change nothing)."""
    while len(cluster.alive()) < 2:
        cluster.add_worker()
    client = client_for(cluster.project)
    sweep = subprocess.Popen(
        [sys.executable, "-m", "flows.sweep", "--address", cluster.address, "--set", "sweep.name=two"],
        cwd=cluster.project,
        env=subprocess_env(**cluster.flow_env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        victim, killed_trial = _kill_a_worker_mid_trial(cluster, client, "two")
        output, _ = sweep.communicate(timeout=600)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 0, output
    assert victim.poll() is not None
    two = _trials(cluster.project, "two")

    assert _results(two) == _results(one_worker)
    states = [row["state"] for row in two]
    assert states[:2] == ["complete", "complete"] and "pruned" in states[2:], states
    best = json.loads((cluster.project / "artifacts/sweep/two/study/sweep.json").read_text())["best"]
    ref = json.loads((cluster.project / "artifacts/sweep/one/study/sweep.json").read_text())["best"]
    assert best["trial"] == ref["trial"] and best["params"] == ref["params"]
    best_file = f"artifacts/sweep/{{}}/trial-{best['trial']:04d}/best.safetensors"
    assert sha256(cluster.project / best_file.format("two")) == sha256(cluster.project / best_file.format("one"))
    assert f"best trial {best['trial']}" in output
    _check_recorded(cluster.project, "two", two, killed_trial)


def _check_recorded(project: Path, name: str, rows: list[dict[str, str]], killed_trial: str) -> None:
    """One sweep run in MLflow with the study; one finished train run per trial, nested in it, and
    the killed attempt's run marked KILLED with the reason."""
    client = client_for(project)
    experiment = client.get_experiment_by_name("lockstep").experiment_id
    parents = client.search_runs(
        [experiment], f"tags.`lockstep.entry_point` = 'sweep' and tags.`sweep.study` = '{name}'"
    )
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0]
    complete = [r for r in rows if r["state"] == "complete"]
    assert (
        parent.data.tags["sweep.best_trial"]
        == min(complete, key=lambda r: (-float(r["value"]), int(r["trial"])))["trial"]
    )
    listed = {a.path for a in client.list_artifacts(parent.info.run_id, "sweep")}
    assert {f"sweep/{n}" for n in ("trials.csv", "sweep.json", "optimization_history.png")} <= listed
    assert "sweep/param_importances.png" in listed
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    trials = [c for c in children if c.data.tags.get("sweep.trial") is not None]
    finished = sorted((c for c in trials if c.info.status == "FINISHED"), key=lambda c: int(c.data.tags["sweep.trial"]))
    assert [int(c.data.tags["sweep.trial"]) for c in finished] == list(range(len(rows)))  # every trial done once
    stage_runs = client.search_runs([experiment], f"tags.`sweep.study` = '{name}' and tags.`lockstep.stage` = 'train'")
    killed = [r for r in stage_runs if r.info.status == "KILLED"]
    assert [r.data.tags["sweep.trial"] for r in killed] == [killed_trial]
    assert "is gone" in killed[0].data.tags["lockstep.killed_reason"]
    assert len(stage_runs) == len(finished) + 1, [(r.data.tags["sweep.trial"], r.info.status) for r in stage_runs]
    for child, row in zip(finished, rows, strict=True):
        assert child.data.tags["sweep.state"] == row["state"]
        assert child.data.tags["lockstep.stage"] == "train"
        assert float(child.data.params["train.lr"]) == float(row["train.lr"])
        assert child.data.params["train.seed"] == row["seed"]
        history = client.get_metric_history(child.info.run_id, "val_accuracy")
        assert len(history) == int(row["epochs"])
        if row["state"] == "complete":
            assert child.data.tags["weights.best_sha256"] == row["best_sha256"]


def _kill_a_worker_mid_trial(cluster: Cluster, client: Any, study: str) -> tuple[subprocess.Popen[Any], str]:
    """SIGKILL the worker (its whole process group) running a trial that has trained an epoch."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        running = client.search_runs(
            [client.get_experiment_by_name("lockstep").experiment_id],
            f"tags.`sweep.study` = '{study}' and attributes.status = 'RUNNING' and tags.`lockstep.stage` = 'train'",
        )
        for run_ in running:
            if "val_accuracy" in run_.data.metrics:
                group = os.getpgid(int(run_.data.tags["lockstep.owner.pid"]))
                victim = next(w for w in cluster.alive() if w.pid == group)
                os.killpg(group, signal.SIGKILL)
                victim.wait(timeout=30)
                return victim, run_.data.tags["sweep.trial"]
        time.sleep(0.3)
    raise AssertionError("no trial trained an epoch within 300 s")


def test_a_trial_reproduces_and_apply_hands_the_winner_to_the_pipeline(
    cluster: Cluster, one_worker: list[dict[str, str]]
) -> None:
    project = cluster.project
    best = json.loads((project / "artifacts/sweep/one/study/sweep.json").read_text())["best"]
    rebuilt = run([sys.executable, "-m", "tasks.tools.reproduce", best["run_id"]], project)  # exit 0: identical
    assert f"reproduce {best['run_id']}: best.safetensors byte-identical" in rebuilt.stdout + rebuilt.stderr

    params = yaml.safe_load((project / "params.yaml").read_text())  # the winner, from the sweep's --apply
    assert params["train"]["lr"] == best["params"]["train.lr"] and params["train"]["seed"] == best["seed"]
    assert params["sweep"]["applied"] == {"study": "one", "trial": best["trial"], "run_id": best["run_id"]}

    run(["dvc", "repro", "train"], project)
    trial_weights = project / f"artifacts/sweep/one/trial-{best['trial']:04d}/best.safetensors"
    assert sha256(project / "artifacts/train/best.safetensors") == sha256(trial_weights)
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    assert lock["stages"]["train"]["params"]["params.yaml"]["sweep.applied"]["run_id"] == best["run_id"]


def test_a_crashing_trial_is_retried_once_then_recorded_failed_on_a_local_cluster(cluster: Cluster) -> None:
    """No address: the flow starts its own Dask cluster. A trial that diverges is a result of the sweep."""
    project = cluster.project
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["sweep"].update(name="crash", trials=1, space={"train.lr": {"type": "categorical", "choices": [1.0e10]}})
    params["determinism"]["num_threads"] = "auto"  # each of the sweep.workers (2) takes its share of the cores
    (project / "crash-params.yaml").write_text(yaml.safe_dump(params))
    done = run([sys.executable, "-m", "flows.sweep", "--params", "crash-params.yaml"], project, **cluster.flow_env)
    assert "1 trials, none complete" in done.stdout

    (row,) = _trials(project, "crash")
    assert row["state"] == "fail" and "training diverged" in row["error"], row
    client = client_for(project)
    runs = client.search_runs(
        [client.get_experiment_by_name("lockstep").experiment_id],
        "tags.`sweep.study` = 'crash' and tags.`lockstep.stage` = 'train'",
    )
    attempts = sorted((r.data.tags["sweep.attempt"], r.info.status, r.data.tags["sweep.state"]) for r in runs)
    assert attempts == [("1", "FAILED", "failed"), ("2", "FAILED", "failed")]
    share = max(1, len(os.sched_getaffinity(0)) // params["sweep"]["workers"])
    assert {r.data.tags["determinism.num_threads"] for r in runs} == {str(share)}


def test_a_sweep_writes_params_yaml_only_while_it_holds_the_pipeline_lock(cluster: Cluster) -> None:
    """`--set` is written once the lock is held (as `--apply` is written before it is let go): a sweep
    refused by a running pipeline leaves params.yaml as it was, so that run's dvc.lock records the file
    it trained on."""
    project = cluster.project
    before = (project / "params.yaml").read_bytes()
    with pipeline_lock("the test's pipeline run", 0, root=project):
        done = _sweep(cluster, "while-locked", "--set", "orchestration.lock_wait_s=1", check=False)
    assert done.returncode != 0 and "the test's pipeline run" in done.stdout + done.stderr, done.stderr[-2000:]
    assert (project / "params.yaml").read_bytes() == before
