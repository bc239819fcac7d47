"""B2's baseline: the pipeline's stage functions called in one plain Python process.

    python -m benchmarks.plain_pipeline --params params.yaml [--skip-download]

Run in a folder of its own (the stages read and write `data/` and `artifacts/` relative to the
working directory, as in the project). The same public functions, arguments and determinism
settings as `tasks/runner.py`, each stage once, in order; what is left out is what B2 charges to
orchestration: no Prefect, no DVC (no staleness check, no `dvc add`/`commit` hashing), no MLflow
(no runs, artifacts or registry). `--skip-download`: start from the raw snapshot already in
`data/` (B2 on a generated dataset, which has no source to download from).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tasks.core import layout
from tasks.determinism.bootstrap import bootstrap, start
from tasks.determinism.threads import resolve


def run(params_file: Path, skip_download: bool) -> float:
    """Every stage after (or with) download; returns the test accuracy of the shipped model."""
    p = bootstrap(params_file)  # as `python -m tasks` starts: before the stages load numpy and torch
    # the stages' modules load numpy and torch: after bootstrap pinned the process
    from tasks.data.download import download
    from tasks.data.preprocess import preprocess
    from tasks.data.stats import compute_stats
    from tasks.ship.compress import compress
    from tasks.ship.export import CardContext, export
    from tasks.train.evaluate import evaluate
    from tasks.train.stage import train

    def pin() -> None:  # as run_stage does before every stage
        start(p.seed, p.determinism.num_threads, strict=p.determinism.strict, cpu=p.determinism.cpu)

    best = layout.TRAIN_DIR / "best.safetensors"
    if not skip_download:
        pin()
        download(p.data, layout.DATA_DIR, layout.download_cache())
    pin()
    stats = compute_stats(layout.DATA_DIR, p.split, p.seed, p.stats.chunk_size)
    pin()
    preprocess(layout.DATA_DIR, stats, p.split, p.seed, layout.PREPROCESSED_DIR)
    pin()
    train(p.train, p.seed, layout.PREPROCESSED_DIR, layout.TRAIN_DIR, resume_dir=layout.TRAIN_RESUME_DIR)
    pin()
    evaluate(p.evaluate, best, layout.PREPROCESSED_DIR, layout.EVALUATE_DIR)
    pin()
    compress(
        p.compress,
        p.train,
        p.seed,
        resolve(p.determinism.num_threads),
        best,
        layout.PREPROCESSED_DIR,
        layout.COMPRESS_DIR,
    )
    pin()
    card = CardContext(data_md5="n/a (plain baseline)", params=p.model_dump(mode="json"))
    result = export(
        p.export,
        resolve(p.determinism.num_threads),
        best,
        layout.PREPROCESSED_DIR,
        layout.COMPRESS_DIR,
        layout.EVALUATE_DIR / "metrics.json",
        layout.EXPORT_DIR,
        card,
    )
    return result.accuracy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.plain_pipeline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--skip-download", action="store_true", help="start from the snapshot in data/")
    args = parser.parse_args(argv)
    print(f"test accuracy: {run(args.params, args.skip_download):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
