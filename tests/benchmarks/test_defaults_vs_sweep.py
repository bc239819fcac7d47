"""benchmarks/defaults_vs_sweep.py's bookkeeping (issue 70.2's table): the training's seconds read from the
train stage's own epoch lines, and a set's row replacing its earlier one. The runs themselves are hours
of real sets (benchmarks/results/real-sets-sweeps.json), not a test."""

from __future__ import annotations

import logging

import pytest

from benchmarks.defaults_vs_sweep import merged, train_seconds
from tasks.train import stage


def test_train_seconds_sum_the_stages_epoch_lines_and_nothing_else(caplog: pytest.LogCaptureFixture) -> None:
    row = {"epoch": 1, "train_loss": 2.0, "train_accuracy": 0.3, "val_loss": 1.7, "val_accuracy": 0.6, "lr": 0.05}
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    # its own handler on the stage's logger: each line once, whatever handlers earlier tests left
    stage.log.addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger=stage.log.name):
            stage._log_epoch(row, 15, 15.3)
            stage._log_epoch({**row, "epoch": 2}, 15, 14.96)
    finally:
        stage.log.removeHandler(handler)
    prefect = "09:00:04.038 | INFO    | tasks.train.stage - "  # as the flow's log shows them
    lines = [prefect + message for message in messages]
    assert len(lines) == 2
    other = "09:00:05.000 | INFO    | tasks.ship.compress - static_int8: built in 0.2 s"
    assert train_seconds("\n".join([*lines, other, "epoch 3/15 was interrupted"])) == 30.3  # 15.3 + 15.0


def test_a_sets_new_row_replaces_its_old_one_and_keeps_the_others() -> None:
    report = {"what": "w", "rows": [{"set": "oxygen_icons", "n": 1}, {"set": "mnist5k", "n": 1}]}
    assert merged(report, {"set": "oxygen_icons", "n": 2}) == {
        "what": "w",
        "rows": [{"set": "mnist5k", "n": 1}, {"set": "oxygen_icons", "n": 2}],
    }
    assert merged({}, {"set": "twemoji"})["rows"] == [{"set": "twemoji"}]
