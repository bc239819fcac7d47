"""Reproduce a past training run and check its weights byte for byte: `python -m tasks.tools.reproduce
RUN_ID` (cli.py: what it trusts, its options and exit codes).

- record.py: the run and what it logged (params, data.dvc, dvc.lock, checkpoints), refused when forged
- workspace.py: the private directory, the run's code at its commit, its inputs and data version
- weights.py: the pretrained weights a record names, from the user's own cache by full sha256 or refused
- rebuild.py: `reproduce`, start to end; the stages run again, and the machine they ran on
- report.py: the comparisons, why bytes differ, the report as text, JSON and an MLflow run
"""

from tasks.tools.reproduce.cli import main
from tasks.tools.reproduce.rebuild import reproduce
from tasks.tools.reproduce.record import ReproduceError, find_train_run
from tasks.tools.reproduce.report import Comparison, ReproduceReport, format_report

__all__ = ["Comparison", "ReproduceError", "ReproduceReport", "find_train_run", "format_report", "main", "reproduce"]
