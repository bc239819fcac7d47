"""B13: how far from the machine. The CPU's fp32 FMA peak, measured on the benchmarks' threads, and
against it torch's own matrix product and a training step of each B9 model, native and portable.

The peak comes from a microbenchmark of our own (C, compiled here with the machine's widest vectors:
`-march=native`): each thread keeps ten independent chains (named variables: an array of them
is kept in memory) of vector fused multiply-adds in
registers, as many as an FMA unit's latency (4-5 cycles) times the two units of
these cores, so nothing waits and nothing
touches memory. No library we depend on reports it (torch, oneDNN and OpenBLAS report their kernels'
speed, not the hardware's), and a clock times the units per core would need the core's real clock.
The best of several runs is the peak (the row's baseline), and torch.mm's best its
`lockstep`.

A training step's work is counted by torch's own `FlopCounterMode` (convolutions and matrix products;
one multiply-add is two operations) on the forward pass, times three for forward and backward (the
backward computes two products of the forward's size: the usual estimate). Its backward count is not
used: for grouped and depthwise convolutions it counted several times the work (torch 2.14.1:
efficientnet_b0 and convnext_tiny came out above the peak), its forward count is the layers' own
arithmetic. Counted once per model in a fresh native process:
the portable mode computes the same products in its own kernels, which the counter does not see, and
the count does not depend on the mode. Its share of the peak is that count over B9's median step time.
What a step spends beyond those products (normalisation, activations, the optimiser, copies between
layouts, Python) and what keeps the products themselves under the peak (32x32 images make small
matrices) is the rest: docs/benchmarks.md.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.harness import Figure, median

SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
#if defined(__AVX512F__)
#define WIDTH 16
#elif defined(__AVX__)
#define WIDTH 8
#else
#define WIDTH 4 /* SSE, NEON */
#endif
#define CHAINS 10
typedef float vec __attribute__((vector_size(WIDTH * sizeof(float))));

int main(int argc, char **argv) {
    long iterations = atol(argv[1]);
    int threads = atoi(argv[2]);
    float sink = 0.0f;
    double began = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        /* values from argv, so that the compiler cannot fold the loop away; they stay finite */
        /* broadcast, never indexed: an indexed vector is kept in memory */
        vec zero = {0};
        vec m = zero + (1.0f - 1.0f / (float)(iterations + argc));
        vec a = zero + 1.0f / (float)(omp_get_thread_num() + 2);
        /* ten named accumulators, not an array (an array is kept in memory): with m and a, twelve of
           the sixteen AVX2 registers, so that no operand is read from memory inside the loop */
        vec c0 = a, c1 = a * 2, c2 = a * 3, c3 = a * 4, c4 = a * 5;
        vec c5 = a * 6, c6 = a * 7, c7 = a * 8, c8 = a * 9, c9 = a * 10;
        for (long i = 0; i < iterations; i++) {
            c0 = c0 * m + a; c1 = c1 * m + a; c2 = c2 * m + a; c3 = c3 * m + a; c4 = c4 * m + a;
            c5 = c5 * m + a; c6 = c6 * m + a; c7 = c7 * m + a; c8 = c8 * m + a; c9 = c9 * m + a;
        }
        vec all = c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7 + c8 + c9;
        for (int i = 0; i < WIDTH; i++) sink += all[i];
    }
    double seconds = omp_get_wtime() - began;
    /* two operations per lane of each fused multiply-add */
    double operations = 2.0 * WIDTH * CHAINS * (double)iterations * threads;
    printf("%.6e %d %.9f\n", operations / seconds, WIDTH, sink);
    return 0;
}
"""
# -ffp-contract=fast turns `acc * m + a` into one fused multiply-add; -march=native picks the widest
# vectors this CPU has (AVX-512 where present): the peak of this machine, not of a portable build.
FLAGS = ("-O2", "-march=native", "-ffp-contract=fast", "-fopenmp")
ITERATIONS = 100_000_000  # half a second to two of one core (32 operations a cycle at 3 GHz; 16 at 2)
RUNS = 5


