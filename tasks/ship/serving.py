"""The registered model: the shipped ONNX file behind a small MLflow pyfunc that takes image bytes.

MLflow's onnx flavour serves a float tensor (N, C, H, W): a client would have to decode, convert and
resize images itself, and get it subtly wrong. This wrapper takes the image files' bytes and decodes
them with the same rules as ingest (tasks/data/images.py), so

    mlflow models serve -m models:/lockstep-classifier@champion --env-manager local

answers `POST /invocations` with a JSON body

    {"dataframe_split": {"columns": ["image"], "data": [["<base64 of a PNG/JPEG/... file>"], ...]}}

by `{"predictions": [{"class": "7", "probability": 0.99, "top_k": "7:0.9912 1:0.0051 9:0.0013"}, ...]}`,
one per image, in order (the column is typed `binary` in the signature, so MLflow decodes the base64).
An image that is not base64, does not decode, or is too large, and a batch that is too large, fail
the request with a 400 naming the row; the server never sees more than `MAX_IMAGES` images or
`MAX_IMAGE_BYTES` per image decoded, nor decodes more pixels a request than its budget (every row's
header is read first: `REQUEST_PIXELS_PER_IMAGE_BOUND`).

MLflow loads this file as "models from code" (no pickle): `load_context` opens the ONNX artifact.
It imports only tasks/data/images.py, tasks/core/errors.py and tasks/ship/onnx_model.py (logged with the model as its
code, tasks/tracking/registry.py `_log_models`), never torch.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models import set_model
from mlflow.pyfunc import PythonModel

from tasks.core.errors import ExpectedFailure
from tasks.data.images import decode, mode_of, open_checked
from tasks.ship.onnx_model import model_input, predict, session, top_k, top_k_text

COLUMN = "image"
ARTIFACT = "onnx"  # the key of the ONNX file among the model's artifacts
MAX_IMAGES = 1024  # per request
MAX_IMAGE_BYTES = 20 << 20  # per image file, before decoding
# Pixels a request may decode, in all its images together, as a multiple of max_pixels (one image's
# bound): a tiny PNG can declare max_pixels, so MAX_IMAGES of them in one 8 MB request were ~14
# CPU-minutes of decoding. Four of the largest images, or ~1000 of 0.2 M pixels: seconds of CPU.
REQUEST_PIXELS_PER_IMAGE_BOUND = 4
TOP_K = 3


class ImageClassifier(PythonModel):
    def load_context(self, context: Any) -> None:
        self._session = session(context.artifacts[ARTIFACT], threads=(context.model_config or {}).get("threads", 1))
        self._input = model_input(self._session)
        self._max_pixels = int((context.model_config or {}).get("max_pixels", 50_000_000))

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        if not isinstance(model_input, pd.DataFrame) or COLUMN not in model_input.columns:
            raise MlflowException.invalid_parameter_value(f"expected a column {COLUMN!r} of image bytes")
        if len(model_input) > MAX_IMAGES:
            raise MlflowException.invalid_parameter_value(f"{len(model_input)} images; at most {MAX_IMAGES} a request")
        if len(model_input) == 0:  # an empty batch is an empty answer (np.stack would raise: a 500-like 400)
            return pd.DataFrame({"class": [], "probability": np.array([], float), "top_k": []})
        self._check_pixels(model_input[COLUMN])
        images = np.stack([self._decode(i, data) for i, data in enumerate(model_input[COLUMN])])
        logits = predict(self._session, images.transpose(0, 3, 1, 2))
        order, probabilities = top_k(logits, min(TOP_K, len(self._input.classes)))
        classes = self._input.classes
        return pd.DataFrame(
            {
                "class": [classes[row[0]] for row in order],
                "probability": probabilities[:, 0].astype(float),
                "top_k": [top_k_text(classes, o, p) for o, p in zip(order, probabilities, strict=True)],
            }
        )

    def _check_pixels(self, rows: pd.Series) -> None:
        """Every row's header read (nothing decoded), the request refused if its images hold more pixels
        than `REQUEST_PIXELS_PER_IMAGE_BOUND` x max_pixels together, before any is decoded."""
        budget, total = REQUEST_PIXELS_PER_IMAGE_BOUND * self._max_pixels, 0
        for row, data in enumerate(rows):
            try:
                with open_checked(io.BytesIO(_image_bytes(row, data)), self._max_pixels, f"row {row}") as image:
                    total += image.size[0] * image.size[1]
            except ExpectedFailure as exc:
                raise MlflowException.invalid_parameter_value(str(exc)) from None
        if total > budget:
            raise MlflowException.invalid_parameter_value(
                f"{len(rows)} images of {total} pixels in all; at most {budget} a request "
                f"({REQUEST_PIXELS_PER_IMAGE_BOUND} x data.max_image_pixels): send fewer or smaller images"
            )

    def _decode(self, row: int, data: Any) -> np.ndarray:
        data = _image_bytes(row, data)
        mode, size = mode_of(self._input.channels), self._input.size
        try:
            return decode(io.BytesIO(data), mode, size, self._max_pixels, name=f"row {row}")
        except ExpectedFailure as exc:
            raise MlflowException.invalid_parameter_value(str(exc)) from None


def _image_bytes(row: int, data: Any) -> bytes | bytearray:
    """`data` if it is one image file's bytes, not too many; a 400 naming the row otherwise."""
    if isinstance(data, str):  # a client that skipped the signature's base64 decoding
        raise MlflowException.invalid_parameter_value(f"row {row}: {COLUMN} is text, not base64 image bytes")
    if not isinstance(data, bytes | bytearray) or len(data) > MAX_IMAGE_BYTES:
        got = f"{len(data)} bytes" if isinstance(data, bytes | bytearray) else type(data).__name__
        raise MlflowException.invalid_parameter_value(f"row {row}: {got}, not image bytes up to {MAX_IMAGE_BYTES}")
    return data


set_model(ImageClassifier())
