"""Fixtures the determinism tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """torch's thread count as it was, whatever the test sets."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