def build(work: Path) -> Path:
    """The microbenchmark, compiled into `work` with the C compiler ($CC, else cc)."""
    source, binary = work / "fma_peak.c", work / "fma_peak"
    source.write_text(SOURCE)
    compiler = os.environ.get("CC") or "cc"
    subprocess.run([compiler, *FLAGS, str(source), "-o", str(binary)], check=True, capture_output=True, timeout=120)
    return binary


def peak_gflops(work: Path, threads: int, iterations: int = ITERATIONS, runs: int = RUNS) -> tuple[list[float], int]:
    """(the GFLOP/s of each of `runs` runs on `threads` threads, the vector width in floats)."""
    binary = build(work)
    rates, width = [], 0
    for _ in range(runs):
        done = subprocess.run([str(binary), str(iterations), str(threads)], capture_output=True, text=True, timeout=600)
        done.check_returncode()
        rate, width_text, _ = done.stdout.split()
        rates.append(float(rate) / 1e9)
        width = int(width_text)
    return rates, width


# Run by portable_cost's `_timed` in a fresh native process: each model's counted operations for one
# training step (forward and backward) and torch.mm's best GFLOP/s on a 2048x2048 fp32 product.
WORK = """
import json, sys, time
from tasks.determinism.bootstrap import start
start(0, int(sys.argv[2]), cpu=sys.argv[1])
import torch
from torch.utils.flop_counter import FlopCounterMode
from tasks.train.models import build_model
from benchmarks.data import random_rgb_batch
images, labels = random_rgb_batch(int(sys.argv[4]))
generator = torch.Generator().manual_seed(1)
counted = {}
for name in sys.argv[3].split(","):
    model = build_model(name, 10, [0.5] * 3, [0.25] * 3)
    with FlopCounterMode(display=False) as counter:
        model(images)
    counted[name] = 3 * counter.get_total_flops()  # the forward pass, and twice it for the backward
a, b = torch.rand(2048, 2048, generator=generator), torch.rand(2048, 2048, generator=generator)
torch.mm(a, b)
rates = []
for _ in range(int(sys.argv[5])):
    began = time.perf_counter()
    torch.mm(a, b)
    rates.append(2 * 2048**3 / (time.perf_counter() - began) / 1e9)
print(json.dumps({"flops": counted, "mm_gflops": rates}))
"""


def b13(
    peak: tuple[list[float], int],
    threads: int,
    batch: int,
    counted: dict[str, Any],
    steps: dict[str, dict[str, list[float]]],
) -> list[Figure]:
    """B13 (torch.mm against the peak) and a B13-<model> row per model of `steps` (B9's step seconds per
    mode): the share of the peak its counted operations reach, portable against native."""
    rates, width = peak
    gflops, mm_rates, flops = max(rates), counted["mm_gflops"], counted["flops"]  # WORK's output
    figures = [
        Figure(
            "B13",
            f"fp32 matrix product (torch.mm, 2048x2048, native) vs the CPU's FMA peak ({width}-float FMA, "
            f"{threads} threads, a microbenchmark)",
            max(mm_rates),
            gflops,
            "report",
            None,
            unit="GFLOP/s",
            details={"runs": {"fma_peak": rates, "torch.mm": mm_rates}, "vector_floats": width, "threads": threads},
        )
    ]
    for model, seconds in steps.items():
        share = {mode: flops[model] / median(times) / 1e9 / gflops for mode, times in seconds.items()}
        figures.append(
            Figure(
                f"B13-{model}",
                f"{model} train step, {batch} RGB images of 32x32: share of the FMA peak, portable vs native",
                share["portable"],
                share["native"],
                "report",
                None,
                unit="of peak",
                details={"runs": seconds, "gflop_per_step": flops[model] / 1e9, "threads": threads},
            )
        )
    return figures
