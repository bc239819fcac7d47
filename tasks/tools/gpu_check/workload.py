"""What the checks train: seeded synthetic CIFAR-shaped data, how much of it per device, and the
project's own training loop (tasks/train/loop.py) pinned by tasks/determinism/pinning.py."""

from __future__ import annotations

import hashlib
import typing
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tasks.core.config.train import TrainConfig
from tasks.data.preprocess import Preprocessed
from tasks.data.stats import channel_stats
from tasks.determinism.bootstrap import start
from tasks.determinism.threads import resolve
from tasks.train.checkpoints import checkpoint_bytes
from tasks.train.loop import Training, build_training

GROUPS = ("strict", "determinism", "throughput", "compress")
NUM_CLASSES, IMAGE_SHAPE = 10, (3, 32, 32)  # CIFAR-shaped
BENCH_MODEL = "resnet18"
COMPRESS_MODEL = "resnet9"  # the default train.model; compress measures it in ONNX Runtime on the CPU
MAX_COST = 1.3  # CUDA target: pinned time / fast time per image (README benchmark B8)
# The CPU leaves out qat_int8: ~9 s on 2 cores, and tests/ship/test_compress_export.py builds it on the CPU
# already; what is new here is fine-tuning on the GPU. Both fine-tune (pruned_l1 and qat_int8) on CUDA.
DEFAULT_VARIANTS = {"cuda": ("static_int8", "pruned_l1", "qat_int8"), "cpu": ("static_int8", "pruned_l1")}


@dataclass(frozen=True)
class Sizes:
    """How much each check does; the CPU's are small enough for a 2-core CI machine."""

    batch_size: int  # strict and determinism steps
    steps: int  # optimiser steps per determinism run
    bench_batch: int
    bench_steps: int  # optimiser steps per timed run
    bench_runs: int  # timed runs per mode; the median is reported
    bench_warmup: int  # untimed runs per mode first (cudnn.benchmark searches its kernels here)
    compress_images: int  # synthetic dataset for the compress/export checkpoint (70/15/15 split)
    compress_epochs: int
    compress_batch: int


SIZES = {
    "cuda": Sizes(
        batch_size=128,
        steps=20,
        bench_batch=512,
        bench_steps=20,
        bench_runs=5,
        bench_warmup=2,
        compress_images=4000,
        compress_epochs=3,
        compress_batch=128,
    ),
    "cpu": Sizes(
        batch_size=8,
        steps=2,
        bench_batch=4,
        bench_steps=1,
        bench_runs=3,
        bench_warmup=1,
        compress_images=400,
        compress_epochs=1,
        compress_batch=32,
    ),
}


@dataclass(frozen=True)
class CheckOptions:
    device: str = "cuda"  # "cuda", "cuda:N" or "cpu"
    sizes: Sizes = SIZES["cuda"]
    seed: int = 42
    threads: int = field(default_factory=lambda: resolve("auto"))
    groups: tuple[str, ...] = GROUPS
    # the models checked; empty: strict mode steps every model of MODELS, and determinism trains every
    # model on CUDA, COMPRESS_MODEL on the CPU
    models: tuple[str, ...] = ()
    variants: tuple[str, ...] = DEFAULT_VARIANTS["cuda"]  # compress.variants to build
    max_cost: float = MAX_COST


# Our own model and one of each torchvision family `train.model` adapts: the zoo has hundreds.
MODELS = ("resnet9", "small_cnn", "resnet18", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny")
MODELS += ("regnet_x_400mf",)


def synthetic_images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`n` seeded CIFAR-shaped uint8 images (N, H, W, C) and labels: per class a coarse random
    template, plus per-image noise, so a few epochs learn something (compress/export accuracy is then
    a number, not chance)."""
    rng = np.random.default_rng(seed)
    channels, height, width = IMAGE_SHAPE
    templates = rng.integers(0, 256, (NUM_CLASSES, height // 8, width // 8, channels), dtype=np.uint16)
    templates = templates.repeat(8, axis=1).repeat(8, axis=2)
    labels = np.arange(n, dtype=np.int64) % NUM_CLASSES
    rng.shuffle(labels)
    noise = rng.integers(0, 256, (n, height, width, channels), dtype=np.uint16)
    return ((3 * templates[labels] + noise) // 4).astype(np.uint8), labels


def synthetic_split(n: int, seed: int) -> Preprocessed:
    """An in-memory training split as the preprocess stage would load it (mean/std by tasks/data/stats.py)."""
    images, labels = synthetic_images(n, seed)
    stats = channel_stats([images])
    chw = np.ascontiguousarray(images.transpose(0, 3, 1, 2))
    return Preprocessed(chw, labels, [str(i) for i in range(NUM_CLASSES)], stats.mean, stats.std)


def choices(name: str) -> tuple[str, ...]:
    """The values a `train.<name>` Literal field accepts, from the config itself."""
    return typing.get_args(TrainConfig.model_fields[name].annotation)


def train_config(options: CheckOptions, **values: Any) -> TrainConfig:
    base = {"device": options.device, "epochs": 1, "num_workers": 0, "scheduler": "none"}
    return TrainConfig(**{**base, **values})


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of tensors as the train stage saves them (safetensors bytes, CPU, no metadata)."""
    return hashlib.sha256(
        checkpoint_bytes({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, {})
    ).hexdigest()


def pin(options: CheckOptions) -> dict[str, Any]:
    """This process pinned as a stage pins its own (strict), in the CPU mode it was started in: the
    first call of each case, so that none depends on what ran before it; the settings in force."""
    return start(options.seed, options.threads, strict=True)


def trained(options: CheckOptions, cfg: TrainConfig, split: Preprocessed) -> tuple[Training, str]:
    """Pin everything (strict), build the project's training loop and run `cfg.max_batches` steps.

    Returns the loop and the sha256 of its parameters before the first step.
    """
    pin(options)
    training = build_training(cfg, options.seed, split, torch.device(options.device))
    initial = digest(dict(training.model.named_parameters()))
    training.train_epoch(1)
    return training, initial
