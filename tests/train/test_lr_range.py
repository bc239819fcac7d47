"""benchmarks/lr_range.py: the learning-rate range test behind docs/training.md's choice of a fixed lr."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.lr_range import range_test
from tests.conftest import write_params


@pytest.fixture
def project(pre: Path, tmp_path: Path) -> Path:
    write_params(tmp_path / "params.yaml", {"train": {"batch_size": 32}})
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "preprocessed").symlink_to(pre)
    return tmp_path


def test_the_range_test_sweeps_the_rates_and_is_seeded(project: Path) -> None:
    first, again = (range_test(project, steps=16, low=1e-3, high=1000.0) for _ in range(2))
    assert first == again  # the same data and seed: the same curve, to the bit
    rates = [rate for rate, _ in first["curve"]]
    assert rates[0] == pytest.approx(1e-3) and rates[1] / rates[0] == pytest.approx((1000.0 / 1e-3) ** (1 / 15))
    assert first["train_lr"] == 0.05
    # up to 1000: the loss ran away (measured: 2.3 at the start, 34 at step 14), and the test stopped there
    assert first["steps"] < 16 and first["curve"][-1][1] > 4 * min(loss for _, loss in first["curve"])


def test_a_recipe_the_range_test_does_not_apply_is_refused_by_name(project: Path) -> None:
    write_params(project / "params.yaml", {"train": {"mixup_alpha": 0.2}})
    with pytest.raises(ValueError, match=r"params.yaml: the range test does not apply train.{'mixup_alpha': 0.2}"):
        range_test(project, steps=4, low=1e-3, high=1.0)
