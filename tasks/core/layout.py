"""Where every stage reads and writes, relative to the project root.

dvc.yaml names the same paths; they are fixed (not params) so that DVC's dependency graph and the
code can never disagree.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

DATA_DIR = Path("data")  # raw snapshot, tracked by data.dvc (never a dvc.yaml output)
DATA_DVC = Path("data.dvc")
ARTIFACTS = Path("artifacts")

DOWNLOAD_RECEIPT = ARTIFACTS / "download" / "receipt.json"
DATA_PROFILE = ARTIFACTS / "download" / "profile.json"  # the snapshot in data/, summarised (tasks/data/checks.py)
# The profile of the snapshot the current model was trained on: what the data checks compare with.
TRAINED_PROFILE = ARTIFACTS / "train" / "data_profile.json"
# The last data check report, refused or not. Not a DVC output: it depends on the history (what was
# trained before), not only on the data.
CHECKS_REPORT = ARTIFACTS / "checks" / "report.json"
STATS_FILE = ARTIFACTS / "stats" / "stats.json"
PREPROCESSED_DIR = ARTIFACTS / "preprocessed"
TRAIN_DIR = ARTIFACTS / "train"
# Not a DVC output: DVC deletes a stage's outputs before re-running it, and this must survive.
TRAIN_RESUME_DIR = ARTIFACTS / "train-resume"
EVALUATE_DIR = ARTIFACTS / "evaluate"
COMPRESS_DIR = ARTIFACTS / "compress"  # models/<variant>.onnx, the compression table, metrics.json
EXPORT_DIR = ARTIFACTS / "export"  # what ships: model.onnx, model_fp32.onnx, .pt2, TorchScript, card


def project_root(code_root: Path = ROOT) -> Path:
    """The repository root, also from inside a `dvc exp run --temp` copy.

    DVC runs temporary experiments in `<root>/.dvc/tmp/exps/<tmp>/`; results tracked outside the
    workspace (the MLflow store) must still land in the real project.
    """
    parts = code_root.parts
    for i in range(len(parts) - 2):
        if parts[i : i + 3] == (".dvc", "tmp", "exps"):
            return Path(*parts[:i])
    return code_root


def download_cache(root: Path | None = None) -> Path:
    """Where downloads are cached (outside data/ and the DVC cache): $LOCKSTEP_DOWNLOAD_CACHE, or
    `.cache/downloads` in the project (shared by `dvc exp run --temp` copies), or in `root`."""
    configured = os.environ.get("LOCKSTEP_DOWNLOAD_CACHE")
    return Path(configured) if configured else (root or project_root()) / ".cache" / "downloads"
