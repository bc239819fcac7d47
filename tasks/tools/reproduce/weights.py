"""Pretrained weights a run's record names, brought to the rebuild without letting the record pick a host or a file.

A record is input, not instruction (record.py). Left to the rebuilt train stage, `train.pretrained_url`,
`train.pretrained_mirror` and torchvision's own host are requests made with the user's credentials to a
host the record chose (or an internal one), and `train.pretrained_path` is a file of the user's that it
reads (a device fills memory; a private file's sha256 would be logged back: an oracle). So reproduce
downloads nothing and reads no file a record names. The weights come from the user's own download cache
only: a regular file whose full sha256 is the one the record pins, copied into the workspace's cache
where the rebuilt stage finds a verified copy and fetches nothing. Else the run is refused, saying where
to put the file. The stages' environment carries no credentials either (rebuild.py `_stage_env`).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.core.config.base import shown
from tasks.core.config.train import TrainConfig
from tasks.core.errors import ExpectedFailure
from tasks.core.hashing import file_digest
from tasks.core.redact import redact
from tasks.tools.reproduce.record import ReproduceError

WORKSPACE_CACHE = Path(".cache") / "downloads"  # the rebuild's download cache (LOCKSTEP_DOWNLOAD_CACHE there)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Weights:
    """The user's verified copy, and the name the rebuilt train stage looks for under its cache's weights/."""

    source: Path
    name: str
    sha256: str


def plan(train: TrainConfig, run: Any, user_cache: Path) -> Weights | None:
    """The copy of the record's pretrained weights in `user_cache` (verified by full sha256); None when the
    record names none. Raises ReproduceError, before anything is checked out, when there is no such copy."""
    run_id = run.info.run_id
    if train.pretrained_path is not None:
        raise ReproduceError(
            f"run {run_id}: its params read pretrained weights from the local file train.pretrained_path "
            f"{shown(train.pretrained_path)}: reproduce reads no file a run names; rebuild it by hand "
            "(python -m tasks train) with that file"
        )
    if train.pretrained_url is not None:
        digest = str(train.pretrained_sha256)  # TrainConfig insists on it
        names = [digest]  # where the train stage caches a URL's file: by its digest
        wanted = f"fetch pretrained weights from {shown(redact(train.pretrained_url))}"
        where = f"put the file (sha256 {digest}) at {user_cache / 'weights' / digest}"
    elif train.pretrained is not None:
        name, digest = _published(train, run)
        names = [name, digest]
        wanted = f"load train.pretrained {train.pretrained} of {train.model} (sha256 {digest})"
        where = f"put the file with that sha256 at {user_cache / 'weights' / name}"
    else:
        return None
    for candidate in names:
        source = user_cache / "weights" / candidate
        if _holds(source, digest, train.pretrained_max_bytes):
            return Weights(source, names[0], digest)
    # the user's files that did not match are not described: their digests are nobody else's business
    raise ReproduceError(
        f"run {run_id}: its params {wanted}: reproduce downloads nothing a run names; {where} and run again"
    )


def _published(train: TrainConfig, run: Any) -> tuple[str, str]:
    """(torchvision's file name, the full sha256 the record pins for it)."""
    # heavy: tasks.train.pretrained loads torch (~4 s), only when published weights are checked
    from tasks.train.pretrained import published_weights

    run_id = run.info.run_id
    try:
        url, prefix = published_weights(train.model, str(train.pretrained))
    except ExpectedFailure as exc:
        raise ReproduceError(f"run {run_id}: its params are refused: {exc}") from None
    name = url.rsplit("/", 1)[-1]
    # The params' pin (required with a mirror), else the digest the run logged as loaded: either is only
    # a key to look the user's own files up by, so a record that lies about it finds nothing.
    digest = train.pretrained_sha256 or run.data.tags.get("pretrained.sha256")
    said = "params pin train.pretrained_sha256" if train.pretrained_sha256 else "pretrained.sha256 tag is"
    if not isinstance(digest, str) or not _SHA256.match(digest):
        raise ReproduceError(
            f"run {run_id}: its params load train.pretrained {train.pretrained} of {train.model} without a full "
            "sha256 (train.pretrained_sha256, or the run's pretrained.sha256 tag): reproduce uses only a copy "
            "in your download cache verified by it, and downloads nothing a run names"
        )
    if not digest.startswith(prefix):
        raise ReproduceError(
            f"run {run_id}: its {said} {digest}, but torchvision publishes {name} as sha256 {prefix}...: not that file"
        )
    return name, digest


def _holds(path: Path, digest: str, max_bytes: int) -> bool:
    """A regular file (not a link: the cache's own files only) of at most `max_bytes` with that sha256."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > max_bytes:
            return False
        return file_digest(path, "sha256") == digest
    except OSError:
        return False


def place(weights: Weights, workspace: Path) -> Path:
    """Copy the verified weights into the workspace's cache, under the name the train stage looks for;
    checked again after the copy (the copy is what the rebuild reads)."""
    dest = workspace / WORKSPACE_CACHE / "weights" / weights.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".reproduce")
    shutil.copyfile(weights.source, part)
    if file_digest(part, "sha256") != weights.sha256:
        part.unlink()
        raise ReproduceError(f"{weights.source}: changed while it was copied into the workspace: run again")
    os.replace(part, dest)
    return dest
