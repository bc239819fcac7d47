"""DDP for the train stage: the torchrun launch, and the entry point every rank runs.

The train stage (`python -m tasks train`, hence `dvc repro` and the Prefect flow) calls `launch`,
which starts `torch.distributed.run` (torchrun) with `python -m tasks.train.launcher` as each rank's program
and waits for it. Each rank runs the same `tasks.train.stage.train` a lone process runs; rank 0 makes
the outputs (written on every node), the launching stage logs them to MLflow (one run, not one per rank).

On one machine (`train.nnodes: 1`) nothing listens beyond loopback, and no other machine can join:
torchrun's `--standalone` would host its c10d stores on every interface (`::`, measured with torch
2.14), and torch's rendezvous unpickles the state it reads from its store. So the rendezvous is a
c10d FileStore in a private (0700) temporary directory, the agent shares no TCP store with the ranks
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE), and rank 0 hosts the ranks' store on 127.0.0.1
(tasks/train/devices.py); gloo and NCCL open their sockets on the loopback interface.

Several machines (`train.nnodes` > 1) share nothing but a private network: each node has its own
clone of the project (same commit, same params) and its own data (`dvc pull`). The node that runs the
stage is the one `train.rdzv_endpoint` names; it hosts the c10d rendezvous, launches its share of the
ranks and logs the run. Every other node runs its ranks with

    python -m tasks.train.launcher --join --params params.yaml

(torchrun with the same settings, as a client of that rendezvous). Which node gets global rank 0 is
c10d's choice (its participants sorted by address), so no node is assumed to hold rank 0's files:
every node receives the outputs (tasks/train/stage.py), and a restarted job resumes from the newest
checkpoint any node holds (tasks/train/resume.py). What listens, and where:

- the rendezvous store: this launcher's own TCPStore, on a socket bound to `rdzv_endpoint`'s address
  only (torch's own would bind every interface); every node's torchrun is its client;
- the ranks' store: global rank 0, bound to its node's address (tasks/train/devices.py);
- gloo (or NCCL): the interface that holds the node's address (GLOO_SOCKET_IFNAME).

A node's address is the one its traffic to `rdzv_endpoint` leaves from (the route the kernel picks),
passed to torchrun as `--local-addr`. Every machine that can reach these addresses can join the job
and send what torch unpickles: keep `rdzv_endpoint` on a private network.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from tasks.core import layout
from tasks.core.cli import configure_logging, exit_code
from tasks.core.config.params import Params
from tasks.core.config.yaml_io import PARAMS_FILE
from tasks.core.errors import ExpectedFailure
from tasks.determinism.bootstrap import bootstrap, start
from tasks.determinism.threads import pool_env, resolve, shared_env

if TYPE_CHECKING:
    from tasks.train.stage import TrainResult

PARAMS_ENV = "LOCKSTEP_PARAMS_JSON"  # the launcher's validated params, passed to every rank
# Where a rank that fails with an expected error (ExpectedFailure: diverged, a refused checkpoint, a full
# disk) leaves its one-line message, so the stage can report it instead of "torchrun exited 1".
ERRORS_ENV = "LOCKSTEP_RANK_ERRORS_DIR"
RDZV_ID = "lockstep-train"


def torchrun_command(params: Params, private_dir: Path) -> list[str]:
    """The torchrun command line (the same on every node); `private_dir` (mode 0700, ours, removed when
    the job ends) holds a one-node job's rendezvous file and the agent's log folder."""
    cfg = params.train
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={cfg.nproc_per_node}",
        f"--max-restarts={cfg.max_restarts}",
        # the agent makes a log folder per launch, by default a torchelastic_* in $TMPDIR that it never
        # removes (one more with every training); the ranks' output still goes to the stage's terminal
        f"--log-dir={Path(private_dir) / 'torchelastic'}",
    ]
    if cfg.nnodes == 1:  # rdzv_endpoint is not used: no other machine takes part
        cmd += [
            "--nnodes=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={Path(private_dir) / 'rendezvous'}",
            "--rdzv-conf=store_type=file",
            f"--rdzv-id={RDZV_ID}-{uuid.uuid4().hex}",
            "--local-addr=127.0.0.1",  # MASTER_ADDR for the ranks
        ]
    else:
        cmd += [
            f"--nnodes={cfg.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={cfg.rdzv_endpoint}",
            f"--rdzv-id={RDZV_ID}",
            # the stage's node hosts the store itself (`rendezvous_store`): no agent hosts one
            "--rdzv-conf=is_host=false",
            f"--local-addr={node_address(cfg.rdzv_endpoint)}",
        ]
    return [*cmd, "-m", "tasks.train.launcher"]


def node_address(endpoint: str) -> str:
    """This machine's address towards `endpoint` (host:port): the source address of its route there.
    A UDP socket's connect sends nothing; it only asks the kernel."""
    host, port = _split(endpoint)
    try:
        target = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, port))
            return probe.getsockname()[0]
    except OSError as exc:
        raise ExpectedFailure(f"train.rdzv_endpoint {endpoint}: no route from this machine: {exc}") from None


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def _interface(address: str) -> str | None:
    """The name of the interface that holds `address`."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            return name
    return None


@contextmanager
def rendezvous_store(endpoint: str) -> Iterator[None]:
    """The c10d rendezvous store for the job's torchrun agents, on `endpoint`'s address alone.

    torch's c10d backend would host it in the agent with TCPStore, which binds every interface; a socket
    bound here to the endpoint's address keeps it there. Open while the stage's torchrun runs.
    """
    # heavy: torch (~4 s); the launcher process itself never loads torch
    import torch.distributed as dist

    host, port = _split(endpoint)
    try:
        address = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(128)
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ExpectedFailure(
                f"train.rdzv_endpoint {endpoint}: not an address of this machine. Run the train stage on the "
                "node it names; every other node runs python -m tasks.train.launcher --join"
            ) from None
        raise ExpectedFailure(f"train.rdzv_endpoint {endpoint}: cannot listen there: {exc.strerror}") from None
    store = dist.TCPStore(
        address, port, None, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach()
    )
    try:
        yield
    finally:
        del store


def launch_env(params: Params, private_dir: Path) -> dict[str, str]:
    """The environment torchrun and the ranks run in."""
    env = {
        **os.environ,
        PARAMS_ENV: params.model_dump_json(),
        ERRORS_ENV: str(private_dir),
        # this node's ranks share its cores (`auto` threads: cores / ranks); torchrun would otherwise
        # set OMP_NUM_THREADS=1 and warn, and each rank pins its own count anyway
        **shared_env(params.train.nproc_per_node),
        **pool_env(resolve(params.determinism.num_threads, params.train.nproc_per_node)),
    }
    # The agent would host a TCP store for the ranks on every interface; rank 0 hosts it on its
    # node's address (loopback on one node), a new one every round
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if params.train.nnodes > 1:
        interface = _interface(node_address(params.train.rdzv_endpoint))
        if interface:  # gloo and NCCL on the network that reaches the other nodes (unless set already)
            env.setdefault("GLOO_SOCKET_IFNAME", interface)
            env.setdefault("NCCL_SOCKET_IFNAME", interface)
    return env


def launch(params: Params) -> TrainResult:
    """Run the training job under torchrun and return rank 0's result (every node gets its outputs)."""
    hosting = rendezvous_store(params.train.rdzv_endpoint) if params.train.nnodes > 1 else nullcontext()
    with tempfile.TemporaryDirectory(prefix="lockstep-ranks-") as errors, hosting:  # mkdtemp: mode 0700
        done = subprocess.run(torchrun_command(params, Path(errors)), env=launch_env(params, Path(errors)), check=False)
        reported = sorted(Path(errors).glob("rank*.txt"), key=lambda path: int(path.stem[4:]))
        if done.returncode != 0 and reported:
            raise ExpectedFailure(reported[0].read_text())  # the lowest failing rank's message
    if done.returncode != 0:
        raise RuntimeError(f"torchrun exited with code {done.returncode}; the failing rank's error is printed above")
    summary = layout.TRAIN_DIR / "train.json"
    if not summary.exists():  # every node's first rank writes the outputs (tasks/train/stage.py)
        raise RuntimeError(f"{summary}: missing after torchrun exited 0")
    # heavy: tasks.train.stage loads torch (~4 s); the launching process never loads it
    from tasks.train.stage import TrainResult

    return TrainResult(**json.loads(summary.read_text()))


