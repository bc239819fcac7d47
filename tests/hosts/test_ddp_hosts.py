"""DDP across hosts that share no disk (issue 67: the 2-node training, a killed peer, the numbers).

trainer-a and trainer-b each have their own clone (code from the git server) and pull the data from
the DVC remote; nothing else passes between them but the bed's network. The stage runs on trainer-a
(`python -m tasks train`: it hosts the c10d rendezvous on trainer-a's address and launches its rank);
trainer-b runs its rank with `python -m tasks.train.launcher --join`. Checked here:

- 1 process on each of 2 hosts gives the weight bytes of 2 processes on one host (the same world
  size: the same global ranks, data shards and gloo reductions), every node ends with the outputs,
  and nothing of the job listens on a wildcard address, only on the hosts' own (private) addresses;
- trainer-b's processes killed mid-training and started again (as its operator or systemd would):
  torchrun on trainer-a restarts its rank (`train.max_restarts`), the checkpoint rank 0 wrote on its
  own disk reaches trainer-b, and the job ends with the same bytes;
- the time of each, in the bed's timings (test-artifacts/many-hosts-timings.json).

The model is the digits' small CNN at 1 thread per rank (`auto` would give 1 rank of a host 2
threads and 2 ranks of one host 1 each: other bytes), on torch's native CPU kernels (PARAMS says
why). MLflow is off: the runs' records are the pipeline tests' subject, and the bytes are this module's.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import merge
from tests.support.hosts import Host, tail
from tests.support.team import Team, free_address_port

pytestmark = pytest.mark.slow

EPOCHS = 8  # enough epochs after the one the peer is killed in for the kill to land mid-training
KILL_AFTER = 2  # the epoch whose checkpoint must exist before trainer-b is killed
PARAMS = {
    "tracking": {"enabled": False},
    # the default CPU mode (portable on x86-64 with AVX2): the bed shares its op library, built once
    "determinism": {"num_threads": 1},
    "train": {"model": "small_cnn", "epochs": EPOCHS, "strategy": "ddp", "num_workers": 0, "checkpoint_every": 1},
}
OUTPUTS = ("best.safetensors", "last.safetensors", "history.json")
RESUME = Path("artifacts/train-resume/resume.safetensors")
JOB_TIMEOUT_S = 300


@dataclass
class Trainers:
    team: Team
    a: Host
    b: Host
    jobs: list[Job] = field(default_factory=list)  # what a failed test left running is ended (`ready`)


def _write_params(host: Host, name: str, train: dict[str, object]) -> str:
    """A params file on the host (its /tmp): its clone's params.yaml with PARAMS and `train` over it."""
    base = yaml.safe_load((host.project / "params.yaml").read_text())
    text = yaml.safe_dump(merge(base, merge(PARAMS, {"train": train})), sort_keys=False)
    host.run(["sh", "-c", f"cat > /tmp/{name}"], input=text)
    return f"/tmp/{name}"


def _digests(host: Host) -> dict[str, str]:
    out = host.project / "artifacts" / "train"
    return {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in OUTPUTS}


def _summary(host: Host) -> dict:
    return json.loads((host.project / "artifacts" / "train" / "train.json").read_text())


@pytest.fixture(scope="module")
def ready(data_pushed: Team, trainers: Team) -> Iterator[Trainers]:
    """Each trainer pulls the data from the DVC remote and preprocesses it in its own clone."""
    team = data_pushed
    made = Trainers(team, team.bed.host("trainer-a"), team.bed.host("trainer-b"))
    started = time.monotonic()
    for host in (made.a, made.b):
        base = _write_params(host, "ddp-base.yaml", {})
        host.run(team.client_env() + "dvc pull -q data.dvc")
        host.run(f"python -m tasks stats --params {base} && python -m tasks preprocess --params {base}")
    team.timings["ddp_trainers_pull_preprocess_s"] = round(time.monotonic() - started, 3)
    meta = [(host.project / "artifacts" / "preprocessed" / "meta.json").read_bytes() for host in (made.a, made.b)]
    assert meta[0] == meta[1], "the trainers preprocessed different data"
    yield made
    for job in made.jobs:
        job.stop()


