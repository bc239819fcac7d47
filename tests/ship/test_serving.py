"""The served model (tasks/ship/serving.py) called in-process, without a server: a request's images are
bounded together, not only one by one. A PNG of a few kB may declare data.max_image_pixels, and a
request may hold MAX_IMAGES of them: ~14 CPU-minutes of decoding for one 8 MB request. Every row's
header is read first, and a request over its pixel budget is refused before any image is decoded.
The real server, and its answers to bad requests: tests/ship/test_serve.py."""

from __future__ import annotations

import io
import types
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from mlflow.exceptions import MlflowException
from PIL import Image

from tasks.ship import serving
from tests.support.tiny_onnx import tiny_model

MAX_PIXELS = 10_000


@pytest.fixture
def model(tmp_path: Path) -> serving.ImageClassifier:
    served = serving.ImageClassifier()
    artifacts = {serving.ARTIFACT: str(tiny_model(tmp_path / "model.onnx", ["a", "b"]))}
    served.load_context(types.SimpleNamespace(artifacts=artifacts, model_config={"max_pixels": MAX_PIXELS}))
    return served


def _png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (width, height)).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def test_a_request_over_its_pixel_budget_is_refused_before_decoding(
    model: serving.ImageClassifier, monkeypatch: pytest.MonkeyPatch
) -> None:
    budget = serving.REQUEST_PIXELS_PER_IMAGE_BOUND * MAX_PIXELS
    image = _png(100, 100)  # as many pixels as one image may have
    assert len(model.predict(None, pd.DataFrame({"image": [image] * serving.REQUEST_PIXELS_PER_IMAGE_BOUND}))) == 4

    decoded: list[Any] = []
    monkeypatch.setattr(serving, "decode", lambda *args, **kwargs: decoded.append(args))
    rows = serving.REQUEST_PIXELS_PER_IMAGE_BOUND + 1
    with pytest.raises(MlflowException) as refused:
        model.predict(None, pd.DataFrame({"image": [image] * rows}))
    assert refused.value.error_code == "INVALID_PARAMETER_VALUE" and not decoded
    assert refused.value.message == (
        f"{rows} images of {rows * MAX_PIXELS} pixels in all; at most {budget} a request "
        f"({serving.REQUEST_PIXELS_PER_IMAGE_BOUND} x data.max_image_pixels): send fewer or smaller images"
    )


def test_a_bad_row_is_still_named_before_the_budget(model: serving.ImageClassifier) -> None:
    """Each row's own bounds come first: the answer names the row a client must fix."""
    for bad, message in ((b"hello", "row 1: not a readable image"), (_png(101, 100), "row 1: 101x100 = 10100")):
        with pytest.raises(MlflowException, match=message):
            model.predict(None, pd.DataFrame({"image": [_png(4, 4), bad]}))
