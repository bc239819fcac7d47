"""`python -m tasks.tools.reproduce RUN_ID`: re-run a past training run and check its weights byte for byte.

RUN_ID is a train stage run, or the pipeline run it belongs to. The run carries what it was made
from (tasks/stages.py logs it under `reproduce/`): the resolved params, `data.dvc` and `dvc.lock`,
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
the paths in its `dvc.lock` and `data.dvc` must stay inside the workspace; and its code is rebuilt
only from a commit on one of this repository's local branches or tags (or named with
`--trust-commit`), never silently from whatever tasks/ holds now (`--use-current-code` asks for
that). DVC remote credentials (`.dvc/config.local`) reach DVC in memory, never a workspace file;
the workspace is private (0700) and what is printed or logged passes tasks/core/redact.py.

Exit codes: 0 byte-identical; 1 the weights differ, or a stage failed (its output tail is shown);
2 refused: an unknown run, not a train or pipeline run, a run logged without `reproduce/`, a record
refused as above, or a data version neither in the DVC cache nor fetchable from the remote. The
project is left as it was, except for data a remote fetch adds to the DVC cache and the MLflow run.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tasks.core import layout
from tasks.core.atomic import write_text
from tasks.core.cli import configure_logging, exit_code, one_line
from tasks.core.config import ConfigError, load_params, load_yaml, shown
from tasks.core.hashing import data_md5, file_digest
from tasks.core.redact import redact
from tasks.determinism import cpu_mode
from tasks.determinism.fingerprint import explain
from tasks.tracking import orphans, runs

log = logging.getLogger("tasks.tools.reproduce")  # not __name__: that is "__main__" under -m

LOGGED_DIR = "reproduce"  # the train run's artifact dir with what it was made from
WEIGHTS = ("best.safetensors", "last.safetensors")
# download is not re-run: the data comes from DVC by hash, the source may have changed since.
STAGES = ("stats", "preprocess", "train")
UPSTREAM = ("stats", "preprocess")  # their outputs are checked against the run's dvc.lock
# Tags that describe the machine rather than the run's inputs; a difference explains different bytes.
MACHINE_TAG_PREFIXES = ("version.", "determinism.", "device")  # hw.*: tasks/determinism/fingerprint.py explain
TAIL_LINES = 25
# What reproduce downloads from a tracking server that others may write to, at most (bytes).
RECORD_FILES = ("params.yaml", "data.dvc", "dvc.lock")  # dvc.lock: optional
MAX_RECORD_BYTES = 1 << 20  # each is a few KB
MAX_WEIGHTS_BYTES = 1 << 30  # each checkpoint; resnet18 in fp32 is 45 MB
# Refs whose commits are the user's own: local branches and tags. Not remote-tracking branches
# (whatever anyone with push rights, or a fetched pull request, put on a remote), refs/pull/*,
# refs/stash or unreachable objects: those need --trust-commit.
TRUSTED_REFS = ("refs/heads", "refs/tags")

# Run in the workspace, by its code and with the stages' environment: what the rebuilt train saw.
_PROBE = """
import json
from tasks.core.config import load_params
params = load_params()
seed = getattr(params, "train_seed", params.seed)  # train.seed (a sweep trial's): code from before it had none
cpu = getattr(params.determinism, "cpu", None)  # None: code from before determinism.cpu (native)
if cpu is not None:  # before torch and numpy load
    from tasks.determinism.cpu_mode import pin_env
    pin_env(cpu)
from tasks.determinism.pinning import pin_everything
from tasks.tracking.runs import lineage_tags
if cpu is None:
    settings = pin_everything(seed, params.determinism.num_threads, params.determinism.strict)
    machine = {}
else:
    from tasks.determinism.fingerprint import fingerprint
    settings = pin_everything(seed, params.determinism.num_threads, params.determinism.strict, cpu)
    machine = fingerprint()
tags = {k: v for k, v in lineage_tags().items() if k.startswith("version.")}
print(json.dumps({**tags, **{f"determinism.{k}": str(v) for k, v in settings.items()}, **machine}))
"""


class ReproduceError(Exception):
    """The run cannot be reproduced (exit 2); the message says which run and why."""


@dataclass(frozen=True)
class Comparison:
    """One file's digest as the run logged it and as the rebuild made it (None: not made)."""

    name: str
    algorithm: str
    logged: str
    rebuilt: str | None

    @property
    def identical(self) -> bool:
        return self.rebuilt == self.logged


