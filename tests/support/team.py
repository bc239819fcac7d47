"""A team on the multi-host bed (tests/support/hosts.py): the operator's set-up and the users' documented
commands, as functions, for the bed's tests (tests/hosts/) and the soak command (tests/hosts/soak.py).

Hosts: `services` (the team stack bound to its own address, and a read-only git daemon the others
clone from), `trainer-a`, `trainer-b`, `laptop`. Nothing reaches a host but over the bed's network,
with two exceptions an operator makes by hand on a real team too, and which `make_team` says where
it does them: the code is put on the git server once (a bare clone of a commit of this working
tree), and the stack's client folder (`python -m stack client`: addresses and the client secrets)
is copied to the hosts that use it (scp, on a real team).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import ROOT, VENV_BIN, copy_project, stop_prefect_worker
from tests.support.hosts import Bed, Host, as_json_lines, tail

HOSTS = ["services", "trainer-a", "trainer-b", "laptop"]
GIT_PORT = 9418  # git daemon's own; the bed's address is private, so no other server can hold it
CLIENT_DIR = "/root/lockstep-stack"  # where a client host keeps the stack's client folder (its LOCKSTEP_STACK_DIR)
# The project as the team commits it, shrunk like every test's (tests/conftest.py TINY): one quantized
# variant, 2 epochs. A run's cost here is the servers' and the network's, not the training's.
# No cron: the deployment's runs are the tests' own.
PROJECT: dict[str, Any] = {
    "train": {"epochs": 2},
    "compress": {"variants": ["static_int8"]},
    "export": {"formats": ["onnx"]},  # nothing on the bed reads the pt2 copy (torch.export: ~2.7 CPU-s a run)
    "orchestration": {"cron": None},
}
POOL = "lockstep-bed"  # the work pool the laptop deploys to (made by `deploy`, locked)
DEPLOYMENT = "lockstep-pipeline/nightly"
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
PUSHED = r"dvc push: \d+ file\(s\) to remote 'stack'"  # the flow's last act under the lock (push_outputs)


@dataclass
class Team:
    bed: Bed
    commit: str  # what the git server serves (HEAD of lockstep.git)
    git_url: str
    timings: dict[str, Any] = field(default_factory=dict)

    def client_env(self) -> str:
        """A shell prefix: the client folder's environment (what `source $LOCKSTEP_STACK_DIR/env` gives)."""
        return f'export LOCKSTEP_STACK_DIR={CLIENT_DIR}; . "$LOCKSTEP_STACK_DIR/env"; '

    def python(self, host: str, script: str, *args: str) -> subprocess.CompletedProcess[str]:
        """`script` run by the host's python in the stack's client environment."""
        return self.bed.host(host).run(["sh", "-c", self.client_env() + 'exec python -c "$@"', "sh", script, *args])

    def ask(self, host: str, script: str, *args: str) -> Any:
        """The JSON a check script prints (its last line), run on `host`."""
        return as_json_lines(self.python(host, script, *args))


def make_team(bed: Bed, workdir: Path, project: dict[str, Any] | None = None) -> Team:
    """`services` up: the stack, the git daemon serving a commit of this working tree, and the client
    folder copied to the other hosts. `workdir` (outside the bed) holds the snapshot for a moment."""
    timings: dict[str, Any] = {"bed_setup_s": round(bed.setup_s, 3)}
    services = bed.host("services")
    started = time.monotonic()
    share_op_library(bed)
    timings["op_library_s"] = round(time.monotonic() - started, 3)
    started = time.monotonic()
    # The operator puts the code on the git server: a commit of this working tree (what the suite
    # tests; uncommitted changes included), as a bare repository on `services`' own disk.
    snapshot = copy_project(workdir / "snapshot", PROJECT if project is None else project)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=snapshot, capture_output=True, text=True, check=True
    ).stdout.strip()
    git_root = services.disk / "home" / "git"
    subprocess.run(["git", "clone", "-q", "--bare", str(snapshot), str(git_root / "lockstep.git")], check=True)
    shutil.rmtree(snapshot)
    timings["snapshot_s"] = round(time.monotonic() - started, 3)

    # `services` runs from its own clone, like any other host
    started = time.monotonic()
    services.clone("/root/git/lockstep.git")
    services.run(["python", "-m", "stack", "up", "--host", services.address])
    timings["services_stack_up_s"] = round(time.monotonic() - started, 3)
    # git's own daemon, read-only (no receive-pack): the workers fetch the code over the network
    services.start(
        [
            *("git", "daemon", "--reuseaddr", "--export-all", "--base-path=/root/git"),
            *(f"--listen={services.address}", f"--port={GIT_PORT}", "/root/git"),
        ],
        "/tmp/git-daemon.log",
    )
    wait_for_port(services, GIT_PORT, services.disk / "tmp" / "git-daemon.log")
    services.run(["python", "-m", "stack", "client", "/root/stack-client"])
    for name in bed.hosts:
        if name != "services":  # the operator's scp of the client folder to each host that uses the stack
            shutil.copytree(services.disk / "home" / "stack-client", bed.host(name).disk / "home" / "lockstep-stack")
    return Team(bed, commit, f"git://{services.address}/lockstep.git", timings)


