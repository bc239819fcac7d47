"""What every benchmark shares: timing by alternation, the figure it reports, the machine it ran on.

Every figure is a ratio of two things measured in the same run: the cases take turns after untimed
warm-up rounds, so a slow moment of the machine hits both, the order reversed each round (A B, B A,
A B, ...) so that neither always runs first, after the other has warmed or loaded the machine. A
figure of two paired cases is the median of its rounds' ratios (`paired`); others report each side's
median. Thread counts are fixed before anything is timed: each benchmark starts its process as
every entry point does (tasks/determinism/bootstrap.py `start`) with the count it measures at.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

from tasks.determinism.fingerprint import cpu_facts

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@dataclass
class Figure:
    """One row of the benchmark table: lockstep's measure against the baseline's."""

    id: str  # B1 ... B8
    measure: str
    lockstep: float  # seconds (or the unit in `unit`), median
    baseline: float
    target: str  # as the issue words it, e.g. "<= 0.33x"
    met: bool | None  # None: reported only (no target on this machine)
    unit: str = "s"
    details: dict[str, Any] = field(default_factory=dict)
    # A missed target the same run shows to be out of reach (why, with its numbers); the table
    # prints it and the run does not fail on it. Set only from measurements, never by hand.
    argued: str | None = None
    # Paired rounds (the two sides measured back to back, round by round): each round's ratio. The
    # row's ratio is then their median, not the ratio of the medians: the host's speed drifts between
    # rounds, so times pooled over rounds compare the sides at different speeds, a round's pair at one.
    round_ratios: list[float] | None = None

    @property
    def ratio(self) -> float:
        if self.round_ratios:
            return statistics.median(self.round_ratios)
        return self.lockstep / self.baseline if self.baseline else float("inf")

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


def alternate(cases: dict[str, Callable[[], float | None]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run the cases in turn, `warmup` untimed rounds then `rounds` timed ones; seconds per case.

    A case may return its own measurement in seconds (to leave out set-up it needs each time);
    if it returns None, the whole call is timed.
    """
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(warmup + rounds):
        for name in in_turn(list(cases), i):
            case = cases[name]
            start = time.perf_counter()
            measured = case()
            elapsed = time.perf_counter() - start if measured is None else measured
            if i >= warmup:
                times[name].append(elapsed)
    return times


def in_turn(names: list[str], turn: int) -> list[str]:
    """The cases' order in round `turn`: as given in even rounds, reversed in odd ones."""
    return names if turn % 2 == 0 else names[::-1]


def paired(times: dict[str, list[float]], side: str, baseline: str) -> list[float]:
    """Each round's ratio `side` / `baseline` (`alternate`'s times): a Figure's `round_ratios`."""
    return [a / b for a, b in zip(times[side], times[baseline], strict=True)]


def median(values: list[float]) -> float:
    return statistics.median(values)


def run_timed(cmd: list[str], cwd: Path = ROOT, env: dict[str, str] | None = None, expect: str = "") -> float:
    """Wall seconds of `cmd` as a fresh process, which must succeed and print `expect`."""
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0 or expect not in done.stdout:
        raise RuntimeError(
            f"{' '.join(map(str, cmd))} (exit {done.returncode}, expected {expect!r}) in {cwd}:\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
    return elapsed


def run_python(args: list[str], cwd: Path = ROOT, env: dict[str, str] | None = None) -> float:
    """Wall seconds of a fresh `python <args>` process (which must succeed)."""
    return run_timed([sys.executable, *args], cwd, env)


def machine() -> dict[str, Any]:
    """What the numbers were measured on: the CPU as a run's fingerprint records it (its `hw.cpu.*`
    tags, tasks/determinism/fingerprint.py), and the software."""
    cpu = cpu_facts()
    return {
        "cpu": cpu["hw.cpu.model"],
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "os": platform.platform(),
        "fingerprint": cpu,
    }