@dataclass
class ReproduceReport:
    requested_run_id: str
    run_id: str  # the train stage run that was rebuilt
    experiment_id: str
    code: str  # where the rebuilt code came from
    data_md5: str
    data_from: str = ""  # "DVC cache" or "DVC remote '<name>'"
    stage_seconds: dict[str, float] = field(default_factory=dict)
    failed_stage: str | None = None
    failure_tail: list[str] = field(default_factory=list)
    weights: list[Comparison] = field(default_factory=list)
    upstream: list[Comparison] = field(default_factory=list)  # vs the run's dvc.lock: informative
    machine_now: dict[str, str] = field(default_factory=dict)
    machine_differences: dict[str, dict[str, str]] = field(default_factory=dict)
    explained_by: list[str] = field(default_factory=list)  # fingerprint differences that change bytes
    bytes_expected_to_differ: bool = False  # native mode on another CPU: metrics compared instead
    metrics: dict[str, dict[str, float | None]] = field(default_factory=dict)  # run vs rebuilt
    warnings: list[str] = field(default_factory=list)
    workspace: str | None = None  # kept for inspection (--keep / --workdir)
    reproduce_run_id: str | None = None

    @property
    def identical(self) -> bool:
        return self.failed_stage is None and bool(self.weights) and all(c.identical for c in self.weights)

    @property
    def verdict(self) -> str:
        if self.failed_stage is not None:
            return "stage_failed"
        return "identical" if self.identical else "different"

    @property
    def exit_code(self) -> int:
        return 0 if self.identical else 1

    def to_json(self) -> str:
        data = asdict(self)
        for key in ("weights", "upstream"):
            data[key] = [{**asdict(c), "identical": c.identical} for c in getattr(self, key)]
        return (
            json.dumps(
                {"verdict": self.verdict, "identical": self.identical, "exit_code": self.exit_code, **data}, indent=2
            )
            + "\n"
        )


# --------------------------------------------------------------------------- the run and its record


def _client(tracking_uri: str) -> Any:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # three tiny files: noise
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def find_train_run(client: Any, run_id: str) -> Any:
    """The train stage run `run_id` names: itself, or the one train child of a pipeline run."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        raise ReproduceError(f"run {run_id}: no such run in the tracking store {client.tracking_uri}") from None
    tags = run.data.tags
    stage = tags.get("lockstep.stage")
    if stage == "train":
        return run
    if stage is not None:
        raise ReproduceError(
            f"run {run_id} is a {stage!r} stage run, not a train run: pass its pipeline run "
            f"({tags.get('mlflow.parentRunId', '?')}) or that pipeline's train run"
        )
    entry_point = tags.get("lockstep.entry_point")
    if entry_point == "reproduce":
        raise ReproduceError(f"run {run_id} is a reproduce run (of {tags.get('reproduce.of', '?')}), not a train run")
    if entry_point is None or "mlflow.parentRunId" in tags:
        raise ReproduceError(
            f"run {run_id} is not a lockstep train or pipeline run (it has no lockstep.stage "
            "or lockstep.entry_point tag)"
        )
    children = client.search_runs(
        [run.info.experiment_id],
        filter_string=(f"tags.`mlflow.parentRunId` = '{run_id}' and tags.`lockstep.stage` = 'train'"),
    )
    if len(children) == 1:
        return children[0]
    if not children:
        raise ReproduceError(
            f"run {run_id} is a pipeline run in which the train stage did not run (DVC skips "
            "up-to-date stages): pass the pipeline or train run that trained"
        )
    ids = ", ".join(c.info.run_id for c in children)
    raise ReproduceError(f"run {run_id} is a pipeline run with {len(children)} train stage runs ({ids}): pass one")


def _listed(client: Any, run_id: str, folder: str) -> dict[str, int | None]:
    """The files in one of the run's artifact folders, with the sizes the store reports."""
    return {Path(a.path).name: a.file_size for a in client.list_artifacts(run_id, folder) if not a.is_dir}


