"""Check 3: images/s of the project's loop pinned vs with nondeterministic kernels and cuDNN's autotuner
(the price of determinism), and vs a plain hand-written loop; warm-up first, medians, synchronised."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from tasks.data.preprocess import Preprocessed
from tasks.determinism.pinning import allow_fast_kernels
from tasks.tools.gpu_check.report import FAIL, PASS, REPORT, Check, describe
from tasks.tools.gpu_check.workload import (
    BENCH_MODEL,
    IMAGE_SHAPE,
    NUM_CLASSES,
    CheckOptions,
    pin,
    synthetic_split,
    train_config,
)
from tasks.train.loop import build_training


class _PlainLoop:
    """A minimal hand-written training loop (torchvision resnet18 with the same CIFAR stem, SGD, batches
    sliced from a shuffled order): nothing of the project, the baseline its loop is compared with."""

    def __init__(self, split: Preprocessed, batch_size: int, device: torch.device, seed: int) -> None:
        # heavy: torchvision (~3 s beyond torch), only for this check
        from torchvision.models import resnet18

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
        pin(options)
    else:
        allow_fast_kernels()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(options: CheckOptions, amp: str) -> dict[str, float]:
    """Median seconds per timed run of each mode at one precision (`train.amp`); the modes take turns,
    run by run, so a slow patch of the machine lands on all of them alike. The plain loop runs in fp32."""
    sizes, device = options.sizes, torch.device(options.device)
    split = synthetic_split(sizes.bench_batch * sizes.bench_steps, options.seed)
    cfg = train_config(options, model=BENCH_MODEL, batch_size=sizes.bench_batch, max_batches=sizes.bench_steps, amp=amp)
    pin(options)
    pinned, fast = (build_training(cfg, options.seed, split, device) for _ in range(2))
    modes = {"pinned": (True, pinned.train_epoch), "fast": (False, fast.train_epoch)}
    if amp == "none":
        pin(options)  # the plain loop's model starts from the seed, as the others' do
        plain = _PlainLoop(split, sizes.bench_batch, device, options.seed)
        modes["plain"] = (True, lambda epoch: plain.run(sizes.bench_steps))
    times: dict[str, list[float]] = {name: [] for name in modes}
    for round_ in range(sizes.bench_warmup + sizes.bench_runs):
        for name, (pinned_mode, run) in modes.items():
            _set_pinned(options, pinned_mode)
            _sync(device)
            start = time.perf_counter()
            run(round_ + 1)
            _sync(device)
            if round_ >= sizes.bench_warmup:
                times[name].append(time.perf_counter() - start)
    pin(options)
    return {name: float(np.median(values)) for name, values in times.items()}


# The precisions measured, row label -> train.amp. Only bf16 is judged against the target: in fp32,
# cuDNN's deterministic algorithm set lacks the fast weight-gradient kernels the autotuner picks on
# recent GPUs, and nothing short of nondeterminism buys them back; bf16 autocast is what the docs
# recommend for training on a GPU, and there pinning is close to free.
PRECISIONS = {"fp32": "none", "bf16": "bf16"}
JUDGED = "bf16"


def throughput_checks(options: CheckOptions) -> Iterator[Check]:
    sizes = options.sizes
    on_cuda = torch.device(options.device).type == "cuda"
    runs = f"batch {sizes.bench_batch} x {sizes.bench_steps} steps, median of {sizes.bench_runs}"
    numbers = {"batch_size": sizes.bench_batch, "steps_per_run": sizes.bench_steps}
    numbers.update(runs=sizes.bench_runs, warmup=sizes.bench_warmup)
    for label, amp in PRECISIONS.items():
        name = f"{BENCH_MODEL} {label} pinned vs fast"
        try:
            seconds = _median_seconds(options, amp)
        except Exception as exc:
            yield Check("throughput", name, FAIL, describe(exc))
            continue
        ips = {mode: sizes.bench_batch * sizes.bench_steps / s for mode, s in seconds.items()}
        cost = ips["fast"] / ips["pinned"]
        judged = on_cuda and label == JUDGED
        status = (PASS if cost <= options.max_cost else FAIL) if judged else REPORT
        target = f"target <= {options.max_cost}x" + ("" if on_cuda else " on CUDA") + f" in {JUDGED}"
        measured = {**numbers, "images_per_s": ips, "seconds_per_run": seconds, "amp": amp}
        yield Check(
            "throughput",
            name,
            status,
            f"{ips['pinned']:.1f} vs {ips['fast']:.1f} img/s: pinning costs {cost:.2f}x ({target}; {runs})",
            {**measured, "cost": cost, "max_cost": options.max_cost, "judged": judged},
        )
        if "plain" in ips:
            overhead = ips["plain"] / ips["pinned"]
            yield Check(
                "throughput",
                f"{BENCH_MODEL} project vs plain",
                REPORT,
                f"{ips['pinned']:.1f} vs {ips['plain']:.1f} img/s: project loop takes {overhead:.2f}x a plain "
                f"loop's time (both pinned, {label}; {runs})",
                {**measured, "project_over_plain": overhead},
            )