def share_op_library(bed: Bed) -> None:
    """The portable CPU mode's compiled op (tasks/determinism/blas.py), built once here and shared
    read-only with every host: each would otherwise compile the same library on its first training
    (~1 min of a core each). Same source, same torch, same compiler, so the same file a host would
    build; a host with another source (a change not in the served commit) still builds its own."""
    build = "from tasks.determinism.blas import build; print(build())"
    python = str(VENV_BIN / "python")
    done = subprocess.run([python, "-c", build], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise AssertionError(f"the portable op could not be built here:\n{done.stderr[-3000:]}")
    bed.share(Path(done.stdout.strip().splitlines()[-1]))


def push_data(team: Team) -> None:
    """The laptop: clone, join the stack's S3 as the DVC remote, make the data snapshot and push it."""
    laptop = team.bed.host("laptop")
    started = time.monotonic()
    laptop.clone(team.git_url)
    laptop.run(f"export LOCKSTEP_STACK_DIR={CLIENT_DIR}; python -m stack join")
    laptop.run(team.client_env() + "dvc repro download && dvc push")
    assert laptop.run("git status --porcelain -- data.dvc").stdout == "", "the snapshot is not the committed one"
    team.timings["laptop_clone_download_push_s"] = round(time.monotonic() - started, 3)


def join(team: Team, names: list[str]) -> None:
    """Trainers as the docs set one up: a clone of the served commit (where `make env` builds .venv),
    joined to the stack (`python -m stack join`: the DVC remote, and the client folder's env file)."""
    started = time.monotonic()
    for name in names:
        host = team.bed.host(name)
        host.clone(team.git_url)
        host.run(f"export LOCKSTEP_STACK_DIR={CLIENT_DIR}; python -m stack join")
    team.timings["trainers_clone_join_s"] = round(time.monotonic() - started, 3)


@dataclass
class Trained:
    """A pipeline run by hand on a trainer, from its clone: what later tests find on the servers."""

    team: Team
    since_ms: int  # when it started and ended (ms since the epoch): the window its MLflow runs started in
    until_ms: int
    lock: dict[str, Any]  # the trainer's dvc.lock after the run (its outputs' hashes)


def run_by_hand(team: Team, name: str) -> Trained:
    """A trainer as the docs run the pipeline by hand: the data from the DVC remote (`dvc pull`), then
    `python -m flows.pipeline` with the stack's environment (runs to the MLflow and Prefect servers,
    the champion into the registry), then `dvc push` of what it made."""
    trainer, env = team.bed.host(name), team.client_env()
    since_ms = int(time.time() * 1000)
    started = time.monotonic()
    pulled = trainer.run(env + "dvc pull data.dvc")  # (or "up to date": another test pulled it first)
    assert trainer.run("ls data").stdout.strip(), pulled.stdout
    team.timings["trainer_pull_s"] = round(time.monotonic() - started, 3)
    started = time.monotonic()
    trainer.run(env + "python -m flows.pipeline", timeout=900)
    team.timings["trainer_pipeline_s"] = round(time.monotonic() - started, 3)
    until_ms = int(time.time() * 1000)
    trainer.run(env + "dvc push")
    return Trained(team, since_ms, until_ms, yaml.safe_load(trainer.run("cat dvc.lock").stdout))


# --------------------------------------------------------------------------- a work pool on the trainers


@dataclass
class Pool:
    """The deployment the laptop registered with `deploy --git`, and the workers started on trainers."""

    team: Team
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start_worker(self, name: str) -> None:
        """`prefect worker start` on a trainer, from an empty folder (no checkout: the code comes from
        git), with the stack's client environment; one flow run at a time (--limit 1)."""
        worker = (
            self.team.client_env() + "export PREFECT_WORKER_QUERY_SECONDS=1; mkdir -p ~/worker && cd ~/worker && "
            f"exec prefect worker start --pool {POOL} --type process --limit 1 --name {name}"
        )
        self.workers[name] = self.team.bed.host(name).start(["sh", "-c", worker], f"/tmp/worker-{name}.log")

    def stop_worker(self, name: str) -> None:
        stop_prefect_worker(self.workers.pop(name))  # (the host's prefixes exec: its PID is the worker's)

    def stop(self) -> None:
        for name in list(self.workers):  # the bed ends whatever they started, if they do not
            self.stop_worker(name)

    def log(self, name: str, chars: int = 6000) -> str:
        """The end of a worker's log (its flow runs' output too: stream_output)."""
        return tail(self.team.bed.host(name).disk / "tmp" / f"worker-{name}.log", chars)


def deploy(team: Team) -> Pool:
    """The laptop deploys the pipeline from git (`python -m flows.deployments deploy --pool ... --git`)."""
    started = time.monotonic()
    command = f"python -m flows.deployments deploy --pool {POOL} --git"
    deployed = team.bed.host("laptop").run(team.client_env() + command)
    assert f"deployed {DEPLOYMENT} from {team.git_url} at {team.commit[:12]}" in deployed.stdout, deployed.stdout
    team.timings["laptop_deploy_s"] = round(time.monotonic() - started, 3)
    return Pool(team)


# Run on the laptop: a flow run's state, name and log lines on the Prefect server (pages of 200, bounded).
FLOW_RUN = """
import json, sys, uuid
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
flow_run_id = uuid.UUID(sys.argv[1])
with get_client(sync_client=True) as client:
    run = client.read_flow_run(flow_run_id)
    messages, of_run = [], LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
    for page in range(50):
        logs = client.read_logs(of_run, limit=200, offset=page * 200)
        messages += [log.message for log in logs]
        if len(logs) < 200:
            break
print(json.dumps({"state": run.state_type.value, "name": run.name, "messages": messages}))
"""

# Run on the laptop: the state of each flow run (argv), one GET each: a poll that imports no Prefect
# (~0.1 s, not ~3 s of CPU the pipelines need).
STATES = """
import base64, json, os, sys, urllib.request
auth = base64.b64encode(os.environ["PREFECT_API_AUTH_STRING"].encode()).decode()
states = []
for flow_run_id in sys.argv[1:]:
    ask = urllib.request.Request(f"{os.environ['PREFECT_API_URL']}/flow_runs/{flow_run_id}")
    ask.add_header("Authorization", f"Basic {auth}")
    with urllib.request.urlopen(ask, timeout=30) as answer:
        states.append(json.load(answer)["state"]["type"])
print(json.dumps(states))
"""


def start_runs(team: Team, count: int) -> list[str]:
    """`prefect deployment run` from the laptop, `count` of them at once; their flow run ids."""
    command = f"prefect deployment run {DEPLOYMENT} >/tmp/started-$i.txt"
    loop = f"for i in $(seq {count}); do {command} & done; wait; cat /tmp/started-*.txt; rm /tmp/started-*.txt"
    started = team.bed.host("laptop").run(team.client_env() + loop).stdout
    ids = re.findall(r"UUID: ([0-9a-f-]{36})", started)
    assert len(ids) == count, started
    return ids


def wait_final(team: Team, ids: list[str], pool: Pool, timeout_s: float, last_line: str = PUSHED) -> list[dict]:
    """The runs once all are final, with their logs once each run's `last_line` (a regex) reached the
    server (a flow run's last log lines are sent as its process exits, after its final state)."""
    deadline = time.monotonic() + timeout_s
    while not all(state in FINAL for state in team.ask("laptop", STATES, *ids)):
        assert time.monotonic() < deadline, {name: pool.log(name) for name in pool.workers}
        time.sleep(5)
    for _ in range(15):
        runs = [team.ask("laptop", FLOW_RUN, flow_run_id) for flow_run_id in ids]
        if all(run["state"] != "COMPLETED" or re.search(last_line, "\n".join(run["messages"])) for run in runs):
            break
        time.sleep(2)
    return runs


def leftovers(host: Host) -> list[str]:
    """The worker's temporary checkouts (Prefect's `tmp*prefect` folders) still on the host, bounded wait:
    the worker removes a run's folder just after the run ends."""
    for _ in range(30):
        left = host.run("ls -d /tmp/tmp*prefect /tmp/prefect-workspace-* ~/worker/* 2>/dev/null || true").stdout.split()
        if not left:
            return []
        time.sleep(1)
    return left


# --------------------------------------------------------------------------- ports


def wait_for_port(host: Host, port: int, log: Path, timeout_s: float = 30) -> None:
    """Until something listens on host:port (asked from the host itself); bounded."""
    probe = f"import socket; socket.create_connection(('{host.address}', {port}), timeout=2).close()"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if host.run(["python", "-c", probe], check=False, timeout=30).returncode == 0:
            return
        time.sleep(0.3)
    raise AssertionError(f"{host.name}: nothing listens on port {port} after {timeout_s} s\n{tail(log)}")


def free_address_port(host: Host) -> int:
    """A port free on the host's address (asked on the host: its network namespace is its own)."""
    probe = f"import socket; s = socket.socket(); s.bind(('{host.address}', 0)); print(s.getsockname()[1])"
    return int(host.run(["python", "-c", probe]).stdout.strip())


def write_timings(team: Team, path: Path) -> None:
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(team.timings, indent=2) + "\n")
