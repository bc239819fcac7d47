"""`python -m tasks.tools.gpu_check`: prove "single GPU, cuDNN pinned" on a machine, in one run and one table.

Not a pipeline stage (dvc.yaml does not list it): run it once on each new kind of machine, the first
time on a GPU. It needs torch, torchvision, numpy, pydantic, pyyaml and safetensors only; compress and
export also need onnx, onnxruntime and onnxscript (torchao for qat_int8) and are reported as skipped,
with the wheel to carry, where they are missing. It never imports MLflow, DVC or Prefect: a bare CUDA
machine has none of them.

Checks, on `--device cuda` (default) or `--device cpu` (smaller sizes; what CI runs):

1. strict: one training step of every `train.model` x `train.optimizer` choice (read from
   tasks/core/config.py, so a new model is covered by itself) under `torch.use_deterministic_algorithms(True)`;
   an op without a deterministic kernel is a FAIL row naming the op, and the other rows still run;
2. determinism: the same training twice, pinned by tasks/determinism/pinning.py, weights compared by sha256,
   in fp32, bf16 autocast and fp16 with a GradScaler (CUDA only; "n/a on cpu");
3. throughput: resnet18 on CIFAR-shaped data, images/s of the project's loop pinned vs with
   `cudnn.benchmark` and nondeterministic kernels allowed (target: pinning costs <= 1.3x on CUDA), and
   vs a plain hand-written loop; warm-up first, medians of timed runs, synchronised;
4. compress and export (tasks/ship/compress.py, tasks/ship/export.py) from a checkpoint trained on the device.

The data is synthetic and seeded: CIFAR-shaped uint8 images (3x32x32, 10 classes), each a class
template plus noise, so that training learns something. Exit codes: 0 every check that ran passed,
1 a check failed, 2 bad arguments (`--device cuda` without a CUDA device).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import typing
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tasks.core.atomic import write_text
from tasks.core.cli import exit_code
from tasks.core.config import CompressConfig, DeterminismConfig, ExportConfig, TrainConfig, Variant
from tasks.data.preprocess import Preprocessed
from tasks.data.stats import channel_stats
from tasks.determinism.pinning import CUBLAS_WORKSPACE_CONFIG, pin_everything
from tasks.train.checkpoints import checkpoint_bytes, checkpoint_metadata, cpu_state
from tasks.train.loop import Training, build_training

PASS, FAIL, SKIPPED, NA, REPORT = "pass", "FAIL", "skipped", "n/a", "report"
GROUPS = ("strict", "determinism", "throughput", "compress")
EXIT_OK, EXIT_FAILED, EXIT_BAD_ARGS = 0, 1, 2
NUM_CLASSES, IMAGE_SHAPE = 10, (3, 32, 32)  # CIFAR-shaped
BENCH_MODEL = "resnet18"
COMPRESS_MODEL = "resnet9"  # the default train.model; compress measures it in ONNX Runtime on the CPU
MAX_COST = 1.3  # CUDA target: pinned time / fast time per image (README benchmark B8)
DEFAULT_JSON = Path("artifacts") / "gpu-check.json"
# torch.onnx.export (dynamo) needs onnxscript; the compress stage needs ONNX Runtime and onnx.
COMPRESS_NEEDS = ("onnx", "onnxruntime", "onnxscript")
VARIANT_NEEDS = {"qat_int8": "torchao", "pruned_ln": "torch_pruning"}
FINE_TUNED = {"qat_int8", "pruned_l1", "pruned_ln"}  # variants that train on train.device (the GPU)
# The CPU leaves out qat_int8: ~9 s on 2 cores, and tests/ship/test_compress_export.py builds it on the CPU
# already; what is new here is fine-tuning on the GPU. Both fine-tune (pruned_l1 and qat_int8) on CUDA.
DEFAULT_VARIANTS = {"cuda": ("static_int8", "pruned_l1", "qat_int8"), "cpu": ("static_int8", "pruned_l1")}
# torch's messages when strict mode refuses an op: "<op> does not have a deterministic implementation"
# and cuBLAS's "... set an environment variable ... CUBLAS_WORKSPACE_CONFIG".
_NONDETERMINISTIC_OP = re.compile(r"(\S+) does not have a deterministic implementation")


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
    threads: int = DeterminismConfig().num_threads
    groups: tuple[str, ...] = GROUPS
    determinism_models: tuple[str, ...] = ()  # empty: every model of MODELS on CUDA, COMPRESS_MODEL on the CPU
    variants: tuple[str, ...] = DEFAULT_VARIANTS["cuda"]  # compress.variants to build
    max_cost: float = MAX_COST


@dataclass(frozen=True)
class Check:
    group: str
    name: str
    status: str  # pass | FAIL | skipped | n/a | report (measured, no target on this device)
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)


@dataclass
class GpuCheckReport:
    device: dict[str, Any]
    versions: dict[str, str]
    determinism: dict[str, Any]  # the pinned settings (tasks/determinism/pinning.py) the checks ran under
    options: dict[str, Any]
    checks: list[Check]
    group_seconds: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def failed(self) -> bool:
        return any(check.status == FAIL for check in self.checks)

    def to_json(self) -> str:
        counts = {status: sum(c.status == status for c in self.checks) for status in (PASS, FAIL, SKIPPED, NA, REPORT)}
        return json.dumps({**asdict(self), "passed": not self.failed, "counts": counts}, indent=2) + "\n"

    def table(self) -> str:
        """The report as plain text (no rich: a bare machine may not have it)."""
        rows = [("group", "check", "status", "detail")] + [(c.group, c.name, c.status, c.detail) for c in self.checks]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [
            f"lockstep gpu-check: {self.device['summary']}; torch {self.versions['torch']}; "
            f"CPU threads: {self.determinism.get('num_threads')}; {self.wall_s:.1f} s",
            *("  ".join([*(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)), row[3]]) for row in rows),
        ]
        counts = ", ".join(f"{sum(c.status == s for c in self.checks)} {s}" for s in (PASS, FAIL, SKIPPED, NA, REPORT))
        lines.append(f"result: {'FAILED' if self.failed else 'ok'} ({counts})")
        return "\n".join(lines)


def run_checks(options: CheckOptions, on_check: Callable[[Check], None] | None = None) -> GpuCheckReport:
    """Run the checks in `options.groups` on `options.device`; each finished row also goes to `on_check`."""
    started = time.perf_counter()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)  # before CUDA starts
    device = torch.device(options.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # autocast, empty_cache and friends act on the current device
    report = GpuCheckReport(
        device=_device_info(device),
        versions=_versions(),
        determinism=pin_everything(options.seed, options.threads, True),
        options={**asdict(options), "groups": list(options.groups)},
        checks=[],
    )
    steps: dict[str, Callable[[CheckOptions], Iterator[Check]]] = {
        "strict": _strict_checks,
        "determinism": _determinism_checks,
        "throughput": _throughput_checks,
        "compress": _compress_export_checks,
    }
    for group in options.groups:
        group_started = time.perf_counter()
        for check in _guarded(group, steps[group](options)):
            report.checks.append(check)
            if on_check is not None:
                on_check(check)
        _release(device)
        report.group_seconds[group] = round(time.perf_counter() - group_started, 2)
    report.wall_s = time.perf_counter() - started
    return report


def _guarded(group: str, checks: Iterator[Check]) -> Iterator[Check]:
    """`checks`, and a FAIL row instead of a crash if the check code itself breaks (another torch
    version on the GPU machine): the rows before it and the other groups still count."""
    try:
        yield from checks
    except Exception as exc:
        yield Check(group, "(check code)", FAIL, f"the check itself failed: {_describe(exc)}")


# --- what the machine is -------------------------------------------------------------------------


def _device_info(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        cpu = _cpu_model()
        capability = torch.backends.cpu.get_cpu_capability()
        return {
            "type": "cpu",
            "cpu": cpu,
            "cpu_capability": capability,
            "cores": os.cpu_count(),
            "summary": f"cpu ({cpu}, {capability} kernels, {os.cpu_count()} cores)",
        }
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    major, minor = torch.cuda.get_device_capability(index)
    info = {
        "type": "cuda",
        "index": index,
        "name": props.name,
        "compute_capability": f"{major}.{minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "count": torch.cuda.device_count(),
        "driver": _nvidia_driver(),
        "cuda_driver_api": _cuda_driver_api(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "nccl": _nccl_version(),
        "cpu": _cpu_model(),
    }
    info["summary"] = (
        f"{props.name} (sm {major}.{minor}, driver {info['driver']}, CUDA {info['cuda']}, "
        f"cuDNN {info['cudnn']}, NCCL {info['nccl']})"
    )
    return info


def _nccl_version() -> str:
    try:
        version = torch.cuda.nccl.version()
    except Exception as exc:  # a build without NCCL
        return f"unknown ({type(exc).__name__})"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_driver() -> str:
    """The driver version as nvidia-smi prints it; torch itself does not expose it."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown (no nvidia-smi)"
    try:
        done = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else "unknown"


