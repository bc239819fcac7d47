"""A sweep across hosts that share nothing but a network (issue 67): its Dask scheduler on `services`,
a worker on each trainer, mutual TLS, the study in the stack's PostgreSQL; the same study as on one host.

Who runs what, with the documented commands only (docs/sweeps.md, "Where trials run"):

- the laptop (the operator's machine) makes the cluster's credentials once, `python -m flows.sweep tls
  DIR`, and copies DIR to services and to each trainer (scp on a real team; here the test copies the
  files from the laptop's disk to theirs, modes kept);
- `services`: `python -m flows.sweep scheduler --host <its address> --port P --tls DIR`, from its clone
  (the scheduler unpickles the trial tasks, so it imports the project);
- trainer-a, trainer-b: in their clones, the data from the DVC remote (`dvc pull data.dvc`, then
  `dvc repro preprocess`: the trials check its digest), then `python -m flows.sweep worker
  tls://services:P --tls DIR` (which listens, with TLS, on the trainer's address that reaches the
  scheduler only);
- the coordinator on the laptop: `python -m flows.sweep --address tls://services:P --tls DIR`, with the
  stack's client environment (its Optuna storage: the stack's `lockstep_sweep` login, which reaches the
  `optuna` database only). The laptop, not a trainer, because that is where the person who starts a
  sweep sits and reads its result, and the coordinator trains nothing: it asks the trials, tells their
  results, and records the study; the study lives in PostgreSQL, so a coordinator that goes away is
  replaced by running the same command again (it resumes). The trainers keep their cores for trials.

Then the same sweep on one host: trainer-a alone, coordinator and a local cluster (`sweep.workers`
processes, no address), the same storage (the stack's PostgreSQL), another study name. Both must give
the same trials (params, seeds), states, values, and winner, and the winner's weights must be the same
bytes. No disk is shared: the winner's weights reach the laptop through its trial's MLflow run
(`tasks/tools/sweep/results.py` `winner_weights`), checked against the sha256 its trial reported.

Every host finds the portable CPU mode's op library that the team fixture built once and shares
(tests/support/team.py `share_op_library`): without it each worker's first trial compiles it (3 minutes
of g++ per trainer on a busy 2-core machine), which neither sweep's timing should measure.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.conftest import sha256
from tests.support.hosts import Host, as_json_lines, tail
from tests.support.team import Team, free_address_port, wait_for_port

pytestmark = pytest.mark.slow

TLS = "/root/.lockstep-dask"  # the credentials folder, at the same place on every host (its $HOME)
TRAINERS = ("trainer-a", "trainer-b")
# Tiny: 4 trials in 2 batches, 2 epochs each (the bed's params.yaml: tests/hosts/conftest.py PROJECT). Two
# batches, so that the second's trials are pruned against the first's results, told back across the
# network (with params.yaml's sweep section, trial 2 is); TPE's 4 startup trials are seeded draws.
SETTINGS = ("sweep.trials=4", "sweep.batch=2")
# What must not depend on where the trials ran: each trial's params, seed, state, value, epochs, weights.
RESULT_KEYS = ("trial", "state", "value", "epochs", "seed", "best_sha256")
SPACE = ("train.lr", "train.weight_decay", "train.label_smoothing")  # params.yaml's sweep.space

# Run on a host (argv: scheduler address, TLS folder, workers wanted, seconds): the addresses of the
# scheduler's workers once there are that many (exit 1 with those seen at the deadline: bounded).
WORKERS = """
import json, sys, time
from pathlib import Path
from distributed import Client
from tasks.tools.sweep.cluster import security
wanted, deadline = int(sys.argv[3]), time.monotonic() + float(sys.argv[4])
with Client(sys.argv[1], security=security(Path(sys.argv[2])), timeout=30) as client:
    while True:
        hosts = sorted(w["host"] for w in client.scheduler_info(n_workers=-1)["workers"].values())
        if len(hosts) >= wanted or time.monotonic() > deadline:
            print(json.dumps(hosts))
            sys.exit(0 if len(hosts) >= wanted else 1)
        time.sleep(1)
