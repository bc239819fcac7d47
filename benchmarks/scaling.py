"""B7: how the cost of stats, preprocess and one training epoch grows with the data (1x, 4x, 16x).

    python -m benchmarks.scaling [--data-unit 32] [--epoch-unit 4] [--smoke] [--work DIR] [--json FILE]

Each step runs in a fresh Python process (`python -m benchmarks.scaling --child STEP ...`), so its
peak RSS is its own and not what an earlier step left behind. The child reports:

- `before_mib`: RSS once its imports are done (and, for the epoch, the determinism settings); the
  peak-RSS mark is reset there (see `_start_peak` for why VmHWM and not `ru_maxrss`);
- `peak_mib`: peak RSS after the step's first run (the step's own high-water mark);
- `seconds`: the median of `repeats` further, timed runs of the step, `perf_counter` around the
  call only, so interpreter start-up and imports (a second or more, the same at every size) do not
  flatten the growth we are after; the first run is left out of the timing for the same reason
  (first-touch costs: page faults, lazy initialisation, and for the epoch the DataLoader's
  forkserver and persistent workers starting);
- `output_bytes`: what the step writes (stats.json; the preprocessed folder; nothing for an epoch);
- `held_bytes`: what the step keeps in memory by design: nothing for stats and preprocess (they
  stream one chunk at a time and write with plain file writes), the training split's labels for an
  epoch (its images are read from their file batch by batch, as the train stage reads them);
- `shmem_mib`: shared memory in its RSS after the first run.

Steps, each the stage's own code: stats = `tasks.data.stats.compute_stats`; preprocess =
`tasks.data.preprocess.preprocess`; epoch = one epoch of `tasks.train.loop`'s loop (`build_training` with the
stage's DataLoader settings and `num_workers`, then `Training.train_epoch`), set up as `train` sets it up.

Scales multiply a base of copies of digits (`benchmarks.data.raw`; digits is 1,797 8x8 greyscale
images, 115 KB), one base for stats + preprocess (`data_unit`, default 32) and one for the epoch
(`epoch_unit`, default 4). Each step gets a 1x at which its fixed costs (opening files, the split,
writing meta.json; for an epoch, per-epoch set-up) are small next to its per-image work, since the
verdict compares t(16x) with 16 t(1x) and a fixed cost pulls that below 1: at digits x4 the stats
pass takes ~3 ms of which ~1 ms is fixed (measured: 16x/1x came out 0.69), at digits x32 (57,504
images) it takes ~20 ms. An epoch costs ~130 us per image, so digits x4 (7,188 images, ~1 s an
epoch) is already large, and 16x of it (115,008 images) keeps an epoch under a minute on 2 cores,
where 16x of digits x32 would take ten. The chunked passes run on full 4,096-image chunks from 1x.

Verdicts, per step, from the smallest and the largest size:
- time linear: t(16x) / (16 * t(1x)) within 1 +- 0.2 (`ratio` of the Figure: lockstep = t(16x),
  baseline = 16 * t(1x), the linear prediction).
- memory flat except what the step holds: the growth of peak RSS over the step's own start
  (`peak - before`), minus `held_bytes`, may rise from 1x to 16x by at most MEMORY_SLACK_MIB plus
  BOOKKEEPING_BYTES per added image. Strictly flat is not possible: labels (int64) and the split's
  index arrays are per image by nature, and the DataLoader's DistributedSampler makes a Python list
  of the epoch's order (~36 bytes per training image). Four int64 per image covers that; it is
  half of a digits image's 64 bytes of pixels (1% of a 32x32 RGB image's), so a step that held its
  input whole would still fail the rule, and one that held it as float64 (8x) by far.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.harness import ROOT, Figure
from tasks.core.config.yaml_io import load_params
from tasks.determinism.bootstrap import start
from tasks.determinism.threads import pool_env, resolve

if TYPE_CHECKING:
    from tasks.core.config.params import Params
    from tasks.core.config.train import TrainConfig

STEPS = ("stats", "preprocess", "epoch")
DATA_UNIT = 32  # copies of digits at 1x for stats and preprocess (see the module docstring)
EPOCH_UNIT = 4  # ... and for the epoch
LINEAR_TOLERANCE = 0.2  # t(16x) / (16 t(1x)) within 1 +- this
MEMORY_SLACK_MIB = 4.0  # allocator and page-granularity noise between two fresh processes
BOOKKEEPING_BYTES = 32  # per added image: four int64 (labels, split indices, sampler order; see above)
REPEATS = {"stats": 5, "preprocess": 3, "epoch": 2}  # timed runs after the first; an epoch at 16x is ~20 s
MIB = 2**20


# --- the child: one step, in a process of its own ------------------------------------------------


def _status_mib(*keys: str) -> list[float]:
    """Fields of /proc/self/status in MiB: VmRSS (resident now), VmHWM (peak), RssShmem (shared)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return [int(fields[key].split()[0]) / 1024 for key in keys]


