"""Faults across hosts (issue 67, point 4), each on the bed (tests/hosts/conftest.py), each ending with
nothing lost, the next run clean, and the bed as it was (link up, servers up: in a `finally`).

- trainer-a's link cut while its worker's run trains: the run stops by itself within CHECK_S +
  USER_TIMEOUT_MS (its pipeline lock's session is unreachable, tasks/core/lock.py), Prefect marks its
  flow run Crashed when the heartbeats stop (the stack's zombie automation, flows/prefect_env.py),
  a retry on trainer-b's worker marks its MLflow runs KILLED (tasks/tracking/orphans.py: their flow run
  is over) and gives the same weight bytes as a clean run; with the link back, trainer-a's next run
  is clean;
- services' PostgreSQL restarted while a run trains: the run loses its lock's session and stops at once
  (never two runs writing the registry), its worker reports it Crashed, and the next run marks its
  MLflow runs KILLED and ends clean;
- the S3 gateway down during `dvc push` on a trainer: exit non-zero with a line naming the endpoint,
  the files kept in the trainer's cache; with the gateway back, the retry pushes every one.

The clean run the bytes are held to is the session's `trained` (trainer-a's pipeline by hand, shared
with the other bed modules); "the next run" is trainer-a's pipeline by hand again, in that clone,
where nothing is stale: a run of seconds that still takes the lock, sweeps and records on the servers.
The tests share the bed and the stack with the other bed modules (package fixtures) and run in any
order: each finds its own runs (by start time and flow run id).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.hosts.fault_scripts import FILES, RUNS, TRAINING
from tests.hosts.remote_scripts import DVC_BUCKET_LIST
from tests.support import faults
from tests.support.hosts import as_json_lines
from tests.support.team import STATES, Pool, Team, Trained, start_runs, wait_final

pytestmark = pytest.mark.slow

LOST_LOCK = "the connection holding the pipeline lock was lost"  # tasks/core/lock.py, the run's last line
TIMINGS = ROOT / "test-artifacts" / "faults-hosts-timings.json"


@pytest.fixture(scope="module", autouse=True)
def timings() -> Iterator[dict[str, float]]:
    """What each fault took, written for the issue's numbers when the module ends (its own file: the
    bed's timings file is the session's last writer's)."""
    measured: dict[str, float] = {}
    yield measured
    TIMINGS.parent.mkdir(exist_ok=True)
    TIMINGS.write_text(json.dumps(measured, indent=2) + "\n")


def _laptop(team: Team, script: str, *args: str) -> Any:
    return team.ask("laptop", script, *args)


def _wait_for_training(team: Team, host: str, since_ms: int, pool: Pool, timeout_s: float = 600) -> None:
    """Until the run's train stage has started on `host` (its MLflow run is RUNNING); bounded."""
    deadline = time.monotonic() + timeout_s
    while "RUNNING" not in _laptop(team, TRAINING, host, str(since_ms)):
        assert time.monotonic() < deadline, pool.log(host)
        time.sleep(1)


