"""Digests: of a file, and of the data version DVC recorded. The project's one way to compute each."""

from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

from tasks.core.layout import DATA_DVC


def file_digest(path: Path, algorithm: str = "sha256") -> str:
    """The hex digest of a file, read in blocks."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, algorithm).hexdigest()


def data_md5(data_dvc: Path = DATA_DVC) -> str:
    """The md5 DVC recorded for `data/` in `data_dvc` ('none' before the first download)."""
    if not Path(data_dvc).exists():
        return "none"
    outs = (yaml.safe_load(Path(data_dvc).read_text()) or {}).get("outs") or [{}]
    return str(outs[0].get("md5", "none"))
