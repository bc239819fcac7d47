"""`make bench` = `python -m benchmarks`: lockstep measured against what users would otherwise run.

    python -m benchmarks                 # every benchmark, full size (minutes)
    python -m benchmarks --only B1 B4    # some of them
    python -m benchmarks --smoke         # tiny sizes, one round, B2 on digits only: checks they run (CI), not timings

Prints the table, writes benchmarks/results/bench.json (and bench.md, the table as in the README)
with the machine it ran on. Exits 1 if a target with a verdict was missed (not with --smoke),
unless the same run measured it to be out of reach (the table's numbered notes say why).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.harness import RESULTS, ROOT, Figure, machine
from flows import kept_server
from tasks.core.atomic import write_text
from tasks.determinism.bootstrap import bootstrap

# Batches per epoch in the smoke run (train.max_batches; B6 and B7 cut theirs to as many, B2 and B10 the
# pipeline's, benchmarks/pipeline_overhead.py SMOKE): digits' whole epoch is 20 batches, and the smoke run
# trains over twenty epochs, each about a second of CPU that checks nothing a few batches do not.
SMOKE_BATCHES = 3


def _suites(smoke: bool) -> dict[str, Callable[[Path], list[Figure]]]:
    # the suites load numpy and torch: after main's bootstrap pinned the process
    from benchmarks import (
        compression,
        contention,
        large_split,
        pipeline_overhead,
        portable_cost,
        scaling,
        stats_loop,
        sweep_scaling,
        train_epoch,
    )

    if smoke:  # one round, no warm-up, one epoch of a few batches: that everything runs, not how fast
        return {
            "B1": lambda work: train_epoch.b1_b8(work, rounds=1, warmup=0, max_batches=SMOKE_BATCHES),
            "B2": lambda work: pipeline_overhead.b2(work, rounds=1, rounds_large=0, smoke=True),
            "B3": lambda work: pipeline_overhead.b3(work, rounds=1, smoke=True),
            "B4": lambda work: train_epoch.b4(work, rounds=1, epochs=1, warmup=0, max_batches=SMOKE_BATCHES),
            "B5": lambda work: [stats_loop.b5(work, rounds=1, scale=1)],
            "B6": lambda work: compression.b6(work, rounds=1, runs=20, smoke=True),
            "B7": lambda work: scaling.b7(work, smoke=True),
            "B9": lambda work: portable_cost.b9(
                work,
                rounds=1,
                epochs=1,
                steps=1,
                batch=4,
                one_process=True,
                models=portable_cost.SMOKE_STEP_MODELS,
                max_batches=SMOKE_BATCHES,
                peak_iterations=200_000,
            ),
            "B10": lambda work: sweep_scaling.b10(work, smoke=True),
            "B11": lambda work: contention.b11(rounds=1, steps=1),
            "B12": lambda work: large_split.b12(work, smoke=True),
        }
    return {
        "B1": lambda work: train_epoch.b1_b8(work, rounds=5),  # B8 too: the same set-up
        "B2": lambda work: pipeline_overhead.b2(work, rounds=3, rounds_large=2),
        "B3": lambda work: pipeline_overhead.b3(work, rounds=5),
        "B4": lambda work: train_epoch.b4(work, rounds=6),
        "B5": lambda work: [stats_loop.b5(work, rounds=5)],
        "B6": lambda work: compression.b6(work, rounds=5, runs=50),
        "B7": lambda work: scaling.b7(work),
        "B9": lambda work: portable_cost.b9(work, rounds=3, epochs=4, steps=6, epoch_rounds=8),  # B13 too
        "B10": lambda work: sweep_scaling.b10(work),
        "B11": lambda work: contention.b11(rounds=3, steps=4),
        "B12": lambda work: large_split.b12(work),
    }


def markdown(figures: list[Figure], host: dict[str, object]) -> str:
    lines = [
        f"Measured on {host['cpu']} ({host['cores']} cores), Python {host['python']}, torch {host['torch']}.",
        "",
        "| # | measure | lockstep | baseline | ratio | target | met |",
        "| --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    notes = []
    for f in sorted(figures, key=lambda f: f.id):
        met = {True: "yes", False: "**no**", None: "report"}[f.met]
        if f.met is False and f.argued:
            notes.append(f"{len(notes) + 1}. {f.id}: {f.argued}")
            met = f"no ({len(notes)})"
        lines.append(
            f"| {f.id} | {f.measure} | {f.lockstep:.4g} {f.unit} | {f.baseline:.4g} {f.unit} | "
            f"{f.ratio:.3f}x | {f.target} | {met} |"
        )
    tables = [
        f"\n{f.id.partition('-')[0]}: the compress stage's table\n\n{f.details['table_md'].strip()}"
        for f in figures
        if "table_md" in f.details
    ]
    return "\n".join([*lines, *([""] + notes if notes else []), *tables]) + "\n"


def unargued_misses(figures: list[Figure]) -> list[str]:
    """The figures that fail the run: a target missed, and not shown out of reach by the same run."""
    return [f.id for f in figures if f.met is False and not f.argued]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", metavar="B#", help="run only these benchmarks")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round, no verdicts")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where bench.json/bench.md go")
    args = parser.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars of the stages would drown the table
    # the defaults users get, stages run in this process included: pinned before torch and numpy load
    bootstrap(ROOT / "params.yaml")
    suites = _suites(args.smoke)
    unknown = set(args.only or []) - set(suites)
    if unknown:
        parser.error(f"unknown benchmark(s) {sorted(unknown)}; choose from {sorted(suites)}")
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="lockstep-bench-") as tmp:
        try:
            for name, suite in suites.items():
                if args.only and name not in args.only:
                    continue
                start = time.perf_counter()
                figures += suite(Path(tmp))
                print(f"{name}: done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        finally:  # the Prefect servers the project copies' runs kept (flows/kept_server.py), before their folders go
            for home in Path(tmp).glob("**/.prefect"):
                kept_server.stop(home)
    if args.smoke:  # toy sizes and one round: the figures show the code runs, not whether targets hold
        for figure in figures:
            figure.met = None
    host = machine()
    table = markdown(figures, host)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    # the day it was measured (UTC): the docs render the table with it, as every figure they show is dated
    day = time.strftime("%Y-%m-%d", time.gmtime())
    record = {"date": day, "machine": host, "smoke": args.smoke, "figures": [f.row() for f in figures]}
    write_text(args.out / "bench.json", json.dumps(record, indent=2) + "\n")
    write_text(args.out / "bench.md", table)
    missed = unargued_misses(figures)
    if missed and not args.smoke:
        print(f"targets missed: {', '.join(missed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