def _wait_state(team: Team, flow_run_id: str, states: tuple[str, ...], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while (state := _laptop(team, STATES, flow_run_id)[0]) not in states:
        assert time.monotonic() < deadline, f"flow run {flow_run_id} still {state} after {timeout_s} s"
        time.sleep(2)
    return state


def _log_size(pool: Pool, host: str) -> int:
    path = pool.team.bed.host(host).disk / "tmp" / f"worker-{host}.log"
    return path.stat().st_size if path.exists() else 0


def _log_from(pool: Pool, host: str, offset: int) -> str:
    """What a worker logged since `offset` (its runs' output too): the worker logs outlive a module's pool."""
    with open(pool.team.bed.host(host).disk / "tmp" / f"worker-{host}.log", "rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


def _records(team: Team, since_ms: int) -> dict:
    return _laptop(team, RUNS, str(since_ms))


def _pipeline_runs(records: dict, flow_run_id: str) -> list[dict]:
    """The MLflow runs of one flow run: its parent run (tagged with the flow run) and the stage runs under it."""
    parents = {run["id"] for run in records["runs"] if run["flow_run"] == flow_run_id}
    return [run for run in records["runs"] if run["id"] in parents or run["parent"] in parents]


def _assert_stopped(records: dict, flow_run_id: str) -> list[dict]:
    """The runs of a flow run that stopped mid-run: those it had finished stay FINISHED; its parent run
    and the stage run in progress were marked KILLED. The fault strikes once the train run is RUNNING,
    but a tiny training may end before the run notices the fault (within CHECK_S + USER_TIMEOUT_MS),
    so the stage in progress is training or one after it."""
    runs = _pipeline_runs(records, flow_run_id)
    killed = [run for run in runs if run["status"] != "FINISHED"]
    assert {run["status"] for run in killed} == {"KILLED"}, runs
    assert None in {run["stage"] for run in killed} and len(killed) <= 2, killed  # the parent run has no stage
    assert "train" in {run["stage"] for run in runs}, runs  # it got as far as training
    return killed


def _assert_completed(records: dict, completed: str) -> dict:
    """The completed flow run's MLflow runs all finished: its train run, with its best checkpoint's md5."""
    runs = _pipeline_runs(records, completed)
    assert runs and all(run["status"] == "FINISHED" for run in runs), runs
    (train,) = [run for run in runs if run["stage"] == "train"]
    return train


def _in_remote(team: Team, md5: str) -> bool:
    return f"files/md5/{md5[:2]}/{md5[2:]}" in set(_laptop(team, DVC_BUCKET_LIST))


@pytest.fixture(scope="module")
def reference(trained: Trained) -> str:
    """The clean run the faults' runs are held to: trainer-a's pipeline by hand (the session's `trained`,
    shared with the other bed modules), its best checkpoint's md5 as MLflow holds it. It also leaves
    trainer-a's clone with nothing stale, so that a next run there (`_next_run_is_clean`) takes seconds."""
    records = _records(trained.team, trained.since_ms)
    (train,) = [
        run
        for run in records["runs"]
        if run["stage"] == "train" and run["host"] == "trainer-a" and run["start"] <= trained.until_ms
    ]
    return train["best_md5"]


def _next_run_is_clean(team: Team, since_ms: int) -> dict:
    """The next run after a fault: trainer-a's pipeline by hand (`python -m flows.pipeline` in its clone,
    where nothing is stale): it takes the pipeline lock, sweeps the orphaned runs, records its own run
    on the MLflow and Prefect servers and ends clean. Then nothing of the test's runs is left RUNNING
    and every registered version has its promotion decision. The records since `since_ms`."""
    next_ms = int(time.time() * 1000)
    team.bed.host("trainer-a").run(team.client_env() + "python -m flows.pipeline", timeout=600)
    records = _records(team, since_ms)
    running = [run for run in records["runs"] if run["status"] == "RUNNING"]
    assert running == [], running
    mine = [run for run in records["runs"] if run["start"] >= next_ms and run["stage"] is None]
    assert [(run["owner_host"], run["status"]) for run in mine] == [("trainer-a", "FINISHED")], mine
    assert all(v["promotion"] in ("promoted", "kept") for v in records["versions"]), records["versions"]
    return records


# --------------------------------------------------------------------------- trainer-a's link cut


def test_trainer_a_cut_off_mid_training_is_crashed_killed_and_retried_on_trainer_b(
    pool: Pool, reference: str, timings: dict[str, float]
) -> None:
    team = pool.team
    since_ms, offset = int(time.time() * 1000), _log_size(pool, "trainer-a")
    started = time.monotonic()
    (lost,) = start_runs(team, 1)  # trainer-a's worker is the pool's only one: it takes the run
    try:
        _wait_for_training(team, "trainer-a", since_ms, pool)
        faults.cut_link(team.bed, "trainer-a")
        cut_at = time.monotonic()
        pool.start_worker("trainer-b")  # now: it could not take the run trainer-a took
        # the run stops by itself, once its lock's session does not answer (CHECK_S + USER_TIMEOUT_MS)
        for _ in range(60):
            if LOST_LOCK in _log_from(pool, "trainer-a", offset):
                break
            time.sleep(1)
        assert LOST_LOCK in _log_from(pool, "trainer-a", offset), pool.log("trainer-a")
        timings["link_cut_stopped_after_cut_s"] = round(time.monotonic() - cut_at, 1)
        # Prefect marks it Crashed when its heartbeats stop (3 missed, 30 s apart)
        assert _wait_state(team, lost, ("CRASHED",), timeout_s=240) == "CRASHED"
        timings["link_cut_crashed_after_cut_s"] = round(time.monotonic() - cut_at, 1)
        # the retry: trainer-a cannot ask for work, trainer-b's worker takes it
        (retry,) = start_runs(team, 1)
        (run,) = wait_final(team, [retry], pool, timeout_s=900)
        assert run["state"] == "COMPLETED", (run["messages"][-20:], pool.log("trainer-b"))
        timings["link_cut_retried_after_cut_s"] = round(time.monotonic() - cut_at, 1)
    finally:
        faults.restore_link(team.bed, "trainer-a")
        if "trainer-b" in pool.workers:
            pool.stop_worker("trainer-b")
    records = _records(team, since_ms)
    # the cut-off run: what it had not finished was marked KILLED by the retry's sweep, saying why
    killed = _assert_stopped(records, lost)
    assert all(run["owner_host"] == "trainer-a" for run in killed), killed
    reason = killed[0]["killed_reason"]
    assert f"ran Prefect flow run {lost}, which is Crashed on the server" in reason, reason
    assert "trainer-b" in reason, reason  # marked by the retry's process, on trainer-b
    # the retry: the same weight bytes as a clean run, and in the DVC remote
    on_b = _assert_completed(records, retry)
    assert on_b["host"] == "trainer-b" and on_b["best_md5"] == reference, (on_b, reference)
    assert _in_remote(team, on_b["best_md5"]), on_b

    # the link back: trainer-a's next run is clean, and its worker outlived the cut
    _next_run_is_clean(team, since_ms)
    assert pool.workers["trainer-a"].poll() is None, pool.log("trainer-a")
    timings["link_cut_test_s"] = round(time.monotonic() - started, 1)


# --------------------------------------------------------------------------- services' PostgreSQL restarted


def test_postgresql_restarted_mid_run_stops_the_run_and_the_next_run_is_clean(
    pool: Pool, reference: str, timings: dict[str, float]
) -> None:
    team = pool.team
    since_ms, offset = int(time.time() * 1000), _log_size(pool, "trainer-a")
    started = time.monotonic()
    (stopped,) = start_runs(team, 1)
    try:
        _wait_for_training(team, "trainer-a", since_ms, pool)
        restart = time.monotonic()
        timings["postgres_restart_s"] = round(faults.restart_postgres(team.bed), 1)
        # the run lost its lock's session: it stops at once, and its worker reports it
        state = _wait_state(team, stopped, ("CRASHED", "FAILED", "COMPLETED", "CANCELLED"), timeout_s=240)
        timings["postgres_final_after_restart_s"] = round(time.monotonic() - restart, 1)
    finally:
        faults.start_missing_servers(team.bed)  # none, if the restart went well
    assert state == "CRASHED", (state, pool.log("trainer-a"))
    assert LOST_LOCK in _log_from(pool, "trainer-a", offset), pool.log("trainer-a")

    records = _next_run_is_clean(team, since_ms)
    killed = _assert_stopped(records, stopped)  # by the next run's sweep (same host: its process is gone)
    assert all(" on host trainer-a " in run["killed_reason"] for run in killed), killed
    assert _in_remote(team, reference)  # nothing lost: the remote holds what it held
    timings["postgres_restart_test_s"] = round(time.monotonic() - started, 1)


# --------------------------------------------------------------------------- the S3 gateway down


def test_the_s3_gateway_down_during_dvc_push_fails_clearly_and_the_retry_pushes_everything(
    trainers: Team, timings: dict[str, float]
) -> None:
    team = trainers
    trainer, env, endpoint = team.bed.host("trainer-b"), team.client_env(), faults.s3_endpoint(team.bed)
    sums = as_json_lines(trainer.run(["python", "-c", FILES, "fault-extra", "20", str(time.time_ns())]))
    try:
        trainer.run(env + "dvc add -q fault-extra")
        faults.stop_s3_gateway(team.bed)
        try:
            started = time.monotonic()
            failed = trainer.run(env + "dvc push fault-extra.dvc", check=False)
            timings["s3_down_push_failed_after_s"] = round(time.monotonic() - started, 1)
            output = failed.stdout + failed.stderr
            # DVC's own line (exit 255): `ERROR: unexpected error - Could not connect to the endpoint URL:
            # "<endpoint>/lockstep-dvc/files/md5/..."`
            assert failed.returncode != 0, output
            assert "Could not connect to the endpoint URL" in output and f"{endpoint}/lockstep-dvc/" in output, output
            cached = [f".dvc/cache/files/md5/{md5[:2]}/{md5[2:]}" for md5 in sums]
            trainer.run(["ls", *cached])  # every file kept in the trainer's cache
        finally:
            started = time.monotonic()
            faults.start_missing_servers(team.bed)  # the object store, which is not running
            timings["s3_gateway_back_s"] = round(time.monotonic() - started, 1)
        trainer.run(env + "dvc push fault-extra.dvc")
        # the bucket as another host sees it: trainer-a, joined like trainer-b by `trainers` (the laptop
        # joins only with `data_pushed`, which this test does not need)
        keys = set(team.ask("trainer-a", DVC_BUCKET_LIST))
        folder = trainer.run("grep -o 'md5: [0-9a-f]*.dir' fault-extra.dvc").stdout.split()[-1]
        missing = [md5 for md5 in [*sums, folder] if f"files/md5/{md5[:2]}/{md5[2:]}" not in keys]
        assert not missing, missing
        assert "in sync" in trainer.run(env + "dvc status --cloud fault-extra.dvc").stdout
    finally:
        trainer.run("rm -rf fault-extra fault-extra.dvc && git checkout -q -- .gitignore", check=False)