def _cuda_driver_api() -> str:
    """The CUDA version the driver supports (cuDriverGetVersion), e.g. 12.8."""
    import ctypes

    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"{version.value // 1000}.{version.value % 1000 // 10}"
    except (OSError, AttributeError):
        pass
    return "unknown"


def _versions() -> dict[str, str]:
    import torchvision

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "numpy": np.__version__,
    }


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# --- data and training ---------------------------------------------------------------------------


def _synthetic_images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
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


def _split(n: int, seed: int) -> Preprocessed:
    """An in-memory training split as the preprocess stage would load it (mean/std by tasks/data/stats.py)."""
    images, labels = _synthetic_images(n, seed)
    stats = channel_stats([images])
    chw = np.ascontiguousarray(images.transpose(0, 3, 1, 2))
    return Preprocessed(chw, labels, [str(i) for i in range(NUM_CLASSES)], stats.mean, stats.std)


def _choices(name: str) -> tuple[str, ...]:
    """The values a `train.<name>` Literal field accepts, from the config itself."""
    return typing.get_args(TrainConfig.model_fields[name].annotation)


# Our own model and one of each torchvision family `train.model` adapts: the zoo has hundreds.
MODELS = ("resnet9", "small_cnn", "resnet18", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny")
MODELS += ("regnet_x_400mf",)


def _train_config(options: CheckOptions, **values: Any) -> TrainConfig:
    base = {"device": options.device, "epochs": 1, "num_workers": 0, "scheduler": "none"}
    return TrainConfig(**{**base, **values})


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of tensors as the train stage saves them (safetensors bytes, CPU, no metadata)."""
    return hashlib.sha256(
        checkpoint_bytes({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, {})
    ).hexdigest()


def _trained(options: CheckOptions, cfg: TrainConfig, split: Preprocessed) -> tuple[Training, str]:
    """Pin everything (strict), build the project's training loop and run `cfg.max_batches` steps.

    Returns the loop and the sha256 of its parameters before the first step.
    """
    pin_everything(options.seed, options.threads, True)
    training = build_training(cfg, options.seed, split, torch.device(options.device))
    initial = _digest(dict(training.model.named_parameters()))
    training.train_epoch(1)
    return training, initial


def _describe(exc: BaseException) -> str:
    """One line: the op strict mode refused, or the error's first line."""
    text = str(exc).strip()
    match = _NONDETERMINISTIC_OP.search(text)
    if match:
        return f"strict mode refused {match.group(1)} (no deterministic implementation)"
    if "CUBLAS_WORKSPACE_CONFIG" in text:
        return "strict mode refused a cuBLAS call: CUBLAS_WORKSPACE_CONFIG was not set before CUDA started"
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:400]