"""

# Run on the laptop (argv: scheduler address): a client with another cluster's credentials (Dask's
# temporary ones: a key and certificate of someone else's making) is turned away by the TLS handshake.
FOREIGN = """
from distributed import Client
from distributed.security import Security
try:
    Client(sys.argv[1], security=Security.temporary(), timeout=8).close()
    print("admitted")
except Exception as error:
    print(f"refused: {type(error).__name__}")
"""

# Run on the laptop with the client environment: the sweep login reaches its own database, not MLflow's.
SWEEP_LOGIN = """
import json, os
from urllib.parse import parse_qs, urlsplit
import psycopg
url = urlsplit(os.environ["LOCKSTEP_SWEEP_STORAGE"])
where = {"host": url.hostname, "port": url.port, "user": url.username, "passfile": parse_qs(url.query)["passfile"][0]}
seen = {}
for database in ("optuna", "mlflow", "prefect"):
    try:
        with psycopg.connect(dbname=database, connect_timeout=10, **where) as conn:
            seen[database] = "connected, superuser " + conn.execute("SHOW is_superuser").fetchone()[0]
    except psycopg.OperationalError as error:
        seen[database] = "refused: " + " ".join(str(error).split())[:160]
print(json.dumps(seen))
"""

# Run on the laptop with the client environment (argv: study name): the study's train runs on the
# MLflow server, with the host each ran on.
TRIAL_RUNS = """
import json, sys
from mlflow import MlflowClient
client = MlflowClient()
experiment = client.get_experiment_by_name("lockstep").experiment_id
runs = client.search_runs(
    [experiment], f"tags.`sweep.study` = '{sys.argv[1]}' and tags.`lockstep.stage` = 'train'"
)
print(json.dumps(sorted(
    [int(r.data.tags["sweep.trial"]), r.data.tags.get("host"), r.info.status, r.data.tags.get("sweep.state")]
    for r in runs
)))
"""


@dataclass
class Cluster:
    team: Team
    address: str  # tls://services:PORT
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def log(self, name: str) -> str:
        host = "services" if name == "scheduler" else name
        return tail(self.team.bed.host(host).disk / "tmp" / f"dask-{name}.log")

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{self.log(name)}" for name in ("scheduler", *TRAINERS))


def _python(host: Host, env: str, script: str, *args: str, timeout: float = 120) -> Any:
    """`script` run by the host's python in the stack's client environment (`env`); its last line, as JSON."""
    return as_json_lines(host.run(["sh", "-c", env + 'exec python -c "$@"', "sh", script, *args], timeout=timeout))


@pytest.fixture(scope="module")
def cluster(data_pushed: Team, trainers: Team) -> Iterator[Cluster]:
    team = data_pushed  # the laptop cloned, joined and pushed the data; the trainers cloned and joined
    bed, env = team.bed, team.client_env()
    laptop, services = bed.host("laptop"), bed.host("services")
    started = time.monotonic()
    # Once, on the operator's machine; then "scp -rp" of the folder to every member of the cluster.
    laptop.run(["python", "-m", "flows.sweep", "tls", TLS])
    made = laptop.disk / "home" / ".lockstep-dask"
    for name in ("services", *TRAINERS):
        shutil.copytree(made, bed.host(name).disk / "home" / ".lockstep-dask")  # copy2: modes 0700/0600 kept

    port = free_address_port(services)
    address = f"tls://services:{port}"
    found = Cluster(team, address)
    try:
        scheduler = ["python", "-m", "flows.sweep", "scheduler", "--host", services.address, "--port", str(port)]
        found.procs["scheduler"] = services.start([*scheduler, "--tls", TLS], "/tmp/dask-scheduler.log")
        wait_for_port(services, port, services.disk / "tmp" / "dask-scheduler.log", timeout_s=90)
        for name in TRAINERS:  # side by side: each gets its data, then serves trials (one at a time)
            worker = (
                env + "dvc pull -q data.dvc && dvc repro -q preprocess && "
                f"exec python -m flows.sweep worker {address} --tls {TLS}"
            )
            found.procs[name] = bed.host(name).start(["sh", "-c", worker], f"/tmp/dask-{name}.log")
        hosts = laptop.run(["python", "-c", WORKERS, address, TLS, "2", "240"], check=False, timeout=300)
        assert hosts.returncode == 0, (hosts.stdout, hosts.stderr[-2000:], found.logs())
        # one worker on each trainer, none elsewhere
        assert json.loads(hosts.stdout.splitlines()[-1]) == sorted(bed.host(n).address for n in TRAINERS)
        team.timings["sweep_cluster_up_s"] = round(time.monotonic() - started, 3)
        yield found
    finally:
        for proc in found.procs.values():  # the bed ends whatever is left when it closes
            proc.terminate()
        for proc in found.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _sweep(host: Host, env: str, name: str, *options: str) -> tuple[str, dict[str, Any]]:
    """`python -m flows.sweep` on `host` as the study `name`: its output and its sweep.json."""
    sets = [f"--set sweep.name={name}", *(f"--set {s}" for s in SETTINGS)]
    try:
        done = host.run(env + " ".join(["python -m flows.sweep", *options, *sets]), timeout=900, check=False)
    finally:  # `--set` writes params.yaml (as `make run --set` does): the clone is the other tests' too
        host.run("git checkout -- params.yaml")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-8000:]
    summary = json.loads((host.project / "artifacts" / "sweep" / name / "study" / "sweep.json").read_text())
    return output, summary


@pytest.fixture(scope="module")
def two_hosts(cluster: Cluster) -> tuple[str, dict[str, Any]]:
    """The sweep coordinated from the laptop, its trials on the trainers' workers."""
    team, laptop = cluster.team, cluster.team.bed.host("laptop")
    started = time.monotonic()
    try:
        done = _sweep(laptop, team.client_env(), "hosts", f"--address {cluster.address} --tls {TLS}")
    except AssertionError as failed:
        raise AssertionError(f"{failed}\n{cluster.logs()}") from None
    team.timings["sweep_2hosts_s"] = round(time.monotonic() - started, 3)
    return done