@pytest.fixture(scope="module")
def one_host(ready: Trainers) -> dict[str, str]:
    """The reference: DDP with 2 processes on trainer-a alone; its weight digests."""
    params = _write_params(ready.a, "ddp-1host.yaml", {"nproc_per_node": 2, "nnodes": 1})
    started = time.monotonic()
    ready.a.run(f"python -m tasks train --params {params}", timeout=JOB_TIMEOUT_S)
    ready.team.timings["ddp_1host_train_s"] = round(time.monotonic() - started, 3)
    summary = _summary(ready.a)
    assert (summary["world_size"], summary["backend"]) == (2, "gloo"), summary
    return _digests(ready.a)


class Job:
    """A 2-host DDP job: the stage on trainer-a, `--join` on trainer-b, each logging on its host."""

    def __init__(self, ready: Trainers, name: str, **train: object) -> None:
        self.ready, self.name = ready, name
        ready.jobs.append(self)
        self.port = free_address_port(ready.a)
        self.endpoint = f"trainer-a:{self.port}"
        settings = {"nproc_per_node": 1, "nnodes": 2, "rdzv_endpoint": self.endpoint, **train}
        self.params = {h.name: _write_params(h, f"{name}.yaml", settings) for h in (ready.a, ready.b)}
        self.joins = 0
        for host in (ready.a, ready.b):  # the last job's files: this one must make (or receive) its own
            host.run("rm -rf artifacts/train artifacts/train-resume")
        self.stage = ready.a.start(
            ["python", "-m", "tasks", "train", "--params", self.params["trainer-a"]], f"/tmp/{name}-stage.log"
        )
        self.join = self.start_join()

    def start_join(self) -> subprocess.Popen[bytes]:
        self.joins += 1
        command = ["python", "-m", "tasks.train.launcher", "--join", "--params", self.params["trainer-b"]]
        return self.ready.b.start(command, f"/tmp/{self.name}-join-{self.joins}.log")

    def log(self, host: Host, which: str) -> str:
        return tail(host.disk / "tmp" / f"{self.name}-{which}.log")

    def logs(self) -> str:
        joins = "\n".join(self.log(self.ready.b, f"join-{n}") for n in range(1, self.joins + 1))
        return f"--- stage on trainer-a\n{self.log(self.ready.a, 'stage')}\n--- trainer-b\n{joins}"

    def wait(self) -> None:
        """Both commands exited 0 (bounded)."""
        deadline = time.monotonic() + JOB_TIMEOUT_S
        for proc in (self.stage, self.join):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stop()
                raise AssertionError(f"the job did not end in {JOB_TIMEOUT_S} s\n{self.logs()}") from None
            assert code == 0, self.logs()

    def stop(self) -> None:
        for proc in (self.stage, self.join):
            if proc.poll() is None:
                _kill_tree(proc)


def _kill_tree(proc: subprocess.Popen[bytes]) -> tuple[int, list[int]]:
    """SIGKILL a command and all its descendants at once (what a host's crash does to them); its exit
    status and the pids, once all are gone (bounded)."""
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for member in procs:
        try:
            member.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    code = proc.wait(timeout=30)  # reaped by Popen first: psutil reaping it would lose the status
    _, alive = psutil.wait_procs(procs[1:], timeout=30)
    assert not alive, alive
    return code, [member.pid for member in procs]


def _listening(host: Host) -> set[str]:
    """The host's listening TCP sockets' local addresses (`ss`, in its own network namespace)."""
    done = host.run("ss -ltnH", check=False, venv=False, timeout=30)
    return {line.split()[3] for line in done.stdout.splitlines() if line.strip()}


