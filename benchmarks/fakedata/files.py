"""Bytes on disk, reproducibly: files written whole, gzip without a timestamp, and their digests."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path


def md5_bytes(data: bytes) -> str:
    """Hex md5 of ``data`` (the digest torchvision checks)."""
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def md5_file(path: Path) -> str:
    """Hex md5 of a file's bytes."""
    return md5_bytes(Path(path).read_bytes())


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    return sha256_bytes(Path(path).read_bytes())


def write_file(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path``, making its folders; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def gzip_bytes(data: bytes) -> bytes:
    """``data`` gzipped at level 9, the same bytes on every call."""
    # mtime=0 keeps the gzip header free of the wall clock, so the bytes (and md5) are reproducible.
    return gzip.compress(data, compresslevel=9, mtime=0)