def _download_record(client: Any, run: Any, dest: Path) -> Path:
    """Download what the run logged for reproduction, and its checkpoints, into `dest`: the named
    files only (not whatever else the folders hold), each within its size cap."""
    from mlflow.artifacts import download_artifacts

    run_id = run.info.run_id
    logged = _listed(client, run_id, LOGGED_DIR)
    missing = sorted({"params.yaml", "data.dvc"} - set(logged))
    if missing:
        raise ReproduceError(
            f"run {run_id}: lacks the artifacts {', '.join(f'{LOGGED_DIR}/{m}' for m in missing)} "
            "(logged before train runs recorded their inputs): cannot reproduce it"
        )
    checkpoints = _listed(client, run_id, "checkpoints")
    if not set(WEIGHTS) <= set(checkpoints):
        raise ReproduceError(
            f"run {run_id}: its checkpoints ({', '.join(WEIGHTS)}) were not logged: nothing to compare with"
        )
    wanted = {f"{LOGGED_DIR}/{name}": (logged[name], MAX_RECORD_BYTES) for name in RECORD_FILES if name in logged}
    wanted.update({f"checkpoints/{name}": (checkpoints[name], MAX_WEIGHTS_BYTES) for name in WEIGHTS})
    for path, (size, cap) in wanted.items():  # all checked before any is downloaded
        _check_size(run_id, path, size, cap)
    for path, (_, cap) in wanted.items():
        folder = dest / Path(path).parent
        folder.mkdir(parents=True, exist_ok=True)
        got = download_artifacts(
            run_id=run_id, artifact_path=path, dst_path=str(folder), tracking_uri=client.tracking_uri
        )
        _check_size(run_id, path, Path(got).stat().st_size, cap)  # the store may not know a size
    return dest


def _check_size(run_id: str, path: str, size: int | None, cap: int) -> None:
    if size is not None and size > cap:
        raise ReproduceError(f"run {run_id}: its artifact {path} is {size} bytes, more than the {cap} reproduce reads")


# --------------------------------------------------------------------------- what the record may ask for


def _check_params(record: Path, run_id: str) -> dict[str, Any]:
    """The run's params, validated as params.yaml is, and asking for this machine only; the raw mapping."""
    path = record / LOGGED_DIR / "params.yaml"
    try:
        params = load_params(path)
    except ConfigError as exc:
        raise ReproduceError(
            f"run {run_id}: its {LOGGED_DIR}/params.yaml is refused: {str(exc).removeprefix(f'{path}: ')}"
        ) from None
    train = params.train
    if train.nnodes != 1:
        # Other machines would join through the c10d rendezvous at rdzv_endpoint, and torch unpickles
        # what that store sends: a rebuild rendezvouses with nothing but itself.
        raise ReproduceError(
            f"run {run_id}: its params ask for train.nnodes: {train.nnodes} (a rendezvous with other machines "
            f"at train.rdzv_endpoint {shown(train.rdzv_endpoint)}): reproduce rebuilds on this machine only"
        )
    cached = layout.download_cache() / "weights" / str(train.pretrained_sha256)
    if train.pretrained_url is not None and not cached.is_file():
        # A URL in someone else's record is a request to a host they chose: the rebuild uses a
        # verified copy already here (the train stage caches downloads by digest), or nothing.
        raise ReproduceError(
            f"run {run_id}: its params fetch pretrained weights from {shown(redact(train.pretrained_url))}: "
            f"reproduce downloads nothing a run names; put the file (sha256 {train.pretrained_sha256}) at "
            f"{cached} and run again"
        )
    cores = os.cpu_count() or 1
    if train.strategy == "ddp" and train.nproc_per_node > cores:
        raise ReproduceError(
            f"run {run_id}: its params ask for train.nproc_per_node: {train.nproc_per_node} processes, more than "
            f"this machine's {cores} cores: reproduce it on a machine like the run's"
        )
    return _record_yaml(record, "params.yaml", run_id)


def _safe_relative(value: object) -> bool:
    """A relative POSIX path that stays below its root by its text (no `..`, no absolute, no drive)."""
    if not isinstance(value, str) or not value or not value.isprintable() or "\\" in value:
        return False
    if value.startswith("/") or re.match(r"^[A-Za-z]:", value):
        return False
    normal = posixpath.normpath(value)
    return normal not in (".", "..") and not normal.startswith("../")


def _record_yaml(record: Path, name: str, run_id: str) -> Any:
    """One of the run's YAML files, read as params.yaml is (no aliases, no duplicate keys)."""
    try:
        return load_yaml((record / LOGGED_DIR / name).read_text(encoding="utf-8"))
    except (ConfigError, yaml.YAMLError, UnicodeDecodeError) as exc:
        cause = " ".join(str(exc).split())
        raise ReproduceError(f"run {run_id}: its {LOGGED_DIR}/{name} is refused: {shown(cause, 200)}") from None


