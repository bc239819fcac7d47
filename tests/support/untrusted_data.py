"""What the data side's security tests (tests/data/test_security_data.py, test_security_credentials.py)
share besides their fixtures (tests/data/conftest.py): test-sized retries, planted secrets, and the
digests that show a refused download left data/ as it was."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tasks.core.fetch import Checksum, Retry

FAST = Retry(attempts=2, backoff_s=0.01, timeout_s=2.0, deadline_s=30.0)
SECRETS = ("pw-secret-1", "tok-secret-2", "env-secret-3")


def digests(folder: Path) -> dict[str, str]:
    """Each file of `folder` by name -> its sha256."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def checksum(data: bytes) -> Checksum:
    """The published checksum of `data`, as a download is given it."""
    return Checksum("sha256", hashlib.sha256(data).hexdigest())
