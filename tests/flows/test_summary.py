"""The one line a person reads for each stage (flows/summary.py `brief`)."""

from __future__ import annotations

from flows.summary import brief


def test_accuracy_comes_first_with_its_interval_in_brackets_and_the_rest_is_counted() -> None:
    metrics = {
        "test_loss": 0.66,
        "test_accuracy": 0.7575757,
        "test_accuracy_ci95_low": 0.5897538,
        "test_accuracy_ci95_high": 0.8716829,
        "test_macro_precision": 0.71,
        "test_macro_recall": 0.718,
        "test_macro_f1": 0.7,
        "test_num_samples": 33,
        "extra": 1.0,
    }
    line = brief(metrics)
    assert line.startswith("test_accuracy 0.7576 (95%: 0.59-0.872), test_loss 0.66, ")
    assert "ci95" not in line  # folded into the accuracy, not shown as metrics of their own
    assert line.endswith("test_num_samples 33, … 1 more in its MLflow run")


def test_a_metric_with_half_an_interval_is_shown_as_it_is() -> None:
    assert brief({"accuracy": 0.5, "accuracy_ci95_low": 0.25}) == "accuracy 0.5"