# --- 1. strict mode: every model x optimiser -----------------------------------------------------


def _strict_checks(options: CheckOptions) -> Iterator[Check]:
    sizes = options.sizes
    split = _split(sizes.batch_size, options.seed)
    for model in MODELS:
        for optimizer in _choices("optimizer"):
            cfg = _train_config(options, model=model, optimizer=optimizer, batch_size=sizes.batch_size, max_batches=1)
            numbers = {"model": model, "optimizer": optimizer, "batch_size": sizes.batch_size, "steps": 1}
            try:
                _trained(options, cfg, split)
            except Exception as exc:  # reported as a row: the other models and optimisers still run
                yield Check("strict", f"{model}/{optimizer}", FAIL, _describe(exc), numbers)
                continue
            detail = f"1 step, batch {sizes.batch_size}, use_deterministic_algorithms(True): no op refused"
            yield Check("strict", f"{model}/{optimizer}", PASS, detail, numbers)


# --- 2. determinism: same weights twice, per precision -------------------------------------------

PRECISIONS = {"fp32": "none", "bf16": "bf16", "fp16": "fp16"}  # row label -> train.amp


def _determinism_checks(options: CheckOptions) -> Iterator[Check]:
    sizes = options.sizes
    on_cuda = torch.device(options.device).type == "cuda"
    models = options.determinism_models or (MODELS if on_cuda else (COMPRESS_MODEL,))
    split = _split(sizes.batch_size * sizes.steps, options.seed)
    for model in models:
        for label, amp in PRECISIONS.items():
            name = f"{model} {label}"
            if amp == "fp16" and not on_cuda:
                yield Check("determinism", name, NA, "n/a on cpu: fp16 with a GradScaler needs CUDA")
                continue
            cfg = _train_config(options, model=model, amp=amp, batch_size=sizes.batch_size, max_batches=sizes.steps)
            yield _twice(options, cfg, split, name)