def _checkpoint_epoch(host: Host) -> int:
    """The epoch in the host's resume checkpoint's safetensors header (0 while there is none)."""
    try:
        with open(host.project / RESUME, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
    except FileNotFoundError:  # none yet (it is replaced by a rename: never seen half-written)
        return 0
    return json.loads(header["__metadata__"]["lockstep"])["epoch"]


def _wait_for_checkpoint(job: Job, epoch: int) -> None:
    """Until a host holds the checkpoint of `epoch` (the job still running; bounded)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while max(_checkpoint_epoch(job.ready.a), _checkpoint_epoch(job.ready.b)) < epoch:
        assert job.stage.poll() is None and job.join.poll() is None, job.logs()
        assert time.monotonic() < deadline, job.logs()
        time.sleep(0.05)


def test_ddp_over_two_hosts_gives_the_one_host_bytes(ready: Trainers, one_host: dict[str, str]) -> None:
    a, b = ready.a, ready.b
    started = time.monotonic()
    job = Job(ready, "ddp-2hosts")
    # What listens once the job trains (its stores and gloo's pairs are up by the first checkpoint):
    # one look, not a poll, which would take the cores the timing below measures.
    _wait_for_checkpoint(job, 1)
    seen = {host.name: _listening(host) for host in (a, b)}
    job.wait()
    ready.team.timings["ddp_2hosts_train_s"] = round(time.monotonic() - started, 3)

    assert _digests(a) == one_host, job.logs()
    summary = _summary(a)
    assert (summary["world_size"], summary["backend"], summary["resumed_from_epoch"]) == (2, "gloo", None), summary
    # trainer-b shares no disk with trainer-a, and holds the same outputs all the same
    assert _digests(b) == one_host and _summary(b) == summary
    # The rendezvous listened on trainer-a's address, and nothing of the job on a wildcard address
    # (0.0.0.0, [::], *): only on each host's own private address (or loopback).
    assert f"{a.address}:{job.port}" in seen["trainer-a"], seen
    for host in (a, b):
        addresses = {entry.rsplit(":", 1)[0] for entry in seen[host.name]}
        assert addresses <= {host.address, "127.0.0.1"}, (host.name, seen[host.name])


def test_a_killed_peer_host_restarts_from_the_last_checkpoint_with_the_same_bytes(
    ready: Trainers, one_host: dict[str, str]
) -> None:
    a, b = ready.a, ready.b
    started = time.monotonic()
    job = Job(ready, "ddp-peer-killed", max_restarts=1)
    _wait_for_checkpoint(job, KILL_AFTER)
    # trainer-b goes down: its torchrun agent, its rank and the command that started them, at once
    code, killed = _kill_tree(job.join)
    assert code == -signal.SIGKILL, f"the job ended before the kill: nothing was tested\n{job.logs()}"
    epoch_at_kill = max(_checkpoint_epoch(a), _checkpoint_epoch(b))
    assert not set(killed) & set(b.pids()), "a process of the job survived on trainer-b"
    assert job.stage.poll() is None, job.logs()  # trainer-a's agent waits for the peer to come back
    job.join = job.start_join()  # trainer-b is back: its operator (or systemd) starts the command again
    job.wait()
    ready.team.timings["ddp_2hosts_peer_killed_train_s"] = round(time.monotonic() - started, 3)

    assert _digests(a) == one_host and _digests(b) == one_host, job.logs()
    resumed = _summary(a)["resumed_from_epoch"]
    assert resumed is not None and KILL_AFTER <= resumed <= epoch_at_kill + 1, (resumed, epoch_at_kill)
    # only rank 0's host wrote the checkpoint: on the restart it was sent to the other one
    assert re.search(r"the checkpoint of epoch \d+, received from rank 0", job.logs()), job.logs()
    assert not (a.project / RESUME).exists() and not (b.project / RESUME).exists()  # finished: removed everywhere
