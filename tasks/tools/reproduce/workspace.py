"""Where a rebuild happens: a private directory, the run's code at its commit, its inputs, and its
data version checked out of the project's DVC cache (or pulled from the default remote).

The code is rebuilt only from a commit on one of this repository's local branches or tags (or named
with `--trust-commit`), never silently from whatever tasks/ holds now (`--use-current-code` asks for
that). DVC remote credentials (`.dvc/config.local`) reach DVC in memory, never a workspace file; the
workspace is private (0700).
"""

from __future__ import annotations

import io
import logging
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from tasks.core import layout
from tasks.core.cli import one_line
from tasks.core.config.base import shown
from tasks.core.redact import redact
from tasks.core.tar import tarfile
from tasks.tools.reproduce.record import LOGGED_DIR, ReproduceError

log = logging.getLogger("tasks.tools.reproduce")  # the package's one logger, as the CLI configures it

# Refs whose commits are the user's own: local branches and tags. Not remote-tracking branches
# (whatever anyone with push rights, or a fetched pull request, put on a remote), refs/pull/*,
# refs/stash or unreachable objects: those need --trust-commit.
TRUSTED_REFS = ("refs/heads", "refs/tags")


def make_workdir(workdir: Path | None) -> Path:
    """A private (0700) directory for the record and the workspace: it holds what the run logged."""
    if workdir is None:
        return Path(tempfile.mkdtemp(prefix="lockstep-reproduce-"))  # 0700
    workdir = Path(workdir).resolve()
    if workdir.exists() and any(workdir.iterdir()):
        raise ReproduceError(f"--workdir {workdir} is not empty: give a new or empty directory")
    workdir.mkdir(parents=True, exist_ok=True)
    workdir.chmod(0o700)
    return workdir


def _git(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=project, capture_output=True, text=True)


