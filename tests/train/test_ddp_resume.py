"""DDP and exact resume, on CPU with gloo: real `python -m tasks train` processes, real torchrun.

1. DDP with 2 processes (and the recipe options of the optimiser step), twice: byte-identical weights.
   The second run is the multi-node recipe, two launchers (the stage, and `--join`) with --nnodes 2
   and c10d rendezvous on 127.0.0.1, one process each: the same bytes as one launcher with 2 processes.
2. SIGKILL after epoch k, restart: byte-identical to an uninterrupted run (one process, and DDP);
   torchrun --max-restarts recovers a killed rank the same way (in DDP, the restarted job's rank 1 is
   killed in turn); another world size is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from mlflow import MlflowClient

from tasks.core.config.data import DataConfig, SplitConfig
from tasks.data.download import download
from tasks.data.preprocess import load_split, preprocess
from tasks.data.stats import compute_stats
from tasks.train.checkpoints import load_checkpoint
from tasks.train.models import predict
from tests.conftest import ROOT, free_port, run, subprocess_env, write_params
from tests.support.cli_errors import one_line_error

pytestmark = pytest.mark.slow
# A kill waits for a checkpoint and must land before the run ends, two epochs later. An epoch costs
# ~0.3 CPU-s in one process and ~0.55 over two ranks (digits, small_cnn, one thread each), a job's
# processes ~3.5 CPU-s each to start (stage, torchrun agent, ranks: ~13 for a DDP job), measured
# 2026-12 on two busy cores, where an epoch takes ~1 s of wall. So the runs are as short as the kills
# allow: four epochs in one process (one kill, after epoch 2); eight in DDP, where one training takes
# two kills (the whole job after epoch 2, then a rank of its restart at its next checkpoint) rather than
# a job each, with a checkpoint to spare for a kill that a loaded machine delays past one.
EPOCHS = 4
DDP_EPOCHS = 8
OUTPUTS = ("best.safetensors", "last.safetensors", "history.json")  # history: the same bytes after a resume too


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("ddp")
    download(DataConfig(), work / "data", work / "cache")
    split = SplitConfig()
    stats = compute_stats(work / "data", split, 42, 4096)
    preprocess(work / "data", stats, split, 42, work / "preprocessed")
    return work / "preprocessed"


# DDP runs train with the recipe options that touch the optimiser step: accumulated batches (synced once
# per step), clipping, warm-up and the weight EMA, balanced sampling across ranks; all must resume exactly.
DDP_RECIPE = {
    "accumulate_steps": 2,
    "grad_clip_norm": 1.0,
    "warmup_epochs": 1,
    "ema_decay": 0.9,
    "class_balance": "sampler",
}


def _project(data: Path, where: Path, **train: object) -> Path:
    if train.get("strategy") == "ddp":
        train = {**DDP_RECIPE, "epochs": DDP_EPOCHS, **train}
    (where / "artifacts").mkdir(parents=True)
    (where / "artifacts" / "preprocessed").symlink_to(data)
    write_params(
        where / "params.yaml",
        {
            "tracking": {"enabled": False},
            "determinism": {"num_threads": 1},
            "train": {"epochs": EPOCHS, "num_workers": 0, **train},
        },
    )
    return where


def _start(project: Path, cmd: list[str] | None = None, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cmd or [sys.executable, "-m", "tasks", "train"],
        cwd=project,
        env=subprocess_env(PYTHONPATH=str(ROOT), **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def _weights(project: Path) -> dict[str, str]:
    return {name: hashlib.sha256((project / "artifacts/train" / name).read_bytes()).hexdigest() for name in OUTPUTS}


def _checkpoint_epoch(project: Path) -> int:
    """The epoch in the resume checkpoint's safetensors header (0 while there is none)."""
    try:
        with open(project / "artifacts/train-resume/resume.safetensors", "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
    except FileNotFoundError:
        return 0
    return json.loads(header["__metadata__"]["lockstep"])["epoch"]


def _wait_for_checkpoint(proc: subprocess.Popen[str], project: Path, epoch: int) -> int:
    deadline = time.monotonic() + 300
    while (seen := _checkpoint_epoch(project)) < epoch:
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.02)
    return seen


