"""DDP for the train stage: the torchrun launch, and the entry point every rank runs.

The train stage (`python -m tasks train`, hence `dvc repro` and the Prefect flow) calls `launch`,
which starts `torch.distributed.run` (torchrun) with `python -m tasks.ddp` as each rank's program
and waits for it. Each rank runs the same `tasks.train.train` a lone process runs; rank 0 writes
the outputs, the launching stage logs them to MLflow (one run, not one per rank).

For several machines (`train.nnodes` > 1, a shared filesystem): the stage on the main node
launches its ranks and logs the run; every other node starts its ranks with torchrun directly:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29500 \
             --rdzv-id lockstep-train -m tasks.ddp --params params.yaml
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tasks import layout
from tasks.cli import configure_logging
from tasks.config import PARAMS_FILE, Params, load_params
from tasks.errors import ExpectedFailure
from tasks.train import TrainResult

PARAMS_ENV = "LOCKSTEP_PARAMS_JSON"  # the launcher's validated params, passed to every rank
# Where a rank that fails with an expected error (ExpectedFailure: diverged, a refused checkpoint, a full
# disk) leaves its one-line message, so the stage can report it instead of "torchrun exited 1".
ERRORS_ENV = "LOCKSTEP_RANK_ERRORS_DIR"
RDZV_ID = "lockstep-train"


def torchrun_command(params: Params) -> list[str]:
    cfg = params.train
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={cfg.nproc_per_node}",
        f"--max-restarts={cfg.max_restarts}",
    ]
    if cfg.nnodes == 1:
        cmd.append("--standalone")  # c10d rendezvous on a free local port
    else:
        cmd += [
            f"--nnodes={cfg.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={cfg.rdzv_endpoint}",
            f"--rdzv-id={RDZV_ID}",
        ]
    return [*cmd, "-m", "tasks.ddp"]


def launch(params: Params) -> TrainResult:
    """Run the training job under torchrun and return rank 0's result."""
    with tempfile.TemporaryDirectory(prefix="lockstep-ranks-") as errors:
        env = {
            **os.environ,
            PARAMS_ENV: params.model_dump_json(),
            ERRORS_ENV: errors,
            # torchrun would otherwise set 1 and warn; each rank pins its own count anyway
            "OMP_NUM_THREADS": str(params.determinism.num_threads),
        }
        done = subprocess.run(torchrun_command(params), env=env, check=False)
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
    return TrainResult(**json.loads(summary.read_text()))


def main(argv: list[str] | None = None) -> int:
    """One rank: params from the launcher (or --params when started by torchrun directly)."""
    parser = argparse.ArgumentParser(prog="python -m tasks.ddp", description=__doc__)
    parser.add_argument("--params", default=PARAMS_FILE)
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "?")
    configure_logging(f"%(levelname)s rank {rank} %(name)s: %(message)s")
    from_launcher = os.environ.get(PARAMS_ENV)
    params = Params.model_validate_json(from_launcher) if from_launcher else load_params(args.params)

    from tasks.determinism import pin_everything
    from tasks.train import train

    pin_everything(params.seed, params.determinism.num_threads, params.determinism.strict)
    try:
        train(params.train, params.seed, layout.PREPROCESSED_DIR, layout.TRAIN_DIR, resume_dir=layout.TRAIN_RESUME_DIR)
    except ExpectedFailure as exc:  # the launching stage reports it (one line); torchrun stops the other ranks
        logging.getLogger("tasks.ddp").error("%s", exc)
        if os.environ.get(ERRORS_ENV):
            (Path(os.environ[ERRORS_ENV]) / f"rank{rank}.txt").write_text(str(exc))
        return 1
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
