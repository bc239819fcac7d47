"""`python -m tasks <stage>`: run one stage (the command each dvc.yaml stage runs).

Exit codes: 0 done, 1 the stage failed (bad data or a failed download: a one-line message naming
the file or URL; or another pipeline run held the project lock too long), 2 params.yaml is invalid
(nothing was written).
"""

from __future__ import annotations

import argparse
import logging
import sys

from tasks.config import PARAMS_FILE, STAGES, ConfigError, load_params


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks", description=__doc__)
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--params", default=PARAMS_FILE, help="params file (default: %(default)s)")
    args = parser.parse_args(argv)
    # Our progress at INFO; libraries (ONNX Runtime, onnxscript, ...) only when they warn.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tasks").setLevel(logging.INFO)
    try:
        params = load_params(args.params)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from tasks.data_format import DataError
    from tasks.pipeline_lock import pipeline_lock
    from tasks.stages import run_stage  # heavy imports (torch, MLflow) only after validation

    try:
        # one pipeline run at a time: under `dvc repro` each stage holds the project lock while it runs
        with pipeline_lock(f"python -m tasks {args.stage}", params.orchestration.lock_wait_s):
            metrics = run_stage(args.stage, params)
    except DataError as exc:  # expected failures get a message, not a traceback
        print(f"error: {args.stage}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a full disk met outside our own writes (DVC's, MLflow's): still one line
        from tasks.atomic import WRITE_ERRNOS

        if exc.errno not in WRITE_ERRNOS:
            raise
        print(f"error: {args.stage}: {exc.filename or 'a write'} failed: {exc.strerror}", file=sys.stderr)
        return 1
    shown = (f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
    print(f"{args.stage}: " + ", ".join(shown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