def join(params: Params) -> int:
    """This node's ranks of a multi-node job whose stage runs on the node `train.rdzv_endpoint` names."""
    if params.train.nnodes == 1:
        raise ExpectedFailure("--join: train.nnodes is 1; the train stage runs the whole job on its own machine")
    with tempfile.TemporaryDirectory(prefix="lockstep-ranks-") as errors:
        cmd = torchrun_command(params, Path(errors))
        return subprocess.run(cmd, env=launch_env(params, Path(errors)), check=False).returncode


def main(argv: list[str] | None = None) -> int:
    """One rank: params from the launcher (or --params when started by torchrun directly)."""
    parser = argparse.ArgumentParser(prog="python -m tasks.train.launcher", description=__doc__)
    parser.add_argument("--params", default=PARAMS_FILE)
    parser.add_argument("--join", action="store_true", help="run this node's ranks of a multi-node job")
    args = parser.parse_args(argv)
    if args.join:
        configure_logging()
        return exit_code(lambda: join(bootstrap(args.params)), context="train --join: ")
    rank = os.environ.get("RANK", "?")
    configure_logging(f"%(levelname)s rank {rank} %(name)s: %(message)s")
    from_launcher = os.environ.get(PARAMS_ENV)
    # the launcher's process was bootstrapped and its ranks inherit its environment; on other nodes
    # torchrun starts ranks itself, with --params
    params = Params.model_validate_json(from_launcher) if from_launcher else bootstrap(args.params)

    d = params.determinism
    start(params.train_seed, d.num_threads, strict=d.strict, cpu=d.cpu)
    from tasks.train.stage import train  # torch and the stage: after the process is pinned

    try:
        train(
            params.train,
            params.train_seed,
            layout.PREPROCESSED_DIR,
            layout.TRAIN_DIR,
            resume_dir=layout.TRAIN_RESUME_DIR,
        )
    except ExpectedFailure as exc:  # the launching stage reports it (one line); torchrun stops the other ranks
        logging.getLogger("tasks.train.launcher").error("%s", exc)
        if os.environ.get(ERRORS_ENV):
            (Path(os.environ[ERRORS_ENV]) / f"rank{rank}.txt").write_text(str(exc))
        return 1
    # after the process is pinned: torch (~4 s) loads once bootstrap ran
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
