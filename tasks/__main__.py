"""`python -m tasks <stage>`: run one stage (the command each dvc.yaml stage runs).

Exit codes: 0 done, 1 the stage failed, 2 params.yaml is invalid (nothing was written).
"""

from __future__ import annotations

import argparse
import sys

from tasks.config import PARAMS_FILE, STAGES, ConfigError, load_params


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks", description=__doc__)
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--params", default=PARAMS_FILE, help="params file (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        params = load_params(args.params)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from tasks.stages import run_stage  # heavy imports (torch, MLflow) only after validation

    metrics = run_stage(args.stage, params)
    shown = (f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
    print(f"{args.stage}: " + ", ".join(shown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
