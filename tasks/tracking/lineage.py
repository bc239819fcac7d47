"""Where a run came from, as MLflow tags: the code (git commit, dirty or not), the data and pipeline
state (by hash), library versions and host, the process that owns it; and MLflow's own context tags
with any secret masked.

Read by every run tasks/tracking/runs.py starts, and by `make reproduce` to compare the machine it
rebuilds on with the run's.
"""

from __future__ import annotations

import getpass
import json
import os
import platform
import subprocess
import sys
import urllib.parse
from importlib.metadata import entry_points, version
from pathlib import Path

import psutil

from tasks.core.hashing import data_md5, file_digest
from tasks.core.redact import redact, redact_mapping
from tasks.tracking.owners import owner_tags, session_key

SESSION_TAG = "lockstep.session"  # a DVC session's pipeline run: its key (tasks/tracking/owners.py session_key)


def _git(*args: str, cwd: str | None = None) -> str | None:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, check=True, timeout=30, cwd=cwd)
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


def pipeline_tags(entry_point: str) -> dict[str, str]:
    """What a pipeline run is tagged with when it starts: its entry point, lineage and owner (this process)."""
    return redact_mapping({"lockstep.entry_point": entry_point, **lineage_tags(), **owner_tags()})


def session_tags(entry_point: str, owner: tuple[str, psutil.Process]) -> dict[str, str]:
    """A DVC session's pipeline run's tags: its session key, entry point, lineage and owner (the dvc process)."""
    tags = {SESSION_TAG: session_key(owner), "lockstep.entry_point": entry_point, **lineage_tags()}
    return redact_mapping({**tags, **owner_tags(owner[1])})


def context_tags() -> dict[str, str] | None:
    """The tags MLflow's `start_run` gives a run from a script on this machine (its default, git and
    MLFLOW_RUN_CONTEXT providers), computed without importing MLflow (~2 s), secrets masked; None where
    another of its providers may add tags (a plugin's, Databricks', a notebook's) or the user name may
    come from MLflow's credentials file: then only MLflow itself knows them.
    """
    if (
        any(name.startswith("DATABRICKS_") for name in os.environ)
        or "ipykernel" in sys.modules
        or (Path.home() / ".mlflow" / "credentials").exists()
        or entry_points(group="mlflow.run_context_provider")
    ):
        return None
    main = sys.argv[0] if sys.argv and sys.argv[0] else None
    tags = {
        "mlflow.user": os.environ.get("MLFLOW_TRACKING_USERNAME") or getpass.getuser(),
        "mlflow.source.name": main or "<console>",
        "mlflow.source.type": "LOCAL",
    }
    if main is not None:
        tags |= _git_context(main)
    if os.environ.get("MLFLOW_RUN_CONTEXT"):
        tags |= json.loads(os.environ["MLFLOW_RUN_CONTEXT"])
    return {key: redact(str(value)) for key, value in tags.items()}


def _git_context(main: str) -> dict[str, str]:
    """mlflow.source.git.* as MLflow's GitRunContext reads them with GitPython: the commit (unless the
    script's folder is git-ignored), the branch, the first remote's URL without its credentials."""
    folder = os.path.dirname(os.path.abspath(main)) if os.path.isfile(main) else main
    commit = _git("rev-parse", "HEAD", cwd=folder) if os.path.isdir(folder) else None
    if commit is None or _git("check-ignore", "-q", folder, cwd=folder) is not None:
        return {}
    tags = {"mlflow.source.git.commit": commit}
    branch = _git("symbolic-ref", "--short", "-q", "HEAD", cwd=folder)
    if branch:
        tags["mlflow.source.git.branch"] = branch
    remotes = (_git("config", "--local", "--get-regexp", r"^remote\..*\.url$", cwd=folder) or "").splitlines()
    if remotes:
        url = remotes[0].split(" ", 1)[1]
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme and "@" in parsed.netloc:
            url = urllib.parse.urlunsplit(parsed._replace(netloc=parsed.netloc.rpartition("@")[2]))
        tags["mlflow.source.git.repoURL"] = url
    return tags