def _check_record_paths(record: Path, run_id: str) -> None:
    """data.dvc and the run's dvc.lock name paths the rebuild checks out and hashes: inside the workspace only."""
    where = f"run {run_id}: its {LOGGED_DIR}"
    dvc_file = _record_yaml(record, "data.dvc", run_id)
    outs = dvc_file.get("outs") if isinstance(dvc_file, dict) else None
    if not (isinstance(outs, list) and len(outs) == 1 and isinstance(outs[0], dict)):
        raise ReproduceError(f"{where}/data.dvc is refused: expected one entry under outs")
    if outs[0].get("path") != str(layout.DATA_DIR):
        raise ReproduceError(
            f"{where}/data.dvc is refused: its output path is {shown(outs[0].get('path'))}, "
            f"expected {str(layout.DATA_DIR)!r}"
        )
    lock_file = record / LOGGED_DIR / "dvc.lock"
    if not lock_file.exists():
        return
    lock = _record_yaml(record, "dvc.lock", run_id) or {}
    stages = lock.get("stages", {}) if isinstance(lock, dict) else None
    if not isinstance(stages, dict) or not all(isinstance(entry, dict) for entry in stages.values()):
        raise ReproduceError(f"{where}/dvc.lock is refused: expected a mapping of stages")
    for name, entry in stages.items():
        for kind in ("deps", "outs"):
            items = entry.get(kind, [])
            if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
                raise ReproduceError(f"{where}/dvc.lock is refused: stage {shown(name)}: {kind} is not a list")
            for item in items:
                if not _safe_relative(item.get("path")):
                    raise ReproduceError(
                        f"{where}/dvc.lock is refused: stage {shown(name)} names the path {shown(item.get('path'))}, "
                        "outside the workspace (absolute, or with '..')"
                    )


def _inside(workspace: Path, relative: str) -> Path:
    """`workspace / relative`, refused if it resolves outside the workspace (a symlink on the way)."""
    path = workspace / relative
    if not path.resolve().is_relative_to(workspace.resolve()):
        raise ReproduceError(f"{relative}: resolves outside the workspace ({path.resolve()}): not hashed")
    return path


# --------------------------------------------------------------------------- the workspace


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


def _code_source(project: Path, run: Any, trust_commit: str | None, use_current_code: bool) -> str | None:
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


def _checkout_code(project: Path, run: Any, commit: str | None, workspace: Path, warnings: list[str]) -> str:
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