def _has_commit(project: Path, commit: str) -> bool:
    if not re.fullmatch(r"[0-9a-f]{40}", commit):  # e.g. "none (not a git repository)"
        return False
    return _git(project, "cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


def _is_trusted(project: Path, commit: str, trust_commit: str | None) -> bool:
    """On a local branch or tag (an ancestor of one, or its head), or the commit the user named."""
    if trust_commit is not None:
        named = _git(project, "rev-parse", "--verify", "--quiet", f"{trust_commit}^{{commit}}").stdout.strip()
        if named == commit:
            return True
    holding = _git(project, "for-each-ref", "--contains", commit, "--format=%(refname)", *TRUSTED_REFS)
    return holding.returncode == 0 and bool(holding.stdout.strip())


def code_source(project: Path, run: Any, trust_commit: str | None, use_current_code: bool) -> str | None:
    """The run's commit when its code may be rebuilt; None: the current tasks/ (asked for). Else refused."""
    commit = run.data.tags.get("git.commit", "none")
    run_id = run.info.run_id
    if shutil.which("git") and _has_commit(project, commit):
        if _is_trusted(project, commit, trust_commit):
            return commit
        raise ReproduceError(
            f"run {run_id}: its commit {commit} is on no local branch or tag of {project} (a stash, a fetched "
            "pull request or remote branch, an unreachable object?): its code is not rebuilt unless you name it "
            f"with --trust-commit {commit}"
        )
    if use_current_code:
        return None
    raise ReproduceError(
        f"run {run_id}: its commit {shown(commit)} is not in the repository at {project}: fetch it, or pass "
        "--use-current-code to rebuild with the current tasks/ (which may differ from the run's)"
    )


def checkout_code(project: Path, run: Any, commit: str | None, workspace: Path, warnings: list[str]) -> str:
    """Put the run's code (`commit`, or the current tasks/) in `workspace`; return where it came from."""
    if commit is not None:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", commit], cwd=project, capture_output=True, check=True
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(workspace, filter="data")
        if run.data.tags.get("git.dirty") == "true":
            warnings.append(
                f"the run was made with uncommitted changes to commit {commit[:12]}: they were not "
                "recorded, so the rebuild used the commit as committed"
            )
        return f"git commit {commit}"
    # --use-current-code: the stages need only tasks/.
    shutil.copytree(project / "tasks", workspace / "tasks", ignore=shutil.ignore_patterns("__pycache__"))
    commit_tag = shown(run.data.tags.get("git.commit", "none"))
    warnings.append(
        f"the run's commit ({commit_tag}) is not in the repository at {project}: rebuilt with the "
        "current tasks/ code (--use-current-code), which may differ from the run's"
    )
    return f"current tasks/ in {project} (commit {commit_tag} not found; --use-current-code)"


def write_inputs(record: Path, workspace: Path, params: dict[str, Any]) -> None:
    """The run's params (validated; tracking off: the rebuild logs no stage runs), data.dvc and dvc.lock."""
    params.setdefault("tracking", {})["enabled"] = False
    (workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.copyfile(record / LOGGED_DIR / "data.dvc", workspace / layout.DATA_DVC)
    lock = record / LOGGED_DIR / "dvc.lock"
    if lock.exists():
        shutil.copyfile(lock, workspace / "dvc.lock")
    else:  # the commit's dvc.lock would describe some other pipeline state
        (workspace / "dvc.lock").unlink(missing_ok=True)


def configure_dvc(project: Path, workspace: Path) -> tuple[str, str | None, dict[str, Any]]:
    """Make the workspace a DVC repo on the project's cache; return (cache dir, default remote, the
    project's config for `Repo(config=...)`: its remotes' credentials reach DVC in memory, no file)."""
    # heavy: dvc (~0.7 s); `--help` and argument errors stay fast
    from dvc.config import Config, merge

    # The project's config as it is now (not the commit's): remotes and the cache may have moved.
    source = Config(dvc_dir=str(project / ".dvc"), validate=False)
    cache_dir = str(source["cache"].get("dir") or project / ".dvc" / "cache")
    dvc_dir = workspace / ".dvc"
    workspace_only = {
        "core": {"no_scm": True, "site_cache_dir": str(dvc_dir / "tmp" / "site")},  # no git; DVC's state goes
        "cache": {"dir": cache_dir},  # with the workspace
    }
    in_memory: dict[str, Any] = {}
    for level in ("repo", "local"):  # local: credentials that are not committed
        merge(in_memory, source.load_one(level))
    merge(in_memory, workspace_only)
    shutil.rmtree(dvc_dir, ignore_errors=True)
    dvc_dir.mkdir()
    config = Config.init(str(dvc_dir))
    with config.edit("repo") as conf:  # what is no secret: `Repo(workspace)` without `in_memory` works too
        merge(conf, workspace_only)
    return cache_dir, source["core"].get("remote"), in_memory


def bring_data(project: Path, workspace: Path, run_id: str, data_md5: str) -> str:
    """Check the run's data version out of the DVC cache, else pull it from the default remote."""
    # heavy: dvc (~0.7 s); `--help` and argument errors stay fast
    from dvc.exceptions import CheckoutError, DvcException
    from dvc.repo import Repo

    cache_dir, remote, config = configure_dvc(project, workspace)
    target = [str(workspace / layout.DATA_DVC)]
    with Repo(str(workspace), config=config) as repo:
        try:
            repo.checkout(targets=target)
            return "DVC cache"
        except CheckoutError:
            pass  # not (all) in the cache: fetch it
        named = repr(remote) if remote else "(none configured)"
        refusal = (
            f"run {run_id}: data version {shown(data_md5)} is not in the DVC cache ({cache_dir}) and could not be "
            f"fetched from remote {named}: cannot reproduce"
        )
        if remote is None:
            raise ReproduceError(refusal)
        with _dvc_errors() as logged:
            try:
                repo.pull(targets=target)
            except CheckoutError:  # the remote does not have it either: DVC's first error names what is missing
                raise ReproduceError(refusal + (f" (dvc: {_dvc_line(logged[0])})" if logged else "")) from None
            except DvcException as exc:  # e.g. unreachable remote, credentials: say so, in DVC's words
                raise ReproduceError(f"{refusal} (dvc: {_dvc_line(logged[0] if logged else str(exc))})") from None
        for message in logged:  # errors DVC got past (a pull that succeeded anyway): still shown
            log.warning("dvc: %s", one_line(message))
    return f"DVC remote {remote!r}"


def _dvc_line(text: str) -> str:
    """DVC's message on one line, without its colours, secrets masked, bounded."""
    return redact(" ".join(re.sub(r"\x1b\[[0-9;]*m", "", text).split()))[:400]


@contextmanager
def _dvc_errors() -> Iterator[list[str]]:
    """DVC's error messages during the block, collected instead of printed: DVC (and its dvc_data)
    logs a failed fetch with its whole traceback, and only the first line ("failed to connect to s3
    ... Forbidden") says what is wrong. Its other messages go to its own handlers as before."""
    messages: list[str] = []
    loggers = [logging.getLogger(name) for name in ("dvc", "dvc_data", "dvc_objects")]
    saved = {logger.name: list(logger.handlers) for logger in loggers}

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR:
                exc = record.exc_info[1] if record.exc_info else None
                cause = (exc.__cause__ or exc) if exc else None  # botocore's "(403) ... Forbidden" under s3fs's
                messages.append(record.getMessage() + (f": {cause}" if cause else ""))
                return
            for handler in saved[self.name]:
                if record.levelno >= handler.level:
                    handler.handle(record)

    propagate = {logger.name: logger.propagate for logger in loggers}
    for logger in loggers:
        collect = Collect()
        collect.name = logger.name
        logger.handlers, logger.propagate = [collect], False  # nor to the root logger's handler
    try:
        yield messages
    finally:
        for logger in loggers:
            logger.handlers, logger.propagate = saved[logger.name], propagate[logger.name]
