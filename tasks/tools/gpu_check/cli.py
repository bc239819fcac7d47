"""The command line of `python -m tasks.tools.gpu_check` (the package's docstring says what it checks)."""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from tasks.core.atomic import write_text
from tasks.core.cli import exit_code
from tasks.core.config.ship import COMPRESSION_VARIANTS
from tasks.core.config.train import DeterminismConfig
from tasks.core.errors import ExitCode
from tasks.determinism.threads import resolve
from tasks.tools.gpu_check.checks import run_checks
from tasks.tools.gpu_check.report import Check
from tasks.tools.gpu_check.workload import (
    COMPRESS_MODEL,
    DEFAULT_VARIANTS,
    GROUPS,
    MAX_COST,
    MODELS,
    SIZES,
    CheckOptions,
)

DEFAULT_JSON = Path("artifacts") / "gpu-check.json"


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
    parser.add_argument(
        "--models",
        nargs="+",
        choices=MODELS,
        help="strict and determinism: check these models only "
        f"(default: every model; determinism on cpu: {COMPRESS_MODEL})",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=COMPRESSION_VARIANTS.names(),
        help="compress: variants to build (default: "
        + "; ".join(f"{kind}: {' '.join(v)}" for kind, v in DEFAULT_VARIANTS.items())
        + ")",
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--threads",
        metavar="N",
        type=_at_least(1),
        help="torch and ONNX Runtime CPU threads (default: 1 on cpu; with cuda, a run's own: the cores given)",
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
    threads = args.threads or (1 if kind == "cpu" else resolve(DeterminismConfig().num_threads))
    return CheckOptions(
        device=args.device,
        sizes=sizes,
        seed=args.seed,
        threads=threads,
        groups=tuple(group for group in GROUPS if group in args.only),
        models=tuple(args.models or ()),
        variants=tuple(args.variants or DEFAULT_VARIANTS[kind]),
        max_cost=args.max_cost,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # bad arguments: argparse's message, exit 2
    problem = _device_problem(args.device)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return ExitCode.NO_HARDWARE
    return exit_code(lambda: _run(args), context="gpu-check: ")


def _run(args: argparse.Namespace) -> int:
    def progress(check: Check) -> None:  # rows as they finish: a GPU run takes minutes
        print(f"{check.group} {check.name}: {check.status}", file=sys.stderr, flush=True)

    report = run_checks(_options(args), on_check=progress)
    print(report.table())
    write_text(Path(args.json), report.to_json())
    print(f"report: {args.json}")
    return ExitCode.FAILED if report.failed else ExitCode.OK