def _twice(options: CheckOptions, cfg: TrainConfig, split: Preprocessed, name: str) -> Check:
    numbers: dict[str, Any] = {
        "model": cfg.model,
        "amp": cfg.amp,
        "batch_size": cfg.batch_size,
        "steps": cfg.max_batches,
    }
    try:
        first, initial = _trained(options, cfg, split)
        first_sha = _digest(cpu_state(first.model))
        changed = _digest(dict(first.model.named_parameters())) != initial
        scale = first.scaler.get_scale() if first.scaler.is_enabled() else None
        del first
        second, _ = _trained(options, cfg, split)
        second_sha = _digest(cpu_state(second.model))
    except Exception as exc:
        return Check("determinism", name, FAIL, _describe(exc), numbers)
    numbers.update(sha256=[first_sha, second_sha], equal=first_sha == second_sha, weights_changed=changed)
    if scale is not None:
        numbers["grad_scale"] = scale
    runs = f"2 runs x {cfg.max_batches} steps, batch {cfg.batch_size}"
    if not changed:  # equal hashes of untouched weights would prove nothing (a GradScaler skipping every step)
        return Check("determinism", name, FAIL, f"no step changed the weights ({runs}): nothing compared", numbers)
    if first_sha != second_sha:
        return Check(
            "determinism", name, FAIL, f"weights differ: {first_sha[:12]} vs {second_sha[:12]} ({runs})", numbers
        )
    return Check("determinism", name, PASS, f"equal weights sha256 {first_sha[:12]} ({runs})", numbers)


# --- 3. throughput: pinned vs fast vs a plain loop -----------------------------------------------


