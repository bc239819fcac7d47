"""B11: a training step while another process keeps a core busy, in each CPU mode.

A nightly retrain or a sweep often shares its machine. Each mode's step (efficientnet_b0, the zoo
model whose many small parallel regions suffered most; 32 RGB images of 32x32, the default
`determinism.num_threads: auto`) is timed on a quiet machine, then beside one process spinning on a
core, the two taking turns round by round. The figure is busy over quiet. Threads that wait for a
peer sharing its core with the other process, at every parallel region, make it many times more
than the share of the machine taken. Portable mode leaves the busy core out
(tasks/determinism/threads.py); target at most 2x. Native mode cannot: its weights depend on the
thread count, so the count cannot follow the load; its row is reported (`determinism.num_threads: 1`,
or portable mode, is the way out on a shared machine).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from benchmarks.data import params
from benchmarks.harness import Figure, median
from benchmarks.portable_cost import step_seconds
from tasks.determinism.threads import cores_given

MODEL, BATCH = "efficientnet_b0", 32
TARGET = 2.0  # busy / quiet


@contextmanager
def busy_cores(count: int) -> Iterator[None]:
    """`count` processes spinning in Python, each keeping a core busy, killed on exit."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def b11(rounds: int, steps: int) -> list[Figure]:
    threads, cores = params().determinism.num_threads, cores_given()
    figures = []
    for mode in ("native", "portable"):
        quiet: list[float] = []
        busy: list[float] = []
        for _ in range(rounds):
            quiet += step_seconds(mode, threads, steps, MODEL, BATCH)
            with busy_cores(1):
                busy += step_seconds(mode, threads, steps, MODEL, BATCH)
        figure = Figure(
            f"B11-{mode}",
            f"{MODEL} train step beside a busy process vs quiet, {cores} cores ({mode})",
            median(busy),
            median(quiet),
            f"<= {TARGET:g}x" if mode == "portable" else "report",
            None,
            details={"threads": threads, "cores": cores, "batch": BATCH, "runs": {"busy": busy, "quiet": quiet}},
        )
        figure.met = figure.ratio <= TARGET if mode == "portable" else None
        figures.append(figure)
    return figures