def _start_peak() -> tuple[float, bool]:
    """Reset the peak-RSS mark to the current RSS (Linux >= 4.0); returns (RSS now MiB, reset done).

    Not `ru_maxrss`: Linux carries it across exec, so a child of a large parent (the benchmark
    runner has torch loaded) reports the parent's peak. VmHWM belongs to the child's own address
    space; resetting it after the imports leaves the step's own high-water mark. Where the reset
    is refused, VmHWM includes the imports' peak and the step's growth reads low, never high.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    current, peak = _status_mib("VmRSS", "VmHWM")
    return (current if reset else peak), reset


def _size(path: Path | None) -> int:
    if path is None or not path.exists():
        return 0
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def child(step: str, data: Path, folder: Path, repeats: int, smoke: bool = False) -> dict[str, Any]:
    """Run `step` on `data` (a raw snapshot; for the epoch, a preprocessed folder), files in `folder`.

    stats writes `folder/stats.json`; preprocess reads it and writes `folder/preprocessed`.

    The step runs once (cold: its peak RSS is read after it), then `repeats` times timed.
    """
    p = load_params(ROOT / "params.yaml")
    output: Path | None = None
    held = lambda: 0  # noqa: E731 - bytes the step keeps in memory by design
    if step == "stats":
        # each step's modules load in its own child, alone: the child's peak RSS is the step's
        from tasks.data.stats import compute_stats

        output = folder / "stats.json"

        def run() -> None:
            output.write_text(json.dumps(compute_stats(data, p.split, p.seed, p.stats.chunk_size).__dict__))

    elif step == "preprocess":
        # each step's modules load in its own child, alone: the child's peak RSS is the step's
        from tasks.data.preprocess import preprocess
        from tasks.data.stats import ChannelStats

        stats = ChannelStats(**json.loads((folder / "stats.json").read_text()))
        output = folder / "preprocessed"

        def run() -> None:
            preprocess(data, stats, p.split, p.seed, output)

    elif step == "epoch":
        # smoke: a few batches in this process, so that CI checks the machinery in seconds
        cfg = p.train.model_copy(update={"max_batches": 3, "num_workers": 0}) if smoke else p.train
        run, held = _epoch(data, p, cfg)
    else:
        raise ValueError(f"unknown step {step!r}; expected one of {STEPS}")

    before, reset = _start_peak()
    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    peak, shmem = _status_mib("VmHWM", "RssShmem")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return {
        "step": step,
        "seconds": statistics.median(times),
        "first_s": first,
        "runs": times,
        "before_mib": before,
        "peak_mib": peak,
        "peak_reset": reset,
        "shmem_mib": shmem,
        "output_bytes": _size(output),
        "held_bytes": held(),
    }


def _epoch(pre: Path, p: Params, cfg: TrainConfig) -> tuple[Callable[[], None], Callable[[], int]]:
    """One epoch of the train stage's loop as a callable; set-up happens on its first call.

    As `tasks.train.stage.train` runs it for one process: pinned (`start`, as the stage runner does), then
    `tasks.train.loop.build_training` (the split's images read from their file per batch, the model,
    optimiser, loss, the seeded loader with whole-batch fetches and persistent workers) and
    `train_epoch` per epoch.
    Validation, checkpoints and tracking are per-epoch costs of the stage but not of "an epoch" of
    training. The loader's workers are processes of their own: their RSS is not in this one's.
    """
    start(p.seed, p.determinism.num_threads, strict=p.determinism.strict)
    # the epoch's modules (torch) load in its child alone, after it is pinned: its RSS is the epoch's
    from tasks.data.preprocess import load_split
    from tasks.train.devices import resolve_device
    from tasks.train.loop import build_training

    state: dict[str, Any] = {"epoch": 0}

    def run() -> None:
        if not state["epoch"]:  # set-up is part of the step (loading the split is its memory)
            state["split"] = load_split(pre, "train", stream=True)  # as the train stage reads it
            state["training"] = build_training(cfg, p.seed, state["split"], resolve_device(cfg.device))
        state["epoch"] += 1
        state["training"].train_epoch(state["epoch"])

    def held() -> int:  # the labels: the images stay in their file
        return int(state["split"].labels.nbytes)

    return run, held


# --- the parent: sizes, children, verdicts --------------------------------------------------------


def _run_child(step: str, data: Path, folder: Path, repeats: int, smoke: bool, env: dict[str, str]) -> dict[str, Any]:
    args = [
        sys.executable,
        "-m",
        "benchmarks.scaling",
        "--child",
        step,
        "--data",
        str(data),
        "--folder",
        str(folder),
        "--repeats",
        str(repeats),
        *(["--smoke"] if smoke else []),
    ]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"B7 {step} child exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _verdict(step: str, rows: list[dict[str, Any]], smoke: bool) -> Figure:
    small, large = rows[0], rows[-1]
    factor = large["scale"] / small["scale"]
    expected = factor * small["seconds"]  # linear growth from the smallest size
    time_ratio = large["seconds"] / expected if expected else float("inf")
    time_ok = abs(time_ratio - 1) <= LINEAR_TOLERANCE

    def extra(row: dict[str, Any]) -> float:  # RSS growth beyond what the step holds by design
        return row["peak_mib"] - row["before_mib"] - row["held_bytes"] / MIB

    allowed = MEMORY_SLACK_MIB + BOOKKEEPING_BYTES * (large["images"] - small["images"]) / MIB
    memory_growth = extra(large) - extra(small)
    memory_ok = memory_growth <= allowed
    for row in rows:
        row["extra_mib"] = extra(row)
    lo, hi = rows[0]["scale"], rows[-1]["scale"]
    return Figure(
        "B7",
        f"{step}: time at {hi}x vs {hi // lo}x time at {lo}x (1x = digits x{small['unit']}); peak RSS",
        large["seconds"],
        expected,
        f"time linear (ratio 1 +- {LINEAR_TOLERANCE}); RSS beyond held data flat (+<= {allowed:.1f} MiB)",
        None if smoke else time_ok and memory_ok,
        details={
            "step": step,
            "time_ratio": time_ratio,
            "time_ok": time_ok,
            "memory_growth_mib": memory_growth,
            "memory_allowed_mib": allowed,
            "memory_ok": memory_ok,
            "smoke": smoke,
            "rows": rows,
        },
    )


def b7(
    work: Path,
    scales: tuple[int, ...] = (1, 4, 16),
    smoke: bool = False,
    data_unit: int = DATA_UNIT,
    epoch_unit: int = EPOCH_UNIT,
) -> list[Figure]:
    """Stats, preprocess (1x = digits x `data_unit`) and an epoch (1x = digits x `epoch_unit`) per scale.

    One Figure per step, its rows (one per scale) in `details["rows"]`. `smoke`: digits x1 and x2,
    one timed run each, an "epoch" of 3 batches without loader workers, no verdicts (`met` is
    None): a check that the machinery works, in seconds.
    """
    # the children import this module: only the parent loads the data helpers (numpy, the data stages)
    from benchmarks.data import params, prepared, raw

    if smoke:
        scales, data_unit, epoch_unit = (1, 2), 1, 1
    # the children's thread pools, from their start (the epoch child also pins its own: `start`); set in
    # their environment only, so this process stays free of torch
    env = {**os.environ, **pool_env(resolve(params().determinism.num_threads))}
    rows: dict[str, list[dict[str, Any]]] = {step: [] for step in STEPS}

    def measure(step: str, scale: int, unit: int, data: Path, folder: Path) -> None:
        snapshot = raw(work, unit * scale)
        row = _run_child(step, data, folder, 1 if smoke else REPEATS[step], smoke, env)
        rows[step].append({"scale": scale, "unit": unit, "images": _images(snapshot), **row})

    for scale in scales:
        data = raw(work, data_unit * scale)
        folder = work / f"b7-x{data_unit * scale}"
        folder.mkdir(parents=True, exist_ok=True)
        measure("stats", scale, data_unit, data, folder)  # writes folder/stats.json ...
        measure("preprocess", scale, data_unit, data, folder)  # ... which preprocess reads
        pre = folder / "preprocessed" if epoch_unit == data_unit else prepared(work, epoch_unit * scale)
        measure("epoch", scale, epoch_unit, pre, folder)
    return [_verdict(step, rows[step], smoke) for step in STEPS]


def _images(snapshot: Path) -> int:
    return int(json.loads((snapshot / "meta.json").read_text())["num_images"])


def table(figures: list[Figure]) -> str:
    """Markdown: one line per step and size, then one verdict line per step.

    `images` counts the raw snapshot (an epoch trains on its training split, 70% of it).
    """
    lines = [
        "| step | scale | images | s (median) | us/image | RSS before MiB | peak MiB | held MiB | "
        "growth beyond held MiB | shared MiB | output MiB |",
        "| --- |" + " ---: |" * 10,
    ]
    for fig in figures:
        for r in fig.details["rows"]:
            lines.append(
                f"| {fig.details['step']} | {r['scale']}x | {r['images']} | {r['seconds']:.4f} | "
                f"{r['seconds'] / r['images'] * 1e6:.2f} | {r['before_mib']:.1f} | {r['peak_mib']:.1f} | "
                f"{r['held_bytes'] / MIB:.2f} | {r['extra_mib']:.1f} | {r['shmem_mib']:.1f} | "
                f"{r['output_bytes'] / MIB:.2f} |"
            )
    lines.append("")
    for fig in figures:
        d = fig.details
        verdict = "reported only (smoke)" if fig.met is None else ("PASS" if fig.met else "FAIL")
        lines.append(
            f"- {d['step']}: time ratio {d['time_ratio']:.3f} ({'ok' if d['time_ok'] else 'not linear'}); "
            f"RSS beyond held +{d['memory_growth_mib']:.1f} MiB of {d['memory_allowed_mib']:.1f} allowed "
            f"({'flat' if d['memory_ok'] else 'grows'}): {verdict}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-unit", type=int, default=DATA_UNIT, help="copies of digits at 1x: stats, preprocess")
    parser.add_argument("--epoch-unit", type=int, default=EPOCH_UNIT, help="copies of digits at 1x: epoch")
    parser.add_argument("--smoke", action="store_true", help="digits x1 and x2, one run, no verdicts (CI)")
    parser.add_argument("--work", type=Path, help="keep generated data here (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--child", choices=STEPS, help=argparse.SUPPRESS)  # internal: one step, JSON on stdout
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.data, args.folder, args.repeats, args.smoke)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        figures = b7(args.work or Path(tmp), smoke=args.smoke, data_unit=args.data_unit, epoch_unit=args.epoch_unit)
    print(table(figures))
    if args.json:
        args.json.write_text(json.dumps([f.row() for f in figures], indent=2) + "\n")
    return 0 if args.smoke or all(f.met for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())