class _PlainLoop:
    """A minimal hand-written training loop (torchvision resnet18 with the same CIFAR stem, SGD, batches
    sliced from a shuffled order): nothing of the project, the baseline its loop is compared with."""

    def __init__(self, split: Preprocessed, batch_size: int, device: torch.device, seed: int) -> None:
        from torchvision.models import resnet18

        torch.manual_seed(seed)
        model = resnet18(weights=None, num_classes=NUM_CLASSES)
        model.conv1 = nn.Conv2d(IMAGE_SHAPE[0], 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
        self.model = model.to(device)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        self.images, self.labels = torch.from_numpy(split.images), torch.from_numpy(split.labels)
        self.mean = torch.tensor(split.mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(split.std, device=device).view(1, -1, 1, 1)
        self.batch_size, self.device = batch_size, device
        self.generator = torch.Generator().manual_seed(seed)

    def run(self, steps: int) -> None:
        self.model.train()
        order = torch.randperm(len(self.labels), generator=self.generator)
        for step in range(steps):
            index = order[step * self.batch_size : (step + 1) * self.batch_size]
            x = (self.images[index].to(self.device).float() / 255.0 - self.mean) / self.std
            loss = nn.functional.cross_entropy(self.model(x), self.labels[index].to(self.device))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()


def _set_pinned(options: CheckOptions, pinned: bool) -> None:
    """Pinned: tasks/determinism/pinning.py's settings. Fast: nondeterministic kernels allowed and cuDNN's
    autotuner on; TF32 stays off in both, so the ratio is the price of determinism alone."""
    if pinned:
        pin_everything(options.seed, options.threads, True)
        return
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False
    torch.backends.cudnn.benchmark = True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(options: CheckOptions) -> dict[str, float]:
    """Median seconds per timed run of each mode; the modes take turns, run by run, so a slow patch of
    the machine lands on all of them alike."""
    sizes, device = options.sizes, torch.device(options.device)
    split = _split(sizes.bench_batch * sizes.bench_steps, options.seed)
    cfg = _train_config(options, model=BENCH_MODEL, batch_size=sizes.bench_batch, max_batches=sizes.bench_steps)
    pin_everything(options.seed, options.threads, True)
    pinned, fast = (build_training(cfg, options.seed, split, device) for _ in range(2))
    plain = _PlainLoop(split, sizes.bench_batch, device, options.seed)
    modes = {
        "pinned": (True, pinned.train_epoch),
        "fast": (False, fast.train_epoch),
        "plain": (True, lambda epoch: plain.run(sizes.bench_steps)),
    }
    times: dict[str, list[float]] = {name: [] for name in modes}
    for round_ in range(sizes.bench_warmup + sizes.bench_runs):
        for name, (pin, run) in modes.items():
            _set_pinned(options, pin)
            _sync(device)
            start = time.perf_counter()
            run(round_ + 1)
            _sync(device)
            if round_ >= sizes.bench_warmup:
                times[name].append(time.perf_counter() - start)
    pin_everything(options.seed, options.threads, True)
    return {name: float(np.median(values)) for name, values in times.items()}


def _throughput_checks(options: CheckOptions) -> Iterator[Check]:
    sizes = options.sizes
    try:
        seconds = _median_seconds(options)
    except Exception as exc:
        yield Check("throughput", BENCH_MODEL, FAIL, _describe(exc))
        return
    images = sizes.bench_batch * sizes.bench_steps
    ips = {name: images / s for name, s in seconds.items()}
    runs = f"batch {sizes.bench_batch} x {sizes.bench_steps} steps, median of {sizes.bench_runs}"
    cost = ips["fast"] / ips["pinned"]
    on_cuda = torch.device(options.device).type == "cuda"
    status = (PASS if cost <= options.max_cost else FAIL) if on_cuda else REPORT
    target = f"target <= {options.max_cost}x" + ("" if on_cuda else " on CUDA")
    numbers = {"images_per_s": ips, "seconds_per_run": seconds, "batch_size": sizes.bench_batch}
    numbers.update(steps_per_run=sizes.bench_steps, runs=sizes.bench_runs, warmup=sizes.bench_warmup)
    overhead = ips["plain"] / ips["pinned"]
    yield from [
        Check(
            "throughput",
            f"{BENCH_MODEL} pinned vs fast",
            status,
            f"{ips['pinned']:.1f} vs {ips['fast']:.1f} img/s: pinning costs {cost:.2f}x ({target}; {runs})",
            {**numbers, "cost": cost, "max_cost": options.max_cost},
        ),
        Check(
            "throughput",
            f"{BENCH_MODEL} project vs plain",
            REPORT,
            f"{ips['pinned']:.1f} vs {ips['plain']:.1f} img/s: project loop takes {overhead:.2f}x a plain loop's "
            f"time (both pinned; {runs})",
            {**numbers, "project_over_plain": overhead},
        ),
    ]


# --- 4. compress and export from a checkpoint trained here ---------------------------------------


def _missing(modules: tuple[str, ...]) -> list[str]:
    return [name for name in modules if importlib.util.find_spec(name) is None]


def _skipped_because(missing: list[str]) -> str:
    names = ", ".join(missing)
    return f"skipped: {names} not installed (carry {'its wheel' if len(missing) == 1 else 'their wheels'})"


def _unavailable(variant: str) -> str | None:
    """The module `variant` needs beyond COMPRESS_NEEDS when it is not installed, else None."""
    needs = VARIANT_NEEDS.get(variant)
    return needs if needs and _missing((needs,)) else None


def _compress_export_checks(options: CheckOptions) -> Iterator[Check]:
    variants = [variant for variant in options.variants if _unavailable(variant) is None]
    # what ships: static_int8 (the params.yaml default) when it is built, else the first variant, else fp32
    shipped = "static_int8" if "static_int8" in variants else (variants or ["fp32"])[0]
    missing = _missing(COMPRESS_NEEDS)
    if missing:
        why = _skipped_because(missing)
        yield from [Check("compress", COMPRESS_MODEL, SKIPPED, why), Check("export", shipped, SKIPPED, why)]
        return
    for variant in options.variants:
        needs = _unavailable(variant)
        if needs:
            yield Check("compress", variant, SKIPPED, _skipped_because([needs]))
    with tempfile.TemporaryDirectory(prefix="lockstep-gpu-check-") as tmp:
        work = Path(tmp)
        try:
            train_cfg = _checkpoint(options, work)
        except Exception as exc:
            yield Check("compress", COMPRESS_MODEL, FAIL, f"training the checkpoint: {_describe(exc)}")
            yield Check("export", shipped, SKIPPED, "skipped: no checkpoint")
            return
        compressed = _compress(options, train_cfg, tuple(variants), work)
        yield compressed
        if compressed.status != PASS:
            yield Check("export", shipped, SKIPPED, "skipped: compress failed")
            return
        yield _export(options, shipped, work)


def _checkpoint(options: CheckOptions, work: Path) -> TrainConfig:
    """Synthetic raw data through the real stats and preprocess code, a checkpoint trained on the device
    as the train stage writes it, and the test accuracy the export's model card quotes.

    Layout under `work`: data/, preprocessed/, train/best.safetensors, evaluate/metrics.json.
    """
    from tasks.core.atomic import write_bytes
    from tasks.core.config import SplitConfig
    from tasks.data.formats import RawDataset, write_raw
    from tasks.data.preprocess import load_split, preprocess
    from tasks.data.stats import compute_stats
    from tasks.train.models import predict

    sizes, split_cfg, device = options.sizes, SplitConfig(), torch.device(options.device)
    images, labels = _synthetic_images(sizes.compress_images, options.seed)
    write_raw(RawDataset(images, labels, [str(i) for i in range(NUM_CLASSES)], "synthetic"), work / "data")
    stats = compute_stats(work / "data", split_cfg, options.seed, chunk_size=4096)
    preprocess(work / "data", stats, split_cfg, options.seed, work / "preprocessed")
    train, val, test = (load_split(work / "preprocessed", name) for name in ("train", "val", "test"))
    cfg = _train_config(
        options, model=COMPRESS_MODEL, epochs=sizes.compress_epochs, batch_size=sizes.compress_batch, scheduler="cosine"
    )
    pin_everything(options.seed, options.threads, True)
    training = build_training(cfg, options.seed, train, device)
    history = [training.epoch(epoch, val) for epoch in range(1, cfg.epochs + 1)]
    metadata = {
        **checkpoint_metadata(cfg, options.seed, train, world_size=1),
        "epoch": cfg.epochs,
        "val_accuracy": history[-1]["val_accuracy"],
    }
    write_bytes(work / "train" / "best.safetensors", checkpoint_bytes(cpu_state(training.model), metadata))
    predicted = predict(training.model, test.images, device, batch_size=256).argmax(1).numpy()
    metrics = {"accuracy": float((predicted == test.labels).mean()), "num_samples": len(test.labels)}
    write_text(work / "evaluate" / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    return cfg


def _compress(options: CheckOptions, train_cfg: TrainConfig, variants: tuple[str, ...], work: Path) -> Check:
    from tasks.ship.compress import compress

    cfg = CompressConfig(
        variants=variants,
        calibration_size=128,
        qat_epochs=1,
        finetune_epochs=1,
        latency_runs=20,
        latency_warmup=1,
    )
    pin_everything(options.seed, options.threads, True)  # as the compress stage runs (tasks/stages.py)
    try:
        result = compress(
            cfg,
            train_cfg,
            options.seed,
            options.threads,
            work / "train" / "best.safetensors",
            work / "preprocessed",
            work / "compress",
        )
    except Exception as exc:
        return Check("compress", COMPRESS_MODEL, FAIL, _describe(exc), {"variants": list(variants)})
    rows = {row.variant: asdict(row) for row in result.rows}
    shown = "; ".join(
        f"{r.variant} {r.size_ratio:.2f}x size, agreement {r.top1_agreement:.3f}" for r in result.rows[1:]
    )
    tuned = " and fine-tuned" if set(variants) & FINE_TUNED else ""
    detail = f"checkpoint trained{tuned} on {options.device}, measured in ONNX Runtime (CPU): {shown}"
    return Check("compress", COMPRESS_MODEL, PASS, detail, {"variants": rows})


def _export(options: CheckOptions, variant: str, work: Path) -> Check:
    from tasks.ship.export import CardContext, export

    # The gates on a compressed model's quality are for real data; here they are opened, and the fp32
    # parity gates (ONNX, .pt2, TorchScript vs eager) keep their defaults: those are about the code.
    cfg = ExportConfig(
        candidates=(variant,), formats=("onnx", "pt2", "torchscript"), min_top1_agreement=0.0, max_accuracy_drop=1.0
    )
    pin_everything(options.seed, options.threads, True)
    try:
        params = {"seed": options.seed, "export": cfg.model_dump()}
        card = CardContext(data_md5="synthetic (tasks/tools/gpu_check.py)", params=params)
        with warnings.catch_warnings():  # TorchScript is deprecated, and shipped on purpose (legacy consumers)
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.jit")
            result = export(
                cfg,
                options.threads,
                work / "train" / "best.safetensors",
                work / "preprocessed",
                work / "compress",
                work / "evaluate" / "metrics.json",
                work / "export",
                card,
            )
    except Exception as exc:
        return Check("export", variant, FAIL, _describe(exc))
    numbers = {
        "fp32_accuracy": result.fp32_accuracy,
        "accuracy": result.accuracy,
        "gates": [{**asdict(gate), "passed": gate.passed} for gate in result.gates],
        "sha256": result.sha256,
    }
    detail = (
        f"{len(result.gates)} gates passed; {', '.join(result.sha256)} written; test accuracy fp32 "
        f"{result.fp32_accuracy:.3f}, {variant} {result.accuracy:.3f}"
    )
    return Check("export", variant, PASS, detail, numbers)


# --- command line --------------------------------------------------------------------------------


def _device_problem(spec: str) -> str | None:
    """Why `spec` cannot run here (one line), or None."""
    if spec == "cpu":
        return None
    with warnings.catch_warnings():  # a CUDA build on a machine without a driver warns; the line below says it
        warnings.simplefilter("ignore")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
        return f"no CUDA device: torch {torch.__version__} ({build}) sees none; use --device cpu"
    index = int(spec.split(":")[1]) if ":" in spec else 0
    if index >= count:
        return f"no CUDA device {spec}: torch sees {count} (cuda:0..cuda:{count - 1}); use one of them or --device cpu"
    return None


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _device_arg(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d{1,3})?", text):
        raise argparse.ArgumentTypeError(f"{text!r}: expected cuda, cuda:N or cpu")
    return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tasks.tools.gpu_check",
        description="Strict mode, bitwise determinism, the cost of pinning, and compress/export, on one device.",
    )
    parser.add_argument("--device", type=_device_arg, default="cuda", help="cuda, cuda:N or cpu (default: cuda)")
    parser.add_argument("--json", default=str(DEFAULT_JSON), help="report file (default: %(default)s)")
    parser.add_argument(
        "--only", nargs="+", choices=GROUPS, default=list(GROUPS), help="run these groups only (compress: and export)"
    )
    parser.add_argument("--models", nargs="+", choices=MODELS, help="determinism: models to train twice")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=typing.get_args(Variant),
        help="compress: variants to build (default: "
        + "; ".join(f"{kind}: {' '.join(v)}" for kind, v in DEFAULT_VARIANTS.items())
        + ")",
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--threads", metavar="N", type=_at_least(1), help="torch CPU threads (default: 1 on cpu, 2 with cuda)"
    )
    for flag, key, what in (
        ("--batch-size", "batch_size", "strict and determinism: batch"),
        ("--steps", "steps", "determinism: optimiser steps per run"),
        ("--bench-batch", "bench_batch", "throughput: batch"),
        ("--bench-steps", "bench_steps", "throughput: steps per timed run"),
        ("--runs", "bench_runs", "throughput: timed runs per mode (the median is reported)"),
        ("--warmup", "bench_warmup", "throughput: untimed runs per mode first"),
    ):
        defaults = ", ".join(f"{getattr(sizes, key)} on {kind}" for kind, sizes in SIZES.items())
        minimum = 0 if key == "bench_warmup" else 1
        parser.add_argument(flag, dest=key, metavar="N", type=_at_least(minimum), help=f"{what} ({defaults})")
    parser.add_argument(
        "--max-cost", metavar="X", type=float, default=MAX_COST, help="CUDA target: pinned / fast time (%(default)s)"
    )
    return parser


def _options(args: argparse.Namespace) -> CheckOptions:
    kind = "cpu" if args.device == "cpu" else "cuda"
    chosen = {key: getattr(args, key) for key in ("batch_size", "steps", "bench_batch", "bench_steps", "bench_runs")}
    chosen["bench_warmup"] = args.bench_warmup
    sizes = replace(SIZES[kind], **{key: value for key, value in chosen.items() if value is not None})
    # One thread on the CPU: CI runs this beside another test worker on 2 cores, where every parallel
    # op of a 2-thread torch waits for the busy core (measured: 20 ms per BatchNorm instead of 1 ms).
    threads = args.threads or (1 if kind == "cpu" else DeterminismConfig().num_threads)
    return CheckOptions(
        device=args.device,
        sizes=sizes,
        seed=args.seed,
        threads=threads,
        groups=tuple(group for group in GROUPS if group in args.only),
        determinism_models=tuple(args.models or ()),
        variants=tuple(args.variants or DEFAULT_VARIANTS[kind]),
        max_cost=args.max_cost,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # bad arguments: argparse's message, exit 2
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)  # before anything touches CUDA
    problem = _device_problem(args.device)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_ARGS
    return exit_code(lambda: _run(args), context="gpu-check: ")


def _run(args: argparse.Namespace) -> int:
    def progress(check: Check) -> None:  # rows as they finish: a GPU run takes minutes
        print(f"{check.group} {check.name}: {check.status}", file=sys.stderr, flush=True)

    report = run_checks(_options(args), on_check=progress)
    print(report.table())
    write_text(Path(args.json), report.to_json())
    print(f"report: {args.json}")
    return EXIT_FAILED if report.failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
