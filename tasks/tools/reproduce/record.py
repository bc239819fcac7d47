"""What a past train run logged, read as input and not as instruction: the run itself, its record
(`reproduce/`: params, data.dvc, dvc.lock) and its checkpoints, each refused when it asks for more
than a rebuild on this machine may do.

The tracking server may be shared, so anyone who can write runs can plant a record. Its params must
pass params.yaml's validation and ask for one machine (`train.nnodes: 1`); the files downloaded are
capped in size; the paths in its `dvc.lock` and `data.dvc` must stay inside the workspace, and the
md5 in `data.dvc` must be one DVC could have written (DVC makes a cache path of it); and the
pretrained weights it names come from the user's own cache by full sha256, never from a host or a
file the record names (weights.py).
"""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path
from typing import Any

import yaml

from tasks.core import layout
from tasks.core.config.base import ConfigError, shown
from tasks.core.config.params import Params
from tasks.core.config.yaml_io import load_params, load_yaml
from tasks.core.errors import Refused
from tasks.core.fetch import MAX_CHECKPOINT_BYTES

LOGGED_DIR = "reproduce"  # the train run's artifact dir with what it was made from
WEIGHTS = ("best.safetensors", "last.safetensors")
# What reproduce downloads from a tracking server that others may write to, at most (bytes).
RECORD_FILES = ("params.yaml", "data.dvc", "dvc.lock")  # dvc.lock: optional
MAX_RECORD_BYTES = 1 << 20  # each is a few KB
# DVC's md5 of a file, or of a directory's listing ('.dir'). DVC reads the object at
# join(cache, md5[:2], md5[2:]), so any other text ('ab/../../x', 'ab/etc/passwd') names a file outside the
# cache; and the md5 is logged and printed, so it must not carry terminal escapes nor run to a megabyte.
DVC_MD5 = re.compile(r"[0-9a-f]{32}(\.dir)?")


class ReproduceError(Refused):
    """The run cannot be reproduced, and nothing was rebuilt (exit 3); the message says which run and why."""


def tracking_client(tracking_uri: str) -> Any:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # three tiny files: noise
    # heavy: mlflow (~4 s); `--help` and argument errors stay fast
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def find_train_run(client: Any, run_id: str) -> Any:
    """The train stage run `run_id` names: itself, or the one train child of a pipeline run."""
    # heavy: mlflow (~4 s); `--help` and argument errors stay fast
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


def download_record(client: Any, run: Any, dest: Path) -> Path:
    """Download what the run logged for reproduction, and its checkpoints, into `dest`: the named
    files only (not whatever else the folders hold), each within its size cap."""
    # heavy: mlflow (~4 s); `--help` and argument errors stay fast
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
    wanted.update({f"checkpoints/{name}": (checkpoints[name], MAX_CHECKPOINT_BYTES) for name in WEIGHTS})
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


def check_params(record: Path, run_id: str) -> tuple[Params, dict[str, Any]]:
    """The run's params, validated as params.yaml is, and asking for this machine only; with the raw
    mapping (what the rebuild writes back: the commit's code reads it, not this schema)."""
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
    # train.pretrained_*: weights.py brings them from the user's own cache, or refuses the run
    cores = os.cpu_count() or 1
    if train.strategy == "ddp" and train.nproc_per_node > cores:
        raise ReproduceError(
            f"run {run_id}: its params ask for train.nproc_per_node: {train.nproc_per_node} processes, more than "
            f"this machine's {cores} cores: reproduce it on a machine like the run's"
        )
    return params, _record_yaml(record, "params.yaml", run_id)


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


def _check_data_dvc(record: Path, run_id: str) -> None:
    """data.dvc names `data` and, by its md5, the DVC cache object checked out there."""
    where = f"run {run_id}: its {LOGGED_DIR}/data.dvc is refused"
    dvc_file = _record_yaml(record, "data.dvc", run_id)
    outs = dvc_file.get("outs") if isinstance(dvc_file, dict) else None
    if not (isinstance(outs, list) and len(outs) == 1 and isinstance(outs[0], dict)):
        raise ReproduceError(f"{where}: expected one entry under outs")
    if outs[0].get("path") != str(layout.DATA_DIR):
        raise ReproduceError(
            f"{where}: its output path is {shown(outs[0].get('path'))}, expected {str(layout.DATA_DIR)!r}"
        )
    md5 = outs[0].get("md5")
    if not (isinstance(md5, str) and DVC_MD5.fullmatch(md5)):
        raise ReproduceError(
            f"{where}: its outs[0].md5 is {shown(md5)}, expected DVC's md5 (32 hex digits, '.dir' for a directory)"
        )


def check_record_paths(record: Path, run_id: str) -> None:
    """data.dvc and the run's dvc.lock name paths the rebuild checks out and hashes: inside the workspace only."""
    _check_data_dvc(record, run_id)
    where = f"run {run_id}: its {LOGGED_DIR}"
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


def inside(workspace: Path, relative: str) -> Path:
    """`workspace / relative`, refused if it resolves outside the workspace (a symlink on the way)."""
    path = workspace / relative
    if not path.resolve().is_relative_to(workspace.resolve()):
        raise ReproduceError(f"{relative}: resolves outside the workspace ({path.resolve()}): not hashed")
    return path
