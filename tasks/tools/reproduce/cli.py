"""`python -m tasks.tools.reproduce RUN_ID`: re-run a past training run and check its weights byte for byte.

RUN_ID is a train stage run, or the pipeline run it belongs to. The run carries what it was made
from (tasks/runner.py logs it under `reproduce/`): the resolved params, `data.dvc` and `dvc.lock`,
with the git commit as a tag. In a temporary workspace this rebuilds it — the code at that commit,
those params (tracking off), that data version from the project's DVC cache or default remote —
runs stats → preprocess → train, and compares the sha256 of the new best/last weights with the
logged checkpoints. On the same kind of machine they must be identical; the library versions,
device and determinism settings are compared too, since a difference there explains a mismatch.
The outcome is one MLflow run in the same experiment (tag `reproduce.of`).

    python -m tasks.tools.reproduce RUN_ID [--workdir DIR] [--keep] [--json PATH]
                              [--trust-commit SHA] [--use-current-code]

What it trusts: the tracking server may be shared, so a run's record is input, not instruction.
Its params must pass params.yaml's validation and ask for one machine (`train.nnodes: 1`: a
rebuild joins no rendezvous but its own, on loopback); the files it downloads are capped in size;
the paths in its `dvc.lock` and `data.dvc` must stay inside the workspace, and `data.dvc`'s md5 be
DVC's (32 hex digits); pretrained weights come
from your own download cache by their full sha256 (`train.pretrained_sha256`), never from a URL, a
mirror or a file the run names, and the stages run without credentials or a route out; and its code
is rebuilt only from a commit on one of this repository's local branches or tags (or named with
`--trust-commit`), never silently from whatever tasks/ holds now (`--use-current-code` asks for
that). DVC remote credentials (`.dvc/config.local`) reach DVC in memory, never a workspace file;
the workspace is private (0700) and what is printed or logged passes tasks/core/redact.py.

Exit codes (tasks/core/errors.py): 0 byte-identical; 1 the weights differ, or a stage failed (its
output tail is shown); 2 bad arguments; 3 refused: an unknown run, not a train or pipeline run, a run
logged without `reproduce/`, a record refused as above, pretrained weights not in your download cache,
or a data version neither in the DVC cache nor fetchable from the remote. The project is left as it
was, except for data a remote fetch adds to the DVC cache and the MLflow run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tasks.core.atomic import write_text
from tasks.core.cli import configure_logging, exit_code, one_line
from tasks.core.errors import ExitCode
from tasks.core.redact import redact
from tasks.tools.reproduce.rebuild import reproduce
from tasks.tools.reproduce.record import ReproduceError, tracking_client
from tasks.tools.reproduce.report import format_report
from tasks.tracking import orphans, store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tasks.tools.reproduce",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_id", help="an MLflow train stage run id, or its pipeline run id")
    parser.add_argument("--workdir", type=Path, help="rebuild here (new or empty; kept) instead of a temp dir")
    parser.add_argument("--keep", action="store_true", help="keep the temporary workspace")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    parser.add_argument(
        "--trust-commit",
        metavar="SHA",
        help="rebuild the run's code from this commit although no local branch or tag holds it (you read it)",
    )
    parser.add_argument(
        "--use-current-code",
        action="store_true",
        help="when the run's commit is not in this repository, rebuild with the current tasks/ instead of refusing",
    )
    args = parser.parse_args(argv)
    configure_logging("%(message)s")
    return exit_code(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    # runs left RUNNING by kills
    orphans.mark_orphans_or_warn(tracking_client(store.tracking_uri()), None, "python -m tasks.tools.reproduce")
    try:
        report = reproduce(
            args.run_id,
            args.workdir,
            keep=args.keep,
            trust_commit=args.trust_commit,
            use_current_code=args.use_current_code,
        )
    except ReproduceError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)  # it quotes the run's record
        if args.json:
            refused = {
                "verdict": "refused",
                "identical": False,
                "exit_code": int(ExitCode.REFUSED),
                "requested_run_id": args.run_id,
                "error": redact(str(exc)),
            }
            write_text(args.json, json.dumps(refused, indent=2) + "\n")
        return ExitCode.REFUSED
    # each line as one_line: it quotes the run's tags (library versions), a stranger's text; split on \n only,
    # not splitlines(): a \u2028 in a tag must be escaped, not start a line
    print("\n".join(one_line(line) for line in format_report(report).split("\n")))
    if args.json:
        write_text(args.json, redact(report.to_json()))
    return report.exit_code