def _write_inputs(record: Path, workspace: Path, params: dict[str, Any]) -> None:
    """The run's params (validated; tracking off: the rebuild logs no stage runs), data.dvc and dvc.lock."""
    params.setdefault("tracking", {})["enabled"] = False
    (workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.copyfile(record / LOGGED_DIR / "data.dvc", workspace / layout.DATA_DVC)
    lock = record / LOGGED_DIR / "dvc.lock"
    if lock.exists():
        shutil.copyfile(lock, workspace / "dvc.lock")
    else:  # the commit's dvc.lock would describe some other pipeline state
        (workspace / "dvc.lock").unlink(missing_ok=True)


def _configure_dvc(project: Path, workspace: Path) -> tuple[str, str | None, dict[str, Any]]:
    """Make the workspace a DVC repo on the project's cache; return (cache dir, default remote, the
    project's config for `Repo(config=...)`: its remotes' credentials reach DVC in memory, no file)."""
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


def _bring_data(project: Path, workspace: Path, run_id: str, data_md5: str) -> str:
    """Check the run's data version out of the DVC cache, else pull it from the default remote."""
    from dvc.exceptions import CheckoutError, DvcException
    from dvc.repo import Repo

    cache_dir, remote, config = _configure_dvc(project, workspace)
    target = [str(workspace / layout.DATA_DVC)]
    with Repo(str(workspace), config=config) as repo:
        try:
            repo.checkout(targets=target)
            return "DVC cache"
        except CheckoutError:
            pass  # not (all) in the cache: fetch it
        named = repr(remote) if remote else "(none configured)"
        refusal = (
            f"run {run_id}: data version {data_md5} is not in the DVC cache ({cache_dir}) and could not be "
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


# --------------------------------------------------------------------------- the rebuild


def _stage_env() -> dict[str, str]:
    # The rebuild must not nest under, or log into, a run of whatever launched us; and it computes
    # in the mode the run's params name (each stage pins it), not in ours.
    return cpu_mode.clean_env({k: v for k, v in os.environ.items() if k not in (runs.PARENT_ENV, "MLFLOW_RUN_ID")})


def _run_stage(stage: str, workspace: Path, env: dict[str, str]) -> tuple[int, list[str]]:
    """`python -m tasks <stage>` in the workspace, its output passed on to our log; (exit code, output tail)."""
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    with subprocess.Popen(
        [sys.executable, "-m", "tasks", stage],
        cwd=workspace,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            log.info("  %s | %s", stage, tail[-1])
    return proc.returncode, list(tail)


def _rebuild(workspace: Path, report: ReproduceReport, env: dict[str, str]) -> None:
    for stage in STAGES:
        log.info("reproduce: running %s", stage)
        start = time.monotonic()
        code, tail = _run_stage(stage, workspace, env)
        report.stage_seconds[stage] = round(time.monotonic() - start, 2)
        if code != 0:
            report.failed_stage, report.failure_tail = stage, [f"(exit {code})", *tail]
            return


def _compare_weights(record: Path, workspace: Path) -> list[Comparison]:
    rebuilt = workspace / layout.TRAIN_DIR
    return [
        Comparison(
            name,
            "sha256",
            file_digest(record / "checkpoints" / name),
            file_digest(rebuilt / name) if (rebuilt / name).exists() else None,
        )
        for name in WEIGHTS
    ]


def _compare_upstream(workspace: Path, data_md5: str, warnings: list[str]) -> list[Comparison]:
    """Stats and preprocess outputs vs the md5s in the run's dvc.lock, where it describes this data."""
    lock_file = workspace / "dvc.lock"
    if not lock_file.exists():
        return []
    from dvc.repo import Repo
    from dvc_data.hashfile.build import build

    stages = (load_yaml(lock_file.read_text(encoding="utf-8")) or {}).get("stages", {})  # checked on download
    checked = {name: stages.get(name) or {} for name in UPSTREAM}
    checked = {
        name: entry
        for name, entry in checked.items()
        if any(dep["path"] == "data" and dep.get("md5") == data_md5 for dep in entry.get("deps", []))
    }
    warnings += [
        f"the run's dvc.lock has no {name} entry for data {data_md5}: its outputs not checked"
        for name in UPSTREAM
        if name not in checked
    ]
    # every path first, then hash: a symlink out of the workspace stops the comparison before any read
    outs = [(out, _inside(workspace, out["path"])) for entry in checked.values() for out in entry.get("outs", [])]
    found: list[Comparison] = []
    with Repo(str(workspace)) as repo:
        for out, path in outs:
            digest = None
            if path.exists():  # DVC's own md5 (a directory's is over its listing): the lock's algorithm
                _, _, obj = build(repo.cache.local, str(path), repo.fs, "md5", dry_run=True, ignore=repo.dvcignore)
                digest = obj.hash_info.value
            found.append(Comparison(out["path"], "md5", str(out.get("md5")), digest))
    return found


def _machine_now(workspace: Path, env: dict[str, str], warnings: list[str]) -> dict[str, str]:
    """The rebuild's library versions, device and determinism settings, named like the run's tags."""
    probe = subprocess.run([sys.executable, "-c", _PROBE], cwd=workspace, env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        warnings.append(f"could not read this machine's versions and determinism settings: {last}")
        return {}
    now = json.loads(probe.stdout.strip().splitlines()[-1])
    train_json = workspace / layout.TRAIN_DIR / "train.json"
    if train_json.exists():
        now["device"] = str(json.loads(train_json.read_text()).get("device"))
    return now


def _machine_differences(run_tags: dict[str, str], now: dict[str, str]) -> dict[str, dict[str, str]]:
    return {
        key: {"run": run_tags[key], "now": value}
        for key, value in sorted(now.items())
        if key.startswith(MACHINE_TAG_PREFIXES) and key in run_tags and run_tags[key] != value
    }


def _explain(report: ReproduceReport, run: Any, workspace: Path) -> None:
    """Which fingerprint differences explain different bytes; metrics when bytes were never expected to match."""
    device = report.machine_now.get("device", "cpu")
    report.explained_by, report.bytes_expected_to_differ = explain(run.data.tags, report.machine_now, device)
    train_json = workspace / layout.TRAIN_DIR / "train.json"
    if report.bytes_expected_to_differ and train_json.exists():
        rebuilt = json.loads(train_json.read_text())
        report.metrics = {
            "best_val_accuracy": {
                "run": run.data.metrics.get("best_val_accuracy"),
                "rebuilt": rebuilt.get("best_val_accuracy"),
            }
        }


def _log_outcome(client: Any, report: ReproduceReport, workdir: Path) -> str:
    """One MLflow run in the original's experiment (not nested: it belongs to no pipeline execution)."""
    tags = {
        "lockstep.entry_point": "reproduce",
        "reproduce.of": report.run_id,
        "reproduce.identical": str(report.identical).lower(),
        "reproduce.verdict": report.verdict,
        "data.md5": report.data_md5,
        **{f"reproduce.logged_sha256.{c.name}": c.logged for c in report.weights},
        **{f"reproduce.sha256.{c.name}": str(c.rebuilt) for c in report.weights},
        **report.machine_now,
        **orphans.owner_tags(),  # a kill before it ends leaves it to the next sweep
    }
    run = client.create_run(report.experiment_id, run_name=f"reproduce {report.run_id[:8]}", tags=tags)
    report.reproduce_run_id = run.info.run_id
    for stage, seconds in report.stage_seconds.items():
        client.log_metric(run.info.run_id, f"{stage}_seconds", seconds)
    path = workdir / "reproduce.json"
    path.write_text(redact(report.to_json()))
    client.log_artifact(run.info.run_id, str(path))
    client.set_terminated(run.info.run_id, "FAILED" if report.failed_stage else "FINISHED")
    return run.info.run_id


def _workdir(workdir: Path | None) -> Path:
    """A private (0700) directory for the record and the workspace: it holds what the run logged."""
    if workdir is None:
        return Path(tempfile.mkdtemp(prefix="lockstep-reproduce-"))  # 0700
    workdir = Path(workdir).resolve()
    if workdir.exists() and any(workdir.iterdir()):
        raise ReproduceError(f"--workdir {workdir} is not empty: give a new or empty directory")
    workdir.mkdir(parents=True, exist_ok=True)
    workdir.chmod(0o700)
    return workdir


def _old_launcher(workspace: Path, params: dict[str, Any]) -> list[str]:
    """A warning when the commit's DDP launcher predates loopback-only rendezvous (tasks/train/launcher.py)."""
    launcher = workspace / "tasks" / "ddp.py"
    ddp = (params.get("train") or {}).get("strategy") == "ddp"
    if not ddp or not launcher.exists() or "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in launcher.read_text():
        return []
    return [
        "the run's commit launches DDP with torchrun --standalone, whose c10d stores listened on every "
        "network interface during the rebuild (fixed in later commits: loopback only)"
    ]


def reproduce(
    run_id: str,
    workdir: Path | None = None,
    *,
    keep: bool = False,
    tracking_uri: str | None = None,
    project: Path | None = None,
    log_run: bool = True,
    trust_commit: str | None = None,
    use_current_code: bool = False,
) -> ReproduceReport:
    """Rebuild train run `run_id` (or a pipeline run's one train stage) and compare its weights.

    `workdir` (kept afterwards) holds `record/` (what the run logged) and `workspace/` (the rebuild);
    by default a temporary directory, removed at the end unless `keep`. Raises ReproduceError when
    the run cannot be reproduced, or its record is refused (module docstring): before anything is
    checked out or run. `trust_commit` names a commit to rebuild although no local branch or tag holds
    it; `use_current_code` rebuilds with the current tasks/ when the run's commit is not here.
    """
    client = _client(tracking_uri or runs.tracking_uri())
    project = (project or layout.project_root()).resolve()
    run = find_train_run(client, run_id)
    root = _workdir(workdir)
    log.info("reproduce %s: working in %s", run_id, root)
    try:
        train_id = run.info.run_id
        record = _download_record(client, run, root / "record")
        params = _check_params(record, train_id)
        _check_record_paths(record, train_id)
        commit = _code_source(project, run, trust_commit, use_current_code)
        workspace = root / "workspace"
        workspace.mkdir()
        report = ReproduceReport(
            requested_run_id=run_id,
            run_id=train_id,
            experiment_id=run.info.experiment_id,
            code="",
            data_md5=data_md5(record / LOGGED_DIR / "data.dvc"),
        )
        report.code = _checkout_code(project, run, commit, workspace, report.warnings)
        report.warnings += _old_launcher(workspace, params)
        _write_inputs(record, workspace, params)
        log.info("reproduce %s: data %s, code from %s", train_id, report.data_md5, report.code)
        report.data_from = _bring_data(project, workspace, train_id, report.data_md5)
        env = _stage_env()
        _rebuild(workspace, report, env)
        if report.failed_stage is None:
            report.weights = _compare_weights(record, workspace)
            report.upstream = _compare_upstream(workspace, report.data_md5, report.warnings)
            report.machine_now = _machine_now(workspace, env, report.warnings)
            report.machine_differences = _machine_differences(run.data.tags, report.machine_now)
            _explain(report, run, workspace)
        if workdir is not None or keep:
            report.workspace = str(workspace)
        if log_run:
            _log_outcome(client, report, root)
        return report
    finally:
        if workdir is None and not keep:
            shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------- the CLI


def format_report(report: ReproduceReport) -> str:
    """A few lines for a human; the first is the verdict."""
    run_id = report.run_id
    if report.failed_stage is not None:
        lines = [
            f"reproduce {run_id}: stage {report.failed_stage} failed: weights not compared",
            *(f"  | {line}" for line in report.failure_tail),
        ]
    else:
        lines = []
        for c in report.weights:
            said = (
                f"byte-identical (sha256 {c.logged})"
                if c.identical
                else f"DIFFERS (logged sha256 {c.logged}, rebuilt {c.rebuilt})"
            )
            lines.append(f"reproduce {run_id}: {c.name} {said}" if not lines else f"  {c.name}: {said}")
    for c in report.upstream:
        lines.append(f"  {c.name}: md5 {'matches' if c.identical else 'differs from'} the run's dvc.lock")
    seconds = sum(report.stage_seconds.values())
    lines.append(
        f"  rebuilt from {report.code}, data {report.data_md5} ({report.data_from}); "
        f"{', '.join(report.stage_seconds)} in {seconds:.1f} s"
    )
    if report.machine_differences:
        lines.append("  library versions or determinism settings differ from the run's:")
        lines += [f"    {key}: run {d['run']}, now {d['now']}" for key, d in report.machine_differences.items()]
    if report.machine_now and not report.identical and report.failed_stage is None:
        lines += _why_different(report)
    elif report.machine_now and report.identical:
        lines.append("  same library versions, device and determinism settings as the run")
    lines += [f"  warning: {w}" for w in report.warnings]
    if report.reproduce_run_id:
        lines.append(f"  logged as MLflow run {report.reproduce_run_id} (experiment {report.experiment_id})")
    if report.workspace:
        lines.append(f"  workspace kept: {report.workspace}")
    return "\n".join(lines)


def _why_different(report: ReproduceReport) -> list[str]:
    if report.bytes_expected_to_differ:
        compared = [
            f"    {name}: run {_number(v['run'])}, rebuilt {_number(v['rebuilt'])}"
            for name, v in report.metrics.items()
        ]
        return [
            "  the run was made in native mode (determinism.cpu) on another CPU: its bytes are not expected "
            "to match here; its metrics instead:",
            *compared,
            *(f"    {line}" for line in report.explained_by),
        ]
    if report.explained_by:
        return ["  explained by the machine's fingerprint:", *(f"    {line}" for line in report.explained_by)]
    if report.machine_differences:
        return ["  explained by the differences above"]
    return [
        "  same fingerprint (CPU mode, kernels, threads, versions) and settings as the run: the weights should "
        "have been identical (a reproducibility bug: please report it with both runs' hw.* tags)"
    ]


def _number(value: float | None) -> str:
    return "not recorded" if value is None else f"{value:.4f}"


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
    orphans.sweep(_client(runs.tracking_uri()), None, "python -m tasks.tools.reproduce")  # runs left RUNNING by kills
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
                "exit_code": 2,
                "requested_run_id": args.run_id,
                "error": redact(str(exc)),
            }
            write_text(args.json, json.dumps(refused, indent=2) + "\n")
        return 2
    print(redact(format_report(report)))
    if args.json:
        write_text(args.json, redact(report.to_json()))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
