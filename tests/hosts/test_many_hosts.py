"""The team's day across hosts that share nothing but a network (issue 67; the bed: tests/support/hosts.py).

`services` runs the team stack (`python -m stack up --host <its address>`: PostgreSQL, SeaweedFS's
S3, MLflow with basic auth, Prefect with its auth string) and a read-only git daemon; the laptop and
the trainers get the code from it with `git clone`, the stack's client folder from the operator
(`python -m stack client`), and use only the documented commands:

- the laptop: `git clone`, `python -m stack join`, `dvc repro download`, `dvc push`, and
  `python -m flows.deployments deploy --pool ... --git`, `prefect deployment run`;
- trainer-a and trainer-b: `git clone`, `python -m stack join`; by hand `dvc pull`,
  `python -m flows.pipeline`, `dvc push`; or `prefect worker start --pool ...`, whose runs clone the
  deployment's commit and pull the data in its pull steps and push what they made;
- then the laptop finds the runs, their params, lineage and artifacts on the MLflow server (the
  artifacts in S3, none on a trainer's disk), the flow runs on the Prefect server, and every file of
  the data and of the trainers' pipeline outputs in the DVC remote; runs on two trainers at once
  take turns (the pipeline lock in the stack's PostgreSQL).

The tests share one bed and one stack (package fixtures, tests/hosts/conftest.py) and run in any
order: each finds its own runs (by host and start time, or flow run id).
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
import yaml

from tests.hosts.remote_scripts import ASK, DVC_BUCKET_LIST, HOLD, LISTEN, MLFLOW_CHECK, PREFECT_CHECK, RUNS_SINCE
from tests.support.hosts import tail
from tests.support.team import PUSHED, Pool, Team, Trained, free_address_port, leftovers, start_runs, wait_final

pytestmark = pytest.mark.slow


def test_the_bed_keeps_hosts_apart(team: Team) -> None:
    bed = team.bed
    for name in bed.hosts:
        # the bed's subnet only: no default route, so nothing a host sends can leave the bed
        assert [route.split()[0] for route in bed.routes(name)] == ["10.67.0.0/24"], bed.routes(name)
    laptop, trainer = bed.host("laptop"), bed.host("trainer-a")
    laptop.run("echo only-on-the-laptop > /tmp/mark && echo home > ~/mark")
    seen = trainer.run("cat /tmp/mark ~/mark 2>&1; hostname; touch .venv/planted 2>&1", check=False)
    assert "only-on-the-laptop" not in seen.stdout and "No such file" in seen.stdout, seen.stdout
    assert "trainer-a" in seen.stdout and "Read-only file system" in seen.stdout, seen.stdout
    # over the network, by name: a listener on trainer-b answers trainer-a with the address it came from
    port = free_address_port(bed.host("trainer-b"))
    listener = bed.host("trainer-b").start(["python", "-c", LISTEN, str(port)], "/tmp/listener.log")
    assert trainer.run(["python", "-c", ASK, "trainer-b", str(port)]).stdout.strip() == trainer.address
    listener.wait(timeout=30)


def test_the_servers_want_credentials_and_the_git_remote_is_read_only(team: Team) -> None:
    stranger = team.bed.host("trainer-b")
    services = team.bed.host("services")
    state = json.loads((services.project / ".stack" / "state.json").read_text())  # the ports (not secret)
    base = f"http://{services.address}"
    probe = (
        "import sys, urllib.request, urllib.error\n"
        "try:\n    urllib.request.urlopen(sys.argv[1], timeout=10); print(200)\n"
        "except urllib.error.HTTPError as e:\n    print(e.code)"
    )
    mlflow = f"{base}:{state['ports']['mlflow']}/api/2.0/mlflow/experiments/search?max_results=1"
    prefect = f"{base}:{state['ports']['prefect']}/api/admin/version"
    assert stranger.run(["python", "-c", probe, mlflow]).stdout.strip() == "401"
    assert stranger.run(["python", "-c", probe, prefect]).stdout.strip() == "401"
    laptop = team.bed.host("laptop")
    laptop.run(["git", "clone", "-q", team.git_url, "/tmp/probe"], venv=False)
    commit = "git -c user.name=a -c user.email=a@b.invalid commit -q --allow-empty -m x"
    pushed = laptop.run(f"cd /tmp/probe && {commit} && git push -q origin HEAD", check=False)
    assert pushed.returncode != 0 and "access denied" in pushed.stderr.lower(), pushed.stderr


def test_a_trainer_runs_the_pipeline_from_git_and_the_stack_alone(trained: Trained) -> None:
    # the laptop cloned, joined, made the data snapshot and pushed it; trainer-a cloned and joined, then
    # pulled the data, ran the pipeline and pushed its outputs (the `trained` fixture)
    team, lock = trained.team, trained.lock
    laptop, trainer = team.bed.host("laptop"), team.bed.host("trainer-a")
    env = team.client_env()
    assert trainer.run("git rev-parse HEAD").stdout.strip() == team.commit  # the code from git, not a shared path

    # nothing of MLflow's or Prefect's on trainer-a's disk: every record went to the servers
    for local in ("mlflow.db", "mlruns", "mlartifacts"):
        assert not (trainer.project / local).exists(), local
    assert not (trainer.disk / "home" / ".prefect" / "prefect.db").exists()

    # the laptop sees the run on the MLflow server: params, lineage, artifacts (in S3)
    window = (str(trained.since_ms), str(trained.until_ms))
    seen = team.ask("laptop", MLFLOW_CHECK, "trainer-a", *window)
    assert seen["runs"] == 1 and seen["status"] == "FINISHED", seen
    assert seen["tags"]["host"] == "trainer-a" and seen["tags"]["git.commit"] == team.commit, seen["tags"]
    assert seen["tags"]["git.dirty"] == "false", seen["tags"]
    assert seen["params"]["train.epochs"] == "2", seen["params"]
    assert seen["artifact_uri"].startswith("mlflow-artifacts:/"), seen["artifact_uri"]
    assert seen["artifacts"] and seen["s3_keys_of_run"], seen

    # ... the flow run on the Prefect server
    flow_runs = [run for run in team.ask("laptop", PREFECT_CHECK, *window) if not run["deployment_id"]]
    assert [run["state"] for run in flow_runs] == ["COMPLETED"], flow_runs

    # ... and in the DVC remote every file of the data and of trainer-a's pipeline outputs
    keys = set(team.ask("laptop", DVC_BUCKET_LIST))
    hashes = {out["md5"] for stage in lock["stages"].values() for out in stage.get("outs", [])}
    data_dvc = yaml.safe_load(laptop.run("cat data.dvc").stdout)
    hashes |= {out["md5"] for out in data_dvc["outs"]}
    missing = [h for h in hashes if f"files/md5/{h[:2]}/{h[2:]}" not in keys]
    assert not missing, (missing, sorted(keys)[:20])
    status = laptop.run(env + "dvc status --cloud data.dvc")
    assert "in sync" in status.stdout, status.stdout


# --------------------------------------------------------------------------- deployments run by workers


def test_workers_on_two_trainers_run_the_deployment_from_git_one_pipeline_at_a_time(pool: Pool) -> None:
    """Two runs at once from the laptop, one worker each on trainer-a and trainer-b (--limit 1), each
    started in an empty folder: each run clones the deployment's commit and pulls the data in its pull
    steps, runs, and pushes what it made to the DVC remote; the pipeline lock (an advisory lock in the
    stack's PostgreSQL) makes the second wait for the first, then run."""
    team = pool.team
    pool.start_worker("trainer-b")
    try:
        for _ in range(60):  # both workers poll the pool before the runs exist (bounded)
            if "started" in pool.log("trainer-b").lower():
                break
            time.sleep(1)
        since_ms = int(time.time() * 1000)
        started = time.monotonic()
        ids = start_runs(team, 2)
        runs = wait_final(team, ids, pool, timeout_s=1500, last_line=PUSHED)
        team.timings["two_workers_two_runs_s"] = round(time.monotonic() - started, 3)
    finally:
        pool.stop_worker("trainer-b")
    assert [run["state"] for run in runs] == ["COMPLETED", "COMPLETED"], [r["messages"][-10:] for r in runs]
    for run in runs:
        logs = "\n".join(run["messages"])
        # the code: the deployment's pull steps, a clone of its commit over git; then the data from the
        # DVC remote; the outputs pushed to it under the pipeline lock, before the worker's folder went
        assert "Running 2 deployment pull step(s)" in logs and "Executing deployment step: git_clone" in logs, logs
        assert "Executing deployment step: run_shell_script" in logs and re.search(PUSHED, logs), logs
    for name in ("trainer-a", "trainer-b"):
        assert re.search(r"\d+ files? (fetched|added)", pool.log(name, 10**7)), pool.log(name)

    found = team.ask("laptop", RUNS_SINCE, str(since_ms))
    assert all(r["status"] == "FINISHED" for r in found), found
    keys = set(team.ask("laptop", DVC_BUCKET_LIST))
    trains = [r for r in found if r["stage"] == "train"]
    assert sorted(r["host"] for r in trains) == ["trainer-a", "trainer-b"], trains
    for train in trains:
        assert train["commit"] == team.commit and train["dirty"] == "false", train
        md5 = train["best_md5"]
        assert f"files/md5/{md5[:2]}/{md5[2:]}" in keys, f"the weights trained on {train['host']} are not in the remote"
    # nothing of a run stays on its trainer: its checkout was temporary, the worker's folder is empty
    assert leftovers(team.bed.host("trainer-a")) == [] and leftovers(team.bed.host("trainer-b")) == []

    pipelines = sorted((r for r in found if r["parent"] is None), key=lambda r: r["start"])
    assert sorted(r["host"] for r in pipelines) == ["trainer-a", "trainer-b"], pipelines
    first, second = pipelines
    # one after the other: everything a run writes (its MLflow runs, the registry and champion alias
    # in export, the DVC push) happens inside its pipeline run, inside the lock
    assert second["start"] >= first["end"], pipelines
    waited = [run for run in runs if any("waiting up to" in m for m in run["messages"])]
    assert len(waited) == 1, [r["name"] for r in runs]
    other = next(run for run in runs if run is not waited[0])
    (line,) = [m for m in waited[0]["messages"] if "waiting up to" in m]
    # the holder as PostgreSQL shows it (application_name: 63 characters, a long run name is cut short)
    assert "for the pipeline run in progress: Prefect flow run " in line, line
    assert other["name"][:12] in line and f" on {first['host']} (pid " in line, line


def test_the_pipeline_lock_spans_hosts_where_a_file_lock_cannot(trainers: Team) -> None:
    """The same two holders, one per trainer (in their clones): with the stack's environment the second
    is refused, naming the first and its host, or waits and then holds; with the file lock (no
    LOCKSTEP_PIPELINE_LOCK_URL: today's single-host lock) both hold it at once."""
    team = trainers
    a, b = team.bed.host("trainer-a"), team.bed.host("trainer-b")
    probe = 'exec python -c "$1" "$2" "$3" "$4"'
    stack_env, file_lock = team.client_env(), team.client_env() + "export LOCKSTEP_PIPELINE_LOCK_URL=; "

    def hold(env: str, wait_s: float) -> str:
        return b.run(["sh", "-c", env + probe, "sh", HOLD, "second", str(wait_s), "0"]).stdout.strip()

    def hold_on_a(env: str) -> subprocess.Popen[bytes]:
        log = a.disk / "tmp" / "hold.log"
        log.unlink(missing_ok=True)
        holder = a.start(["sh", "-c", env + probe, "sh", HOLD, "night run", "0", "6"], "/tmp/hold.log")
        for _ in range(100):  # until trainer-a holds it (bounded)
            if "held" in tail(log):
                return holder
            time.sleep(0.2)
        raise AssertionError(tail(log))

    first = hold_on_a(stack_env)
    refused = hold(stack_env, 0)
    assert refused.startswith("busy: postgresql://"), refused
    assert "another pipeline run is in progress: night run on trainer-a (pid" in refused, refused
    started = time.monotonic()
    assert hold(stack_env, 60) == "held"  # it waited for trainer-a's to end, then held it
    assert time.monotonic() - started > 1
    first.wait(timeout=30)
    second = hold_on_a(file_lock)
    assert hold(file_lock, 0) == "held", "a file lock on trainer-b saw trainer-a's"
    second.wait(timeout=30)
