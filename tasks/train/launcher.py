"""DDP for the train stage: the torchrun launch, and the entry point every rank runs.

The train stage (`python -m tasks train`, hence `dvc repro` and the Prefect flow) calls `launch`,
which starts `torch.distributed.run` (torchrun) with `python -m tasks.train.launcher` as each rank's program
and waits for it. Each rank runs the same `tasks.train.stage.train` a lone process runs; rank 0 writes
the outputs, the launching stage logs them to MLflow (one run, not one per rank).

On one machine (`train.nnodes: 1`) nothing listens beyond loopback, and no other machine can join:
torchrun's `--standalone` would host its c10d stores on every interface (`::`, measured with torch
2.14), and torch's rendezvous unpickles the state it reads from its store. So the rendezvous is a
c10d FileStore in a private (0700) temporary directory, the agent shares no TCP store with the ranks
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE), and rank 0 hosts the ranks' store on 127.0.0.1
(tasks/train/devices.py); gloo and NCCL open their sockets on the loopback interface.

For several machines (`train.nnodes` > 1, a shared filesystem, a private network: every machine
that can reach `rdzv_endpoint` can join the job and send what torch unpickles): the stage on the
main node launches its ranks and logs the run; every other node starts its ranks with torchrun
directly:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29500 \
             --rdzv-id lockstep-train -m tasks.train.launcher --params params.yaml
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core import layout
from tasks.core.cli import configure_logging
from tasks.core.config.params import Params
from tasks.core.config.yaml_io import PARAMS_FILE
from tasks.core.errors import ExpectedFailure
from tasks.determinism.bootstrap import bootstrap
from tasks.determinism.threads import resolve, shared_env

if TYPE_CHECKING:
    from tasks.train.stage import TrainResult

PARAMS_ENV = "LOCKSTEP_PARAMS_JSON"  # the launcher's validated params, passed to every rank
# Where a rank that fails with an expected error (ExpectedFailure: diverged, a refused checkpoint, a full
# disk) leaves its one-line message, so the stage can report it instead of "torchrun exited 1".
ERRORS_ENV = "LOCKSTEP_RANK_ERRORS_DIR"
RDZV_ID = "lockstep-train"


def torchrun_command(params: Params, private_dir: Path) -> list[str]:
    """The torchrun command line; `private_dir` (mode 0700, ours) holds a one-node job's rendezvous file."""
    cfg = params.train
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={cfg.nproc_per_node}",
        f"--max-restarts={cfg.max_restarts}",
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
        ]
    return [*cmd, "-m", "tasks.train.launcher"]


def launch_env(params: Params, private_dir: Path) -> dict[str, str]:
    """The environment torchrun and the ranks run in."""
    env = {
        **os.environ,
        PARAMS_ENV: params.model_dump_json(),
        ERRORS_ENV: str(private_dir),
        # this node's ranks share its cores (`auto` threads: cores / ranks); torchrun would otherwise
        # set OMP_NUM_THREADS=1 and warn, and each rank pins its own count anyway
        **shared_env(params.train.nproc_per_node),
        "OMP_NUM_THREADS": str(resolve(params.determinism.num_threads, params.train.nproc_per_node)),
    }
    if params.train.nnodes == 1:
        # The agent would host a TCP store for the ranks on every interface; rank 0 hosts it on loopback.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def launch(params: Params) -> TrainResult:
    """Run the training job under torchrun and return rank 0's result."""
    with tempfile.TemporaryDirectory(prefix="lockstep-ranks-") as errors:  # mkdtemp: mode 0700
        done = subprocess.run(torchrun_command(params, Path(errors)), env=launch_env(params, Path(errors)), check=False)
        reported = sorted(Path(errors).glob("rank*.txt"), key=lambda path: int(path.stem[4:]))
        if done.returncode != 0 and reported:
            raise ExpectedFailure(reported[0].read_text())  # the lowest failing rank's message
    if done.returncode != 0:
        raise RuntimeError(f"torchrun exited with code {done.returncode}; the failing rank's error is printed above")
    summary = layout.TRAIN_DIR / "train.json"
    if not summary.exists():
        raise RuntimeError(
            f"{summary}: missing after torchrun; global rank 0 ran on another node, which holds "
            "the outputs (use a shared filesystem, or run the stage on the rank-0 node)"
        )
    from tasks.train.stage import TrainResult

    return TrainResult(**json.loads(summary.read_text()))


def main(argv: list[str] | None = None) -> int:
    """One rank: params from the launcher (or --params when started by torchrun directly)."""
    parser = argparse.ArgumentParser(prog="python -m tasks.train.launcher", description=__doc__)
    parser.add_argument("--params", default=PARAMS_FILE)
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "?")
    configure_logging(f"%(levelname)s rank {rank} %(name)s: %(message)s")
    from_launcher = os.environ.get(PARAMS_ENV)
    # the launcher's process was bootstrapped and its ranks inherit its environment; on other nodes
    # torchrun starts ranks itself, with --params
    params = Params.model_validate_json(from_launcher) if from_launcher else bootstrap(args.params)

    from tasks.determinism.pinning import pin_everything
    from tasks.train.stage import train

    pin_everything(params.train_seed, params.determinism.num_threads, params.determinism.strict, params.determinism.cpu)
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
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
