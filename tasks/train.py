"""Stage 4 — train: fit the model `train.model` names on the preprocessed training split.

Outputs (`artifacts/train/`): `best.safetensors` (best validation accuracy) and
`last.safetensors` (final epoch) — weights only, loadable without unpickling code, with the
resolved config and epoch in the safetensors metadata — and `history.json` (per-epoch loss and
accuracy, also a DVC plot).

One code path for one process and for DDP: under torchrun (RANK/WORLD_SIZE set) `train` joins the
process group (gloo on CPU, NCCL on GPUs), shards batches with the same seeded
DistributedSampler, reduces validation metrics across ranks, and lets rank 0 alone write files.
`train.batch_size` is the global batch; each of N processes takes batch_size / N.

Resume: every `checkpoint_every` epochs the full training state (model, optimiser, scheduler,
GradScaler, best model so far, history, and the RNG states of every rank) is written atomically to
`resume_dir/resume.safetensors`. A restarted stage (or a torchrun restart) finds it and continues,
and the final weights are byte-identical to an uninterrupted run's.

Data path: the split sits in memory as uint8 tensors; the DataLoader fetches whole batches
(`__getitems__`), workers apply the random shift, and the model normalises on the device. No
per-sample Python work, no PIL.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from safetensors.torch import save as serialize
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm.auto import tqdm

from tasks.atomic import atomic_files, write_bytes
from tasks.config import TrainConfig
from tasks.data_format import DataError
from tasks.determinism import loader_kwargs, rng_state, set_rng_state
from tasks.models import Classifier, build_model
from tasks.preprocess import Preprocessed, load_split
from tasks.tracking import StageRun

log = logging.getLogger(__name__)
RESUME_FILE = "resume.safetensors"
# How often a GPU run reads back whether a loss was non-finite: each read makes the host wait for the
# queued kernels, so it is amortised over steps (a diverged run wastes at most this many). On the CPU
# there is nothing to wait for: every step is checked, before its update.
FINITE_CHECK_EVERY_CUDA = 50


class TrainingDiverged(DataError):
    """The loss became NaN or infinite; nothing of the failing epoch was written."""


class CheckpointError(DataError):
    """A checkpoint that cannot be used: not safetensors, truncated, or from another model or run."""


def resolve_device(spec: str) -> torch.device:
    """`auto` picks the first GPU when there is one; an explicit `cuda` without one is an error."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"train.device is {spec!r} but torch sees no CUDA device")
    return torch.device(spec)


class ShiftedBatches(Dataset):
    """A split as uint8 tensors, fetched a batch at a time, optionally randomly shifted.

    The shift of a batch is drawn from a generator seeded by (seed, the batch's sample indices),
    so augmentation does not depend on which worker fetches the batch or on how many workers
    there are: `num_workers` 0 and 2 give the same weights.
    """

    def __init__(self, split: Preprocessed, max_shift: int, seed: int) -> None:
        self.images = torch.from_numpy(np.ascontiguousarray(split.images))
        self.labels = torch.from_numpy(np.ascontiguousarray(split.labels))
        self.max_shift = max_shift
        self.seed = seed

    def __len__(self) -> int:
        return len(self.labels)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices)
        images, labels = self.images[index], self.labels[index]
        if self.max_shift:
            state = np.random.SeedSequence([self.seed, *indices]).generate_state(2, dtype=np.uint32)
            images = _random_shift(images, self.max_shift, torch.Generator().manual_seed(int(state[0])))
        return images, labels


