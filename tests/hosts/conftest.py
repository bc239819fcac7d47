"""The multi-host bed (tests/support/hosts.py) and the team's servers on it, made once per test process.

Hosts: `services` (the team stack bound to its own address, and a read-only git daemon the others
clone from), `trainer-a`, `trainer-b`, `laptop`. Nothing reaches a host but over the bed's network,
with two exceptions an operator makes by hand on a real team too, and which the fixtures say where
they do them: the code is put on the git server once (a bare clone of a commit of this working
tree), and the stack's client folder (`python -m stack client`: addresses and the client secrets)
is copied to the hosts that use it (scp, on a real team).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import ROOT, copy_project
from tests.support.hosts import LAST_REMOVAL, Bed, Host, remove_leftovers, tail, why_unavailable

HOSTS = ["services", "trainer-a", "trainer-b", "laptop"]
GIT_PORT = 9418  # git daemon's own; the bed's address is private, so no other server can hold it
CLIENT_DIR = "/root/lockstep-stack"  # where a client host keeps the stack's client folder (its LOCKSTEP_STACK_DIR)
TIMINGS = ROOT / "test-artifacts" / "many-hosts-timings.json"
# The project as the team commits it, shrunk like every test's (tests/conftest.py TINY): one quantized
# variant, 2 epochs. A run's cost here is the servers' and the network's, not the training's.
# No cron: the deployment's runs are the tests' own.
PROJECT = {"train": {"epochs": 2}, "compress": {"variants": ["static_int8"]}, "orchestration": {"cron": None}}
POOL = "lockstep-bed"  # the work pool the laptop deploys to (made by `deploy`, locked)
DEPLOYMENT = "lockstep-pipeline/nightly"


@dataclass
class Team:
    bed: Bed
    commit: str  # what the git server serves (HEAD of lockstep.git)
    git_url: str
    timings: dict[str, float] = field(default_factory=dict)

    def client_env(self) -> str:
        """A shell prefix: the client folder's environment (what `source $LOCKSTEP_STACK_DIR/env` gives)."""
        return f'export LOCKSTEP_STACK_DIR={CLIENT_DIR}; . "$LOCKSTEP_STACK_DIR/env"; '


@pytest.fixture(scope="session")
def bed() -> Iterator[Bed]:
    why = why_unavailable()
    if why:
        if os.environ.get("CI") == "true":  # CI is root: a bed that cannot be made there is a failure
            pytest.fail(f"the multi-host bed cannot be made: {why}")
        pytest.skip(f"the multi-host bed needs network and mount namespaces: {why}")
    remove_leftovers()  # namespaces and folders of a bed whose test run was killed
    with Bed(HOSTS) as made:
        yield made


@pytest.fixture(scope="session")
def team(bed: Bed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Team]:
    timings = {"bed_setup_s": round(bed.setup_s, 3)}
    services = bed.host("services")
    started = time.monotonic()
    # The operator puts the code on the git server: a commit of this working tree (what the suite
    # tests; uncommitted changes included), as a bare repository on `services`' own disk.
    snapshot = copy_project(tmp_path_factory.mktemp("hosts") / "snapshot", PROJECT)
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
    _wait_for_port(services, GIT_PORT, services.disk / "tmp" / "git-daemon.log")
    services.run(["python", "-m", "stack", "client", "/root/stack-client"])
    for name in ("trainer-a", "trainer-b", "laptop"):
        # the operator's scp of the client folder to each host that uses the stack
        shutil.copytree(services.disk / "home" / "stack-client", bed.host(name).disk / "home" / "lockstep-stack")
    made = Team(bed, commit, f"git://{services.address}/lockstep.git", timings)
    try:
        yield made
    finally:
        # Not `python -m stack down`, which stops the servers one after another (11 s here): the bed
        # sends every process of every host SIGTERM at once (PostgreSQL's smart shutdown then ends as
        # its clients go), SIGKILL after a grace period, and removes the namespaces and the folder.
        bed.close()
        made.timings["bed_teardown_s"] = LAST_REMOVAL.get("seconds", 0.0)
        made.timings["processes_ended"] = LAST_REMOVAL.get("processes", 0)
        made.timings["processes_killed"] = LAST_REMOVAL.get("killed", [])
        TIMINGS.parent.mkdir(exist_ok=True)
        TIMINGS.write_text(json.dumps(made.timings, indent=2) + "\n")


@pytest.fixture(scope="session")
def data_pushed(team: Team) -> Team:
    """The laptop: clone, join the stack's S3 as the DVC remote, make the data snapshot and push it."""
    laptop = team.bed.host("laptop")
    started = time.monotonic()
    laptop.clone(team.git_url)
    laptop.run(f"export LOCKSTEP_STACK_DIR={CLIENT_DIR}; python -m stack join")
    laptop.run(team.client_env() + "dvc repro download && dvc push")
    assert laptop.run("git status --porcelain -- data.dvc").stdout == "", "the snapshot is not the committed one"
    team.timings["laptop_clone_download_push_s"] = round(time.monotonic() - started, 3)
    return team


@pytest.fixture(scope="session")
def trainers(team: Team) -> Team:
    """trainer-a and trainer-b as the docs set a trainer up: a clone of the served commit (where
    `make env` builds .venv), joined to the stack (`python -m stack join`: the DVC remote, and the
    client folder's env file that `source $LOCKSTEP_STACK_DIR/env` reads)."""
    started = time.monotonic()
    for name in ("trainer-a", "trainer-b"):
        trainer = team.bed.host(name)
        trainer.clone(team.git_url)
        trainer.run(f"export LOCKSTEP_STACK_DIR={CLIENT_DIR}; python -m stack join")
    team.timings["trainers_clone_join_s"] = round(time.monotonic() - started, 3)
    return team


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
        worker = self.workers.pop(name)
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(timeout=30)

    def log(self, name: str, chars: int = 6000) -> str:
        """The end of a worker's log (its flow runs' output too: stream_output)."""
        return tail(self.team.bed.host(name).disk / "tmp" / f"worker-{name}.log", chars)


@pytest.fixture(scope="module")
def pool(data_pushed: Team, trainers: Team) -> Iterator[Pool]:
    """The laptop deploys the pipeline from git (`python -m flows.deployments deploy --pool ... --git`);
    a worker on trainer-a serves the pool (the tests start others)."""
    team, laptop = data_pushed, data_pushed.bed.host("laptop")
    started = time.monotonic()
    deployed = laptop.run(team.client_env() + f"python -m flows.deployments deploy --pool {POOL} --git")
    assert f"deployed {DEPLOYMENT} from {team.git_url} at {team.commit[:12]}" in deployed.stdout, deployed.stdout
    team.timings["laptop_deploy_s"] = round(time.monotonic() - started, 3)
    made = Pool(team)
    made.start_worker("trainer-a")
    try:
        yield made
    finally:
        for name in list(made.workers):  # the bed ends whatever they started, if they do not
            made.stop_worker(name)


def _wait_for_port(host: Host, port: int, log: Path, timeout_s: float = 30) -> None:
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
