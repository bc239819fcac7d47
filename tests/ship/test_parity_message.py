"""tasks/ship/export.py's parity gates: when they fail, the message says whether the export or the trained
model is at fault (float32 rounds relative to a value's size, so a diverged model's huge logits differ
from any reloaded copy by more than an absolute bound)."""

from __future__ import annotations

import numpy as np

from tasks.ship.export import Gate, _parity_failure


def _gate(measured: float) -> Gate:
    return Gate("fp32 ONNX vs eager max |logit diff|", measured, 1e-4, True)


def test_a_failure_on_ordinary_logits_blames_the_export_alone() -> None:
    """Also where the difference is rounding-sized but the bound was set below float32's rounding: the logits
    are ordinary, so nothing is said of the model."""
    eager = np.array([[3.5, -2.0, 11.0]], np.float32)
    message = _parity_failure([_gate(0.5)], eager)
    assert message == "1 export parity gate(s) failed: fp32 ONNX vs eager max |logit diff| 0.5 > allowed 0.0001"
    assert "own logits" not in _parity_failure(
        [Gate("fp32 ONNX vs eager max |logit diff|", 2.4e-6, 1e-12, True)], eager
    )


def test_huge_logits_that_the_files_match_to_rounding_name_the_model_and_the_way_out() -> None:
    """efficientnet_b0 at lr 0.05 on a folder of 640 images: logits of ~1e8, files within 3808 of them."""
    eager = np.array([[1.2e8, -3.0e7], [4.0, 5.0]], np.float32)
    message = _parity_failure([_gate(3808.0)], eager)
    assert message.startswith("1 export parity gate(s) failed: fp32 ONNX vs eager max |logit diff| 3808 > allowed")
    assert "own logits reach 1.2e+08" in message and "(within 3.2e-05)" in message
    assert "not an export fault" in message and "lower train.lr" in message
    # the same logits with a difference of their own size: an export fault, said as such
    assert "own logits" not in _parity_failure([_gate(5e7)], eager)


def test_logits_that_are_not_finite_say_the_model_diverged() -> None:
    eager = np.array([[np.nan, 1.0], [np.inf, 0.0]], np.float32)
    message = _parity_failure([_gate(float("nan"))], eager)
    assert message.endswith("the trained model's own logits are not finite (it diverged): lower train.lr")
