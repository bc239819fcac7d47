"""Fixtures of the data side's security tests (test_security_data.py, test_security_credentials.py);
a module with fixtures of the same names (test_download.py's server, say) keeps its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from benchmarks.httpserver import FileServer
from tasks.core.credentials import AUTH_ENV, TOKEN_ENV
from tasks.data.formats import RawDataset, write_raw


@pytest.fixture
def server() -> Iterator[FileServer]:
    """A loopback file server whose files can hang or drip."""
    with FileServer(hang_s=30, drip_s=0.05) as srv:
        yield srv


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A data/ holding a snapshot, so that each failure can be shown to leave it as it was."""
    out = tmp_path / "data"
    write_raw(RawDataset(np.arange(8, dtype=np.uint8).reshape(2, 2, 2, 1), np.array([0, 1]), ["a", "b"], "x"), out)
    return out


@pytest.fixture
def no_user_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The developer's own ~/.netrc and tokens stay out of a test (its HOME is its own folder)."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(AUTH_ENV, raising=False)
    monkeypatch.delenv("NETRC", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