def _random_shift(images: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Translate each image by up to `max_shift` pixels in x and y, filling with zeros."""
    n, c, h, w = images.shape
    padded = nn.functional.pad(images, (max_shift,) * 4)
    dy, dx = torch.randint(0, 2 * max_shift + 1, (2, n, 1), generator=generator)
    rows = (dy + torch.arange(h))[:, None, :, None]
    cols = (dx + torch.arange(w))[:, None, None, :]
    return padded[torch.arange(n)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]


def _worker_context(num_workers: int) -> str | None:
    # forkserver, not fork: workers forked from an orchestrator's process (Prefect's threads and
    # handlers) died at shutdown; a forkserver child starts clean. Costs one import of torch.
    return "forkserver" if num_workers > 0 else None


def _whole_batches(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch  # __getitems__ already returns stacked tensors


def to_float(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """uint8 pixels -> float32 in [0, 1] on `device` (the model normalises from there)."""
    return images.to(device, non_blocking=True).float().div_(255.0)


@torch.no_grad()
def predict(model: nn.Module, images: np.ndarray, device: torch.device, batch_size: int) -> torch.Tensor:
    """Logits for uint8 (N, C, H, W) `images`, in order, on the CPU."""
    model.eval()
    outputs = [
        model(to_float(torch.from_numpy(images[i : i + batch_size]), device)).cpu()
        for i in range(0, len(images), batch_size)
    ]
    return torch.cat(outputs) if outputs else torch.empty(0)


def _make_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def _make_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    # Stepped once per epoch, after the optimiser steps of that epoch.
    if cfg.scheduler == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs)
    if cfg.scheduler == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg.step_size, gamma=cfg.gamma)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0)


def checkpoint_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> bytes:
    """Tensors (CPU) as safetensors (no pickle), `metadata` as JSON in its header."""
    # One metadata key holding sorted JSON: safetensors stores the metadata map in hash order,
    # so several keys would make the file bytes (and their sha256) differ from run to run.
    # Serialised in memory and written by Python (not `save_file`, which writes from Rust): a full
    # disk then raises an OSError with its errno, which tasks.atomic reports naming the file.
    return serialize(tensors, metadata={"lockstep": json.dumps(metadata, sort_keys=True)})


def save_checkpoint(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, Any]) -> None:
    """Weights (a CPU state dict) as safetensors, metadata as JSON, written atomically."""
    write_bytes(path, checkpoint_bytes(state, metadata))


def read_safetensors(path: Path, tensors: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The lockstep metadata and (if `tensors`) the tensors of a safetensors file written here.

    Only safetensors is ever read: a pickle (`torch.save`, with or without a payload) renamed to
    .safetensors is refused by its header, before a byte of it is interpreted as Python objects.
    A truncated file is refused too (the header names more bytes than there are).
    """
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata() or {}
        loaded = load_file(str(path)) if tensors else {}
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: not a readable safetensors file (truncated, corrupt, or another format such "
            f"as a pickle, which is never loaded): {exc}"
        ) from None
    try:
        return json.loads(header["lockstep"]), loaded
    except (KeyError, ValueError):
        raise CheckpointError(f"{path}: not a lockstep checkpoint (no valid 'lockstep' metadata)") from None


def load_checkpoint(path: Path, data: Preprocessed | None = None) -> tuple[Classifier, dict[str, Any]]:
    """Rebuild a `Classifier` from a checkpoint written by `save_checkpoint`.

    With `data`, the checkpoint must have been trained on data like it (same classes, same
    normalisation): a model from another dataset is refused by name rather than scored on this one.
    """
    metadata, state = read_safetensors(path)
    if data is not None:
        for key, here in (("classes", data.classes), ("mean", data.mean), ("std", data.std)):
            if metadata.get(key) != here:
                raise CheckpointError(
                    f"{path}: trained on other data ({key} {metadata.get(key)!r}, the preprocessed "
                    f"data has {here!r}); run the train stage again"
                )
    try:
        model = build_model(metadata["model"], metadata["num_classes"], metadata["mean"], metadata["std"])
        model.load_state_dict(state)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"{path}: weights do not fit model {metadata.get('model')!r}: {str(exc).splitlines()[0]}"
        ) from None
    return model, metadata


@dataclass(frozen=True)
class Distributed:
    """This process's place in the job; a lone process is rank 0 of 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = "none"

    def all_reduce(self, values: list[float]) -> list[float]:
        """Sums over ranks (float64 on the CPU process group, NCCL tensors on GPUs)."""
        if self.world_size == 1:
            return values
        device = torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def minimum(self, value: float) -> float:
        """The smallest `value` over ranks."""
        if self.world_size == 1:
            return value
        device = torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")
        tensor = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return tensor.item()

    def share_buffers(self, model: nn.Module) -> None:
        """Give every rank rank 0's buffers (BatchNorm running stats), as the saved model has them.

        DDP broadcasts buffers at the start of each training forward, so after the last step each
        rank still holds the statistics of its own last batch.
        """
        if self.world_size > 1:
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)

    def gather(self, obj: Any) -> list[Any]:
        """`obj` from every rank, in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


