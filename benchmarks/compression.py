"""Compression targets on this machine: static int8 vs ONNX Runtime fp32, and 50% pruning.

    make run                              # trains the default model first (artifacts/train/)
    .venv/bin/python benchmarks/compression.py [--rounds 5] [--runs 50]

Builds every variant with the compress stage's own function and params.yaml (in a temporary
directory; artifacts/ is not touched), then times fp32 and static int8 again for `--rounds` more
rounds, the two taking turns run by run, and reports the median speed-up over the rounds. Targets
(the compression issue): static int8 <= 0.3x the fp32 file, >= 1.3x faster at batch 64, accuracy
drop <= 1 point; global L1 pruning of 50% loses <= 1 point after fine-tuning.

Prints the table, writes JSON (default benchmarks/results/compression.json) and exits 1 if a
target is missed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="extra timing rounds of fp32 vs static int8")
    parser.add_argument("--runs", type=int, default=50, help="timed runs per model, batch size and round")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/compression.json")
    args = parser.parse_args(argv)

    from tasks import layout
    from tasks.compress import LATENCY_BATCHES, compress, latency_batch, markdown_table
    from tasks.config import load_params
    from tasks.determinism import pin_everything
    from tasks.onnx_model import median_latency_ms, session
    from tasks.preprocess import load_split

    checkpoint = ROOT / layout.TRAIN_DIR / "best.safetensors"
    if not checkpoint.exists():
        print(f"error: {checkpoint} not found: run `make run` first", file=sys.stderr)
        return 2
    params = load_params(ROOT / "params.yaml")
    threads = params.determinism.num_threads
    pin_everything(params.seed, threads, params.determinism.strict)
    cfg = params.compress.model_copy(update={"latency_runs": max(args.runs, 20)})
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "compress"
        result = compress(cfg, params.train, params.seed, threads, checkpoint, ROOT / layout.PREPROCESSED_DIR, out)
        rows = {row.variant: row for row in result.rows}
        print(markdown_table(result.rows))
        sessions = {name: session(out / "models" / f"{name}.onnx", threads) for name in ("fp32", "static_int8")}
        images = load_split(ROOT / layout.PREPROCESSED_DIR, "test").images
        speedups: dict[int, list[float]] = {size: [] for size in LATENCY_BATCHES}
        for _ in range(args.rounds):
            for size in LATENCY_BATCHES:
                ms = median_latency_ms(sessions, latency_batch(images, size), args.runs, warmup=10)
                speedups[size].append(ms["fp32"] / ms["static_int8"])

    fp32, static, pruned = rows["fp32"], rows["static_int8"], rows.get("pruned_l1")
    b64 = float(np.median(speedups[64]))
    targets = [
        ("static int8 size / fp32", static.size_ratio, "<=", 0.3),
        ("static int8 speed-up vs ORT fp32, batch 64", b64, ">=", 1.3),
        ("static int8 accuracy drop (points)", 100 * (fp32.accuracy - static.accuracy), "<=", 1.0),
    ]
    if pruned is not None:
        targets.append((f"pruned_l1 ({cfg.prune_amount:.0%}) accuracy drop (points)",
                        100 * (fp32.accuracy - pruned.accuracy), "<=", 1.0))  # fmt: skip
    print(f"speed-up of static int8 over fp32, median of {args.rounds} rounds x {args.runs} runs: "
          f"batch 1 {np.median(speedups[1]):.2f}x, batch 64 {b64:.2f}x "
          f"(rounds: {', '.join(f'{s:.2f}' for s in speedups[64])})")  # fmt: skip
    print("\n| target | measured | wanted | ok |\n| --- | ---: | ---: | --- |")
    met = []
    for name, value, op, limit in targets:
        ok = value <= limit if op == "<=" else value >= limit
        met.append(ok)
        print(f"| {name} | {value:.3f} | {op} {limit} | {'yes' if ok else 'NO'} |")
    report = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": threads,
                    "python": platform.python_version()},  # fmt: skip
        "table": [vars(row) for row in result.rows],
        "speedup_rounds": {str(k): v for k, v in speedups.items()},
        "targets": [{"name": n, "measured": v, "op": o, "limit": lim, "met": ok}
                    for (n, v, o, lim), ok in zip(targets, met, strict=True)],  # fmt: skip
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten: {args.json}")
    return 0 if all(met) else 1


if __name__ == "__main__":
    sys.exit(main())
