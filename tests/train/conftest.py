"""What the train tests share: the offline digits, downloaded and preprocessed once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.core.config.data import DataConfig, SplitConfig
from tasks.data.download import download
from tasks.data.preprocess import preprocess
from tasks.data.stats import compute_stats


@pytest.fixture(scope="session")
def pre(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default split of scikit-learn's digits (seed 42), preprocessed: read only."""
    work = tmp_path_factory.mktemp("digits")
    download(DataConfig(), work / "data", work / "cache")
    stats = compute_stats(work / "data", SplitConfig(), 42, 4096)
    preprocess(work / "data", stats, SplitConfig(), 42, work / "preprocessed")
    return work / "preprocessed"
