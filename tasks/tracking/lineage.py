"""Where a run came from, as MLflow tags: the code (git commit, dirty or not), the data and pipeline
state (by hash), library versions and host; and MLflow's own context tags with any secret masked.

Read by every run tasks/tracking/runs.py starts, and by `make reproduce` to compare the machine it
rebuilds on with the run's.
"""

from __future__ import annotations

import platform
import subprocess
from importlib.metadata import version
from pathlib import Path

from tasks.core.hashing import data_md5, file_digest
from tasks.core.redact import redact


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _sha256(path: Path) -> str:
    return file_digest(path) if path.exists() else "none"


def lineage_tags(torch: bool = False) -> dict[str, str]:
    """Where a run came from: code, data, pipeline state and library versions.

    `torch`: the run computes with torch (a model stage, which has pinned and so imported it by now):
    the CUDA/cuDNN versions it computes with are recorded too. A run that computes without it (a data
    stage, a pipeline's parent run) records the installed torch's version alone, never importing it
    (~1 s of every no-op flow run), and whatever this process happens to have loaded meanwhile (the
    flow's process loads torch in a thread while its server starts: flows/pipeline.py).
    """
    commit = _git("rev-parse", "HEAD")
    # dvc.lock and data.dvc are rewritten by the pipeline itself and are recorded by hash below;
    # counting them would mark every run after the first stage as dirty.
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!dvc.lock", ":!data.dvc")
    tags = {
        "git.commit": commit or "none (not a git repository)",
        "git.dirty": "unknown" if status is None else str(bool(status)).lower(),
        "data.md5": data_md5(),
        "dvc_lock.sha256": _sha256(Path("dvc.lock")),
        "version.python": platform.python_version(),
        "version.torch": version("torch"),
        "version.torchvision": version("torchvision"),  # not imported: ~3.5 s
        "host": platform.node(),
    }
    if torch:
        import torch as loaded  # loaded already: the run's stage pinned it (tasks/determinism/bootstrap.py)

        cudnn = loaded.backends.cudnn.version() if loaded.backends.cudnn.is_available() else None
        tags.update(
            {"version.torch": loaded.__version__, "version.cuda": str(loaded.version.cuda), "version.cudnn": str(cudnn)}
        )
    return tags


def redacted_context_tags() -> dict[str, str]:
    """The tags MLflow's start_run adds by itself (git remote URL, source, user) that hold a secret, masked.

    Passed to start_run, they win over MLflow's own values, so the secret is never written at all: a
    remote such as https://oauth2:<token>@host/repo.git would otherwise be stored as mlflow.source.git.repoURL.
    """
    # heavy: mlflow (~4 s), only when a run is logged; the no-op path never loads it
    from mlflow.tracking.context.registry import resolve_tags

    return {key: redact(value) for key, value in resolve_tags().items() if redact(value) != value}