def _kill_after(project: Path, epoch: int, victim: Callable[[subprocess.Popen[str]], list[int]]) -> int:
    """Start training, SIGKILL `victim` processes once the epoch-`epoch` checkpoint exists."""
    proc = _start(project)
    seen = _wait_for_checkpoint(proc, project, epoch)
    for pid in victim(proc):
        os.kill(pid, signal.SIGKILL)
    return seen if proc.wait(timeout=120) != 0 else -1  # -1: it was not killed (should not happen)


def _ranks(proc: subprocess.Popen[str]) -> dict[int, psutil.Process]:
    """The job's rank processes by global rank (a rank torchrun is replacing may be gone meanwhile)."""
    found = {}
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            env = child.environ()
        except psutil.Error:
            continue
        if "LOCAL_RANK" in env:
            found[int(env["RANK"])] = child
    return found


def _everything(proc: subprocess.Popen[str]) -> list[int]:
    """The stage process and all its descendants (launcher, torchrun agent, ranks) at once."""
    parent = psutil.Process(proc.pid)
    return [parent.pid, *(child.pid for child in parent.children(recursive=True))]


@pytest.fixture(scope="module")
def reference(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Uninterrupted runs: one process; DDP over 2 gloo processes of one launcher; and DDP again, over
    two launchers (`_two_launchers`). Each DDP run below is compared with the first."""
    base = tmp_path_factory.mktemp("reference")
    single = _project(data, base / "single")
    ddp = _project(data, base / "ddp", strategy="ddp", nproc_per_node=2)
    _finish(_start(single))
    _finish(_start(ddp))
    two_launchers = _two_launchers(data, base / "two-launchers")
    summaries = [json.loads((project / "artifacts/train/train.json").read_text()) for project in (ddp, two_launchers)]
    for summary in summaries:
        assert summary["world_size"] == 2 and summary["backend"] == "gloo", summary
    return {
        "single": _weights(single),
        "ddp": _weights(ddp),
        "two_launchers": _weights(two_launchers),
        "ddp_dir": ddp,
    }


def _two_launchers(data: Path, where: Path) -> Path:
    """The multi-node recipe, both "machines" on 127.0.0.1, each in its own directory (nodes share no
    disk): the main node runs the train stage, which hosts the rendezvous and launches its own torchrun;
    the other node joins (`python -m tasks.train.launcher --join`). Both end with the same outputs."""
    port = free_port()
    train = {"strategy": "ddp", "nproc_per_node": 1, "nnodes": 2, "rdzv_endpoint": f"127.0.0.1:{port}"}
    project, other_node = _project(data, where / "main", **train), _project(data, where / "other", **train)
    main = _start(project)
    other = _start(other_node, [sys.executable, "-m", "tasks.train.launcher", "--join", "--params", "params.yaml"])
    _finish(main)
    _finish(other)
    assert _weights(other_node) == _weights(project)
    return project


def test_ddp_with_two_gloo_processes_is_bitwise_reproducible(reference: dict[str, Any], data: Path) -> None:
    # two runs: one launcher with 2 processes, then two launchers (--nnodes 2) with one each
    assert reference["ddp"] == reference["two_launchers"]
    assert reference["ddp"] != reference["single"]  # a real 2-process run, not the 1-process path
    # validation under DDP counted every sample once: it equals one process scoring the saved model
    model, _ = load_checkpoint(reference["ddp_dir"] / "artifacts/train/last.safetensors")
    val = load_split(data, "val")
    accuracy = (predict(model, val.images, torch.device("cpu"), 512).argmax(1).numpy() == val.labels).mean()
    history = json.loads((reference["ddp_dir"] / "artifacts/train/history.json").read_text())
    assert history[-1]["val_accuracy"] == pytest.approx(accuracy, abs=1e-12)


def test_ddp_stage_logs_one_mlflow_run_with_bf16(data: Path, tmp_path: Path) -> None:
    project = _project(data, tmp_path / "p", strategy="ddp", nproc_per_node=2, amp="bf16", epochs=2, max_batches=3)
    write_params(project / "params.yaml", {"tracking": {"enabled": True}}, base=project / "params.yaml")
    uri = f"sqlite:///{project / 'mlflow.db'}"
    temporary = tmp_path / "tmp"  # the job's $TMPDIR: the launch leaves nothing in it (torchrun's agent would)
    temporary.mkdir()
    _finish(_start(project, MLFLOW_TRACKING_URI=uri, TMPDIR=str(temporary)))
    # but what every later run shares by design: torch's compile cache (torchinductor_<user>) and the lock
    # files of the MLflow store (one per database: tasks/tracking/store.py)
    shared = ("torchinductor_", "lockstep-mlflow-")
    assert [path.name for path in temporary.iterdir() if not path.name.startswith(shared)] == []
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("lockstep").experiment_id])
    train_runs = [r for r in runs if r.data.tags.get("lockstep.stage") == "train"]
    assert len(train_runs) == 1  # one run for the job, not one per rank
    tags = train_runs[0].data.tags
    assert (tags["train.world_size"], tags["train.backend"], tags["train.amp"]) == ("2", "gloo", "bf16")
    logged = train_runs[0].data.params  # the recipe options are the run's params
    assert {k: logged[f"train.{k}"] for k in DDP_RECIPE} == {k: str(v) for k, v in DDP_RECIPE.items()}
    steps = [m.step for m in client.get_metric_history(train_runs[0].info.run_id, "val_accuracy")]
    assert steps == [1, 2]


def test_sigkill_then_restart_gives_identical_weights_single_process(
    data: Path, tmp_path: Path, reference: dict[str, Any]
) -> None:
    project = _project(data, tmp_path / "p")
    killed_after = _kill_after(project, 2, _everything)
    assert 2 <= killed_after < EPOCHS
    out = _finish(_start(project))
    assert f"resuming from artifacts/train-resume/resume.safetensors after epoch {killed_after}" in out
    assert _weights(project) == reference["single"]
    assert json.loads((project / "artifacts/train/train.json").read_text())["resumed_from_epoch"] == killed_after
    assert not (project / "artifacts/train-resume/resume.safetensors").exists()  # finished: removed


def test_a_killed_job_then_a_killed_rank_both_resume_to_identical_weights_ddp(
    data: Path, tmp_path: Path, reference: dict[str, Any]
) -> None:
    """Two recoveries of one DDP training (checkpoints every 2 epochs, torchrun --max-restarts 1): the
    whole job is SIGKILLed after epoch 2 (or 4, on a machine too busy to see 2 in time) and the stage run
    again; that run's rank 1 is SIGKILLed after its own next checkpoint, torchrun restarts both ranks and
    they finish. The final bytes are the uninterrupted run's, so both resumes were exact."""
    project = _project(data, tmp_path / "p", strategy="ddp", nproc_per_node=2, checkpoint_every=2, max_restarts=1)
    killed_after = _kill_after(project, 2, _everything)
    assert killed_after in (2, 4)  # mid-run: at least two epochs were left
    # the same checkpoint under another world size is refused, naming the file and both sizes
    other = _project(data, tmp_path / "other", **DDP_RECIPE, epochs=DDP_EPOCHS)  # only the world size differs
    (other / "artifacts/train-resume").mkdir()
    resume = project / "artifacts/train-resume/resume.safetensors"
    (other / "artifacts/train-resume/resume.safetensors").write_bytes(resume.read_bytes())
    refused = run([sys.executable, "-m", "tasks", "train"], other, check=False, PYTHONPATH=str(ROOT))
    # exit 1 and one line naming the file and both sizes, no traceback; the checkpoint kept for the job
    # it belongs to, nothing trained or written
    error = one_line_error(refused)
    assert "artifacts/train-resume/resume.safetensors: written by 2 process(es), this run has 1" in error, error
    assert (other / "artifacts/train-resume/resume.safetensors").exists()
    assert not list((other / "artifacts").glob("train/*"))
    # the real restart resumes; after its own checkpoint one of its ranks dies, and torchrun restarts both
    proc = _start(project)
    try:
        rank_killed_after = _wait_for_checkpoint(proc, project, killed_after + 2)
        assert rank_killed_after < DDP_EPOCHS  # mid-run
        ranks = _ranks(proc)
        assert sorted(ranks) == [0, 1]
        ranks[1].send_signal(signal.SIGKILL)
        out = _finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert f"resuming from artifacts/train-resume/resume.safetensors after epoch {killed_after}" in out
    assert _weights(project) == reference["ddp"]
    # the ranks that finished are torchrun's second pair, resumed from the checkpoint the kill came after
    # or a later one (a rank that never died would leave the first pair's epoch here)
    summary = json.loads((project / "artifacts/train/train.json").read_text())
    assert summary["resumed_from_epoch"] >= rank_killed_after > killed_after, (summary, rank_killed_after)