def join_process_group(device_spec: str) -> tuple[Distributed, torch.device]:
    """Join the process group torchrun describes in the environment, or run alone.

    The backend follows the device: NCCL when each rank has a GPU, gloo on CPU.
    """
    device = resolve_device(device_spec)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Distributed(), device
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            store=_attempt_store(rank, world),
            rank=rank,
            world_size=world,
            device_id=device if device.type == "cuda" else None,
        )
    return Distributed(rank, world, local_rank, backend), device


def _attempt_store(rank: int, world: int) -> dist.Store:
    """The rendezvous store torchrun describes, with keys scoped to this restart attempt.

    With torch 2.14, ranks restarted by `--max-restarts` found the first attempt's keys in the
    agent's store and gloo dialled the dead ranks' addresses ("Connection refused"). A prefix
    per attempt (TORCHELASTIC_RESTART_COUNT) gives every attempt a clean namespace.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world, is_master=not agent_hosts_it and rank == 0)
    return dist.PrefixStore(f"lockstep/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


@dataclass(frozen=True)
class TrainResult:
    best_epoch: int
    best_val_accuracy: float
    final: dict[str, float]  # last epoch's train/val loss and accuracy
    device: str
    world_size: int
    backend: str
    amp: str
    resumed_from_epoch: int | None


def _autocast(amp: str, device: torch.device):
    if amp == "none":
        return nullcontext()
    if amp == "fp16" and device.type != "cuda":
        raise ValueError("train.amp: fp16 needs a CUDA device (use bf16 on CPU)")
    return torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def _run_epoch(
    model, batches, criterion, optimizer, scaler, autocast, device, ranks: Distributed, epoch: int
) -> tuple[float, float]:
    model.train()
    # Sums stay on the device and are read once per epoch: a per-step `.item()` would make the
    # host wait for every step's kernels on a GPU instead of queueing the next batch's.
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    # The first step whose loss was not finite, and that loss, recorded on the device (no sync).
    bad_step = torch.full((), -1, dtype=torch.int64, device=device)
    bad_loss = torch.zeros((), dtype=torch.float32, device=device)
    check_every = FINITE_CHECK_EVERY_CUDA if device.type == "cuda" else 1
    seen, step = 0, 0
    for step, (images, labels) in enumerate(batches, start=1):
        x, y = to_float(images, device), labels.to(device)
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            logits = model(x)
            loss = criterion(logits, y)
        first = (bad_step < 0) & ~torch.isfinite(loss.detach())
        bad_step = torch.where(first, step, bad_step)
        bad_loss = torch.where(first, loss.detach().float(), bad_loss)
        if step % check_every == 0:
            _stop_if_diverged(bad_step, bad_loss, epoch, ranks)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        loss_sum += loss.detach().double() * len(y)
        correct += (logits.argmax(1) == y).sum()
        seen += len(y)
    if step % check_every:
        _stop_if_diverged(bad_step, bad_loss, epoch, ranks)
    total_loss, total_correct, seen = ranks.all_reduce([loss_sum.item(), float(correct.item()), seen])
    return total_loss / seen, total_correct / seen


def _stop_if_diverged(bad_step: torch.Tensor, bad_loss: torch.Tensor, epoch: int, ranks: Distributed) -> None:
    """Raise `TrainingDiverged` on every rank if any rank has seen a NaN/inf loss this epoch.

    A collective under DDP (all ranks check at the same steps), so the ranks stop together instead
    of the healthy ones waiting forever for a gradient all-reduce the failed one never joins.
    """
    never = float(2**62)
    step = int(bad_step.item())
    first = ranks.minimum(step if step >= 0 else never)
    if first == never:
        return
    shown = f" ({bad_loss.item()})" if step == first else ""  # the rank that saw it knows the value
    raise TrainingDiverged(
        f"training diverged: the loss is not finite{shown} at epoch {epoch}, step {int(first)}; "
        f"nothing of epoch {epoch} was written, earlier checkpoints are kept. Lower train.lr, "
        "or check the data and its mean/std"
    )


def _train_loader(
    split: Preprocessed, cfg: TrainConfig, seed: int, ranks: Distributed, device: torch.device
) -> tuple[DistributedSampler, DataLoader]:
    dataset = ShiftedBatches(split, cfg.random_shift, seed)
    # The shuffle order is a function of (seed, epoch) alone, set through `set_epoch`, not of how
    # much the loader's generator has been drawn from; the same sampler shards it across ranks.
    sampler = DistributedSampler(dataset, num_replicas=ranks.world_size, rank=ranks.rank, shuffle=True, seed=seed)
    loader = DataLoader(
        dataset,
        batch_size=cfg.batch_size // ranks.world_size,
        sampler=sampler,
        num_workers=cfg.num_workers,
        persistent_workers=cfg.num_workers > 0,
        collate_fn=_whole_batches,
        pin_memory=device.type == "cuda",
        multiprocessing_context=_worker_context(cfg.num_workers),
        **loader_kwargs(seed),
    )
    return sampler, loader


def _limited(loader: DataLoader, max_batches: int | None):
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            return
        yield batch


@torch.no_grad()
def _validate(
    model: nn.Module, split: Preprocessed, label_smoothing: float, device: torch.device, ranks: Distributed
) -> tuple[float, float]:
    """Loss and accuracy over the whole split, each sample counted once: rank r takes r::world."""
    if len(split.labels) == 0:
        return float("nan"), float("nan")
    ranks.share_buffers(model)
    mine = slice(ranks.rank, None, ranks.world_size)
    logits = predict(model, split.images[mine], device, batch_size=1024)
    labels = torch.from_numpy(split.labels[mine])
    loss = nn.functional.cross_entropy(logits, labels, label_smoothing=label_smoothing, reduction="sum").item()
    loss_sum, correct, seen = ranks.all_reduce([loss, (logits.argmax(1) == labels).sum().item(), len(labels)])
    return loss_sum / seen, correct / seen


# --- resumable checkpoints ---------------------------------------------------------------------


# How a job is launched, not what it computes: two nodes x 1 process give the weights of one node x 2,
# and neither checkpoint cadence, restarts nor loader workers change a bit. Left out of the
# checkpoints' recorded config (and of the resume signature), so equal results are equal files.
LAUNCH_KEYS = frozenset(
    {"strategy", "nproc_per_node", "nnodes", "rdzv_endpoint", "max_restarts", "checkpoint_every", "num_workers"}
)


def result_config(cfg: TrainConfig) -> dict[str, Any]:
    """The train config that shapes the weights (everything but LAUNCH_KEYS)."""
    return cfg.model_dump(exclude=set(LAUNCH_KEYS))


def _signature(cfg: TrainConfig, seed: int, pre_dir: Path) -> str:
    """What a resume checkpoint must match: the config that shapes the result, the seed, the data."""
    # Not the world size: a checkpoint from another world size is refused by name, not ignored.
    shaping = result_config(cfg)
    digest = hashlib.sha256(json.dumps({"config": shaping, "seed": seed}, sort_keys=True).encode())
    for path in sorted(Path(pre_dir).iterdir()):
        with open(path, "rb") as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def _cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone().contiguous() for k, v in module.state_dict().items()}


def _save_resume(
    path: Path,
    ranks: Distributed,
    *,
    model: nn.Module,
    optimizer,
    scheduler,
    scaler,
    best: dict[str, torch.Tensor] | None,
    state: dict[str, Any],
) -> None:
    """Every rank contributes its RNG state; rank 0 writes the file atomically."""
    rng_states = ranks.gather(rng_state())
    if ranks.rank != 0:
        return
    tensors = {f"model.{k}": v for k, v in _cpu_state(model).items()}
    tensors.update({f"best.{k}": v for k, v in (best or {}).items()})
    optim = optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for index, values in optim["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    meta = {
        **state,
        "world_size": ranks.world_size,
        "rng": rng_states,
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "optim_groups": optim["param_groups"],
        "optim_scalars": scalars,
    }
    write_bytes(path, checkpoint_bytes(tensors, meta))


Resumed = tuple[dict[str, Any], dict[str, torch.Tensor]]  # (metadata, tensors) of a resume checkpoint


def _load_resume(path: Path, signature: str, ranks: Distributed) -> Resumed | None:
    """The checkpoint at `path` if it belongs to this run; refuses a different world size."""
    if not path.exists():
        return None
    # A corrupt or foreign file is an error, not a reason to start over silently: it may be the
    # only copy of a night's training (a disk error, a copy cut short) and deserves a look.
    meta, _ = read_safetensors(path, tensors=False)
    if meta.get("signature") != signature:
        log.warning("%s: from another config, seed or data; starting from scratch", path)
        return None
    if meta["world_size"] != ranks.world_size:
        raise CheckpointError(
            f"{path}: written by {meta['world_size']} process(es), this run has {ranks.world_size}; "
            "a different world size would not reproduce the run. Delete the file to start over, or "
            "resume with the same train.nproc_per_node x train.nnodes"
        )
    return meta, read_safetensors(path)[1]


def _restore_optimizer(optimizer, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    for index, values in meta["optim_scalars"].items():
        state.setdefault(int(index), {}).update(values)
    optimizer.load_state_dict({"state": state, "param_groups": meta["optim_groups"]})


def train(
    cfg: TrainConfig,
    seed: int,
    pre_dir: Path,
    out_dir: Path,
    run: StageRun | None = None,
    resume_dir: Path | None = None,
) -> TrainResult:
    """Train on `pre_dir`'s train split, select on val, write checkpoints to `out_dir`.

    Alone or as one rank of a torchrun job. With `resume_dir`, continue from the checkpoint there
    when it belongs to this config, seed and data. Assumes `tasks.determinism.pin_everything` was
    called (the stage runner and tasks/ddp.py do it).
    """
    run = run or StageRun()
    ranks, device = join_process_group(cfg.device)
    if cfg.sync_batchnorm and device.type != "cuda":
        raise ValueError("train.sync_batchnorm: torch's SyncBatchNorm runs on CUDA devices only; set it false on CPU")
    if cfg.batch_size % ranks.world_size:
        raise ValueError(
            f"train.batch_size {cfg.batch_size} is global and must divide by the {ranks.world_size} processes"
        )
    train_split, val_split = load_split(pre_dir, "train"), load_split(pre_dir, "val")
    model = build_model(cfg.model, len(train_split.classes), train_split.mean, train_split.std).to(device)
    optimizer, criterion = _make_optimizer(cfg, model), nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    scheduler = _make_scheduler(cfg, optimizer)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16")
    autocast = _autocast(cfg.amp, device)

    history: list[dict[str, float]] = []
    best_acc, best_epoch, best_state, start = -1.0, 0, None, 1
    signature = _signature(cfg, seed, pre_dir)
    resume_path = Path(resume_dir) / RESUME_FILE if resume_dir is not None else None
    resumed = _load_resume(resume_path, signature, ranks) if resume_path else None
    if resumed is not None:
        meta, tensors = resumed
        model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        _restore_optimizer(optimizer, meta, tensors)
        scheduler.load_state_dict(meta["scheduler"])
        scaler.load_state_dict(meta["scaler"])
        set_rng_state(meta["rng"][ranks.rank])
        history, best_acc, best_epoch = meta["history"], meta["best_acc"], meta["best_epoch"]
        best_state = {k[5:]: v for k, v in tensors.items() if k.startswith("best.")} or None
        start = meta["epoch"] + 1
        log.info("resuming from %s after epoch %d", resume_path, meta["epoch"])
        for row in history:  # the new run carries the whole curve
            run.log_metrics({k: v for k, v in row.items() if k != "epoch"}, step=row["epoch"])

    net: nn.Module = model
    if ranks.world_size > 1:
        if cfg.sync_batchnorm:
            net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
        net = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    sampler, loader = _train_loader(train_split, cfg, seed, ranks, device)
    metadata = {
        "model": cfg.model,
        "num_classes": len(train_split.classes),
        "classes": train_split.classes,
        "mean": train_split.mean,
        "std": train_split.std,
        "config": result_config(cfg),
        "seed": seed,
        "world_size": ranks.world_size,
    }
    main = ranks.rank == 0
    out_dir.mkdir(parents=True, exist_ok=True)
    bar = tqdm(range(start, cfg.epochs + 1), desc="train", unit="epoch", dynamic_ncols=True, disable=not main)
    for epoch in bar:
        sampler.set_epoch(epoch)
        batches = _limited(loader, cfg.max_batches)
        train_loss, train_acc = _run_epoch(net, batches, criterion, optimizer, scaler, autocast, device, ranks, epoch)
        scheduler.step()
        val_loss, val_acc = _validate(model, val_split, cfg.label_smoothing, device, ranks)
        row = {
            "epoch": epoch,
            "train_loss": train_loss,
            "train_accuracy": train_acc,
            "val_loss": val_loss,
            "val_accuracy": val_acc,
            "lr": scheduler.get_last_lr()[0],
        }
        history.append(row)
        run.log_metrics({k: v for k, v in row.items() if k != "epoch"}, step=epoch)
        bar.set_postfix(loss=f"{train_loss:.3f}", val_acc=f"{val_acc:.4f}")
        if val_acc > best_acc:
            best_acc, best_epoch, best_state = val_acc, epoch, _cpu_state(model)
        if resume_path is not None and (epoch % cfg.checkpoint_every == 0 or epoch == cfg.epochs):
            state = {
                "signature": signature,
                "epoch": epoch,
                "history": history,
                "best_acc": best_acc,
                "best_epoch": best_epoch,
            }
            _save_resume(
                resume_path,
                ranks,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                scaler=scaler,
                best=best_state,
                state=state,
            )

    if best_state is None:  # validation never scored (an empty split): the last weights are the best known
        best_state, best_epoch = _cpu_state(model), cfg.epochs
    final = {k: v for k, v in history[-1].items() if k != "epoch"}
    result = TrainResult(
        best_epoch=best_epoch,
        best_val_accuracy=best_acc,
        final=final,
        device=str(device),
        world_size=ranks.world_size,
        backend=ranks.backend,
        amp=cfg.amp,
        resumed_from_epoch=start - 1 if resumed else None,
    )
    if main:  # all four outputs replaced together: a kill or a full disk leaves the previous four
        best_meta = {**metadata, "epoch": best_epoch, "val_accuracy": best_acc}
        last = {**metadata, "epoch": cfg.epochs, "val_accuracy": history[-1]["val_accuracy"]}
        contents = {
            "best.safetensors": checkpoint_bytes(best_state, best_meta),
            "last.safetensors": checkpoint_bytes(_cpu_state(model), last),
            "history.json": (json.dumps(history, indent=2) + "\n").encode(),
            "train.json": (json.dumps(asdict(result), indent=2) + "\n").encode(),
        }
        with atomic_files([out_dir / name for name in contents]) as temporaries:
            for tmp, data in zip(temporaries, contents.values(), strict=True):
                tmp.write_bytes(data)
        if resume_path is not None:
            resume_path.unlink(missing_ok=True)  # finished: a later run starts fresh
    if ranks.world_size > 1:
        dist.barrier()  # no rank leaves (and no launcher reports success) before the files exist
    return result


def fine_tune(model: nn.Module, cfg: TrainConfig, seed: int, pre_dir: Path, epochs: int, lr: float) -> list[dict]:
    """`epochs` more epochs of the training loop on an already trained `model`, in this process.

    Pruning and quantization-aware training recover accuracy with it. Optimiser, batch size,
    augmentation and label smoothing follow `cfg`; the learning rate starts at `lr` and decays on
    a cosine. torch's RNG is re-seeded with `seed` first, so the result does not depend on what
    ran before in the process. Returns the per-epoch history (train and validation).
    """
    torch.manual_seed(seed)
    device, ranks = resolve_device(cfg.device), Distributed()
    train_split, val_split = load_split(pre_dir, "train"), load_split(pre_dir, "val")
    model.to(device)
    optimizer = _make_optimizer(cfg.model_copy(update={"lr": lr}), model)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    sampler, loader = _train_loader(train_split, cfg, seed, ranks, device)
    history = []
    for epoch in range(1, epochs + 1):
        sampler.set_epoch(epoch)
        batches = _limited(loader, cfg.max_batches)
        train_loss, train_acc = _run_epoch(
            model, batches, criterion, optimizer, scaler, nullcontext(), device, ranks, epoch
        )
        scheduler.step()
        val_loss, val_acc = _validate(model, val_split, cfg.label_smoothing, device, ranks)
        history.append(
            {
                "epoch": epoch,
                "train_loss": train_loss,
                "train_accuracy": train_acc,
                "val_loss": val_loss,
                "val_accuracy": val_acc,
            }
        )
    return history
