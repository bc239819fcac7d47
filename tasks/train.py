"""Stage 4 — train: fit the model `train.model` names on the preprocessed training split.

Outputs (`artifacts/train/`): `best.safetensors` (best validation accuracy) and
`last.safetensors` (final epoch) — weights only, loadable without unpickling code, with the
resolved config and epoch in the safetensors metadata — and `history.json` (per-epoch loss and
accuracy, also a DVC plot).

Data path: the split sits in memory as uint8 tensors; the DataLoader fetches whole batches
(`__getitems__`), workers apply the random shift, and the model normalises on the device. No
per-sample Python work, no PIL.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm.auto import tqdm

from tasks.atomic import atomic_file, write_text
from tasks.config import TrainConfig
from tasks.determinism import loader_kwargs
from tasks.models import Classifier, build_model
from tasks.preprocess import Preprocessed, load_split
from tasks.tracking import StageRun


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
    outputs = [model(to_float(torch.from_numpy(images[i : i + batch_size]), device)).cpu()
               for i in range(0, len(images), batch_size)]
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


def save_checkpoint(model: nn.Module, path: Path, metadata: dict[str, Any]) -> None:
    """Weights as safetensors (no pickle), metadata as JSON strings, written atomically."""
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    # One metadata key holding sorted JSON: safetensors stores the metadata map in hash order,
    # so several keys would make the file bytes (and their sha256) differ from run to run.
    header = {"lockstep": json.dumps(metadata, sort_keys=True)}
    with atomic_file(path) as tmp:
        save_file(state, str(tmp), metadata=header)


def load_checkpoint(path: Path) -> tuple[Classifier, dict[str, Any]]:
    """Rebuild a `Classifier` from a checkpoint written by `save_checkpoint`."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        header = handle.metadata() or {}
    if "lockstep" not in header:
        raise ValueError(f"{path}: not a lockstep checkpoint (no 'lockstep' metadata)")
    metadata = json.loads(header["lockstep"])
    model = build_model(metadata["model"], metadata["num_classes"], metadata["mean"], metadata["std"])
    try:
        model.load_state_dict(load_file(str(path)))
    except RuntimeError as exc:
        raise ValueError(f"{path}: weights do not fit model {metadata['model']!r}: {exc}") from None
    return model, metadata


@dataclass(frozen=True)
class TrainResult:
    best_epoch: int
    best_val_accuracy: float
    final: dict[str, float]  # last epoch's train/val loss and accuracy
    device: str


def _run_epoch(model, loader, criterion, optimizer, device) -> tuple[float, float]:
    model.train()
    loss_sum, correct, seen = 0.0, 0, 0
    for images, labels in loader:
        x, y = to_float(images, device), labels.to(device)
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        loss = criterion(logits, y)
        loss.backward()
        optimizer.step()
        loss_sum += loss.item() * len(y)
        correct += (logits.argmax(1) == y).sum().item()
        seen += len(y)
    return loss_sum / seen, correct / seen


def _limited(loader: DataLoader, max_batches: int | None):
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            return
        yield batch


def train(cfg: TrainConfig, seed: int, pre_dir: Path, out_dir: Path, run: StageRun | None = None) -> TrainResult:
    """Train on `pre_dir`'s train split, select on val, write checkpoints to `out_dir`.

    Assumes `tasks.determinism.pin_everything` was called (the stage runner does it).
    """
    run = run or StageRun()
    device = resolve_device(cfg.device)
    train_split, val_split = load_split(pre_dir, "train"), load_split(pre_dir, "val")
    model = build_model(cfg.model, len(train_split.classes), train_split.mean, train_split.std).to(device)
    optimizer, criterion = _make_optimizer(cfg, model), nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    scheduler = _make_scheduler(cfg, optimizer)
    dataset = ShiftedBatches(train_split, cfg.random_shift, seed)
    # The shuffle order is a function of (seed, epoch) alone, set through `set_epoch`, not of how
    # much the loader's generator has been drawn from (that differs with persistent workers). The
    # same sampler shards the data across ranks under DDP; a single process is rank 0 of 1.
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
    loader = DataLoader(
        dataset, batch_size=cfg.batch_size, sampler=sampler,
        num_workers=cfg.num_workers, persistent_workers=cfg.num_workers > 0, collate_fn=_whole_batches,
        pin_memory=device.type == "cuda", multiprocessing_context=_worker_context(cfg.num_workers),
        **loader_kwargs(seed),
    )  # fmt: skip
    metadata = {"model": cfg.model, "num_classes": len(train_split.classes), "classes": train_split.classes,
                "mean": train_split.mean, "std": train_split.std, "config": cfg.model_dump(), "seed": seed}
    history: list[dict[str, float]] = []
    best_acc, best_epoch = -1.0, 0
    out_dir.mkdir(parents=True, exist_ok=True)
    bar = tqdm(range(1, cfg.epochs + 1), desc="train", unit="epoch", dynamic_ncols=True)
    for epoch in bar:
        sampler.set_epoch(epoch)
        train_loss, train_acc = _run_epoch(model, _limited(loader, cfg.max_batches), criterion, optimizer, device)
        scheduler.step()
        val_loss, val_acc = _evaluate(model, val_split, criterion, device)
        row = {"epoch": epoch, "train_loss": train_loss, "train_accuracy": train_acc, "val_loss": val_loss,
               "val_accuracy": val_acc, "lr": scheduler.get_last_lr()[0]}
        history.append(row)
        run.log_metrics({k: v for k, v in row.items() if k != "epoch"}, step=epoch)
        bar.set_postfix(loss=f"{train_loss:.3f}", val_acc=f"{val_acc:.4f}")
        if val_acc > best_acc:
            best_acc, best_epoch = val_acc, epoch
            save_checkpoint(model, out_dir / "best.safetensors", {**metadata, "epoch": epoch, "val_accuracy": val_acc})
    last = {**metadata, "epoch": cfg.epochs, "val_accuracy": history[-1]["val_accuracy"]}
    save_checkpoint(model, out_dir / "last.safetensors", last)
    write_text(out_dir / "history.json", json.dumps(history, indent=2) + "\n")
    final = {k: v for k, v in history[-1].items() if k != "epoch"}
    result = TrainResult(best_epoch=best_epoch, best_val_accuracy=best_acc, final=final, device=str(device))
    write_text(out_dir / "train.json", json.dumps(asdict(result), indent=2) + "\n")
    return result


@torch.no_grad()
def _evaluate(model: nn.Module, split: Preprocessed, criterion: nn.Module, device: torch.device) -> tuple[float, float]:
    if len(split.labels) == 0:
        return float("nan"), float("nan")
    logits = predict(model, split.images, device, batch_size=1024)
    labels = torch.from_numpy(split.labels)
    return criterion(logits, labels).item(), (logits.argmax(1) == labels).float().mean().item()