@pytest.fixture(scope="module")
def one_host(two_hosts: tuple[str, dict[str, Any]], cluster: Cluster) -> tuple[str, dict[str, Any]]:
    """The same sweep on trainer-a alone: coordinator and a local cluster of sweep.workers processes.
    After the two-host one: the pipeline lock (in PostgreSQL) lets one sweep run at a time anyway."""
    team, trainer = cluster.team, cluster.team.bed.host("trainer-a")
    started = time.monotonic()
    done = _sweep(trainer, team.client_env(), "onehost")
    team.timings["sweep_1host_s"] = round(time.monotonic() - started, 3)
    return done


def _results(summary: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [tuple(row[key] for key in (*RESULT_KEYS, *SPACE)) for row in summary["trials"]]


def test_the_cluster_admits_its_own_credentials_only_and_the_sweep_login_its_database_only(
    cluster: Cluster,
) -> None:
    team, laptop = cluster.team, cluster.team.bed.host("laptop")
    foreign = laptop.run(["python", "-c", FOREIGN, cluster.address], timeout=120).stdout.strip()
    assert foreign.startswith("refused"), foreign
    # a plain TCP scheduler address off loopback is refused before anything connects
    plain = laptop.run(f"python -m flows.sweep --address {cluster.address.replace('tls', 'tcp')}", check=False)
    assert plain.returncode == 3 and "plain TCP off loopback" in plain.stderr, plain.stderr[-2000:]
    seen = _python(laptop, team.client_env(), SWEEP_LOGIN)
    assert seen["optuna"] == "connected, superuser off", seen
    assert seen["mlflow"].startswith("refused") and seen["prefect"].startswith("refused"), seen


def test_a_sweep_across_hosts_gives_the_same_study_and_winner_bytes_as_on_one_host(
    cluster: Cluster, two_hosts: tuple[str, dict[str, Any]], one_host: tuple[str, dict[str, Any]]
) -> None:
    team, bed = cluster.team, cluster.team.bed
    (output, hosts), (_, alone) = two_hosts, one_host
    assert len(hosts["trials"]) == 4 and hosts["states"]["complete"] >= 2, hosts["states"]
    # the same trials (params, seeds), states, values and weights, and the same winner
    assert _results(hosts) == _results(alone)
    best = hosts["best"]
    assert {k: best[k] for k in ("trial", "params", "value", "seed", "best_sha256")} == {
        k: alone["best"][k] for k in ("trial", "params", "value", "seed", "best_sha256")
    }
    assert f"best trial {best['trial']}" in output

    # every trial trained on a trainer, both trainers took trials, none ran on the laptop or services
    runs = _python(bed.host("laptop"), team.client_env(), TRIAL_RUNS, "hosts")
    finished = [(trial, host) for trial, host, status, _ in runs if status == "FINISHED"]
    assert sorted(trial for trial, _ in finished) == [0, 1, 2, 3], runs
    assert {host for _, host in finished} == set(TRAINERS), runs
    trial_dir = f"trial-{best['trial']:04d}"
    trained_on = [n for n in TRAINERS if (bed.host(n).project / "artifacts/sweep/hosts" / trial_dir).is_dir()]
    assert len(trained_on) == 1, trained_on

    # the winner's weights on the laptop, fetched from its trial's MLflow run: the bytes trained on the
    # trainer, the bytes of the one-host winner, and nothing else of the trials on the laptop's disk
    study_dir = bed.host("laptop").project / "artifacts" / "sweep" / "hosts"
    assert best["weights"] == f"artifacts/sweep/hosts/{trial_dir}/best.safetensors", best
    # no journal.log (the study is in PostgreSQL), no other trial's folder
    assert sorted(p.name for p in study_dir.iterdir()) == sorted(["study", trial_dir]), list(study_dir.iterdir())
    assert [p.name for p in (study_dir / trial_dir).iterdir()] == ["best.safetensors"]
    winner = sha256(study_dir / trial_dir / "best.safetensors")
    trained = bed.host(trained_on[0]).project / "artifacts/sweep/hosts" / trial_dir / "best.safetensors"
    alone_file = bed.host("trainer-a").project / "artifacts/sweep/onehost" / trial_dir / "best.safetensors"
    assert winner == sha256(trained) == sha256(alone_file) == best["best_sha256"]
    assert alone["best"]["weights"] == f"artifacts/sweep/onehost/{trial_dir}/best.safetensors", alone["best"]


def test_the_coordinator_run_again_resumes_the_finished_study_from_postgresql(
    cluster: Cluster, two_hosts: tuple[str, dict[str, Any]]
) -> None:
    """A coordinator that went away is replaced by running the same command again: the study is the
    stack's (PostgreSQL), not a file of the laptop's, so the second run finds every trial done, trains
    nothing, and reports the same winner."""
    team, laptop = cluster.team, cluster.team.bed.host("laptop")
    _, first = two_hosts
    trained = _python(laptop, team.client_env(), TRIAL_RUNS, "hosts")
    output, again = _sweep(laptop, team.client_env(), "hosts", f"--address {cluster.address} --tls {TLS}")
    assert _results(again) == _results(first), output[-4000:]
    assert again["best"]["trial"] == first["best"]["trial"] and again["best"]["run_id"] == first["best"]["run_id"]
    assert _python(laptop, team.client_env(), TRIAL_RUNS, "hosts") == trained  # no trial trained again
    assert not (laptop.project / "artifacts" / "sweep" / "hosts" / "journal.log").exists()  # not a local journal
