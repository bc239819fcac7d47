"""`python -m tasks <stage>`: run one stage (the command each dvc.yaml stage runs).

Exit codes (tasks/core/errors.py): 0 done, 1 the stage failed (a failed download, a corrupt file: a
one-line message naming the file or URL), 2 params.yaml is invalid, 3 refused (another pipeline run
held the project lock too long, a snapshot failed its checks, no export candidate passed its gates);
nothing was written on 2 or 3.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tasks.core.cli import configure_logging, exit_code
from tasks.core.config.params import STAGES
from tasks.core.config.yaml_io import PARAMS_FILE
from tasks.core.lock import pipeline_lock
from tasks.determinism.bootstrap import bootstrap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks", description=__doc__)
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--params", default=PARAMS_FILE, help="params file (default: %(default)s)")
    args = parser.parse_args(argv)
    configure_logging()
    return exit_code(lambda: _run(args.stage, args.params), context=f"{args.stage}: ")


def _run(stage: str, params_file: str) -> int:
    params = bootstrap(params_file)  # before torch and numpy load

    # after bootstrap pinned the process: the runner loads numpy and MLflow (torch once a stage needs it)
    from tasks.runner import run_stage

    # one pipeline run at a time: under `dvc repro` each stage holds the project lock while it runs. The
    # project is the working directory, where the stage reads and writes (tasks/core/layout.py's paths are
    # relative), not where its code lies: the same folder under dvc and make, but a checkout whose code
    # runs other projects (PYTHONPATH) must not make their stages wait for each other.
    with pipeline_lock(f"python -m tasks {stage}", params.orchestration.lock_wait_s, root=Path.cwd()):
        metrics = run_stage(stage, params)
    shown = (f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
    print(f"{stage}: " + ", ".join(shown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
