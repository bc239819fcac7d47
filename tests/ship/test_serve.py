"""Serve the champion over HTTP with MLflow's own server (`mlflow models serve`), as the README says, and
check it answers as `python -m tasks.tools.predict` does on the same image files, and refuses bad requests
with a 4xx, never a 500."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tasks.ship.serving import MAX_IMAGE_BYTES, MAX_IMAGES
from tests.conftest import free_port, service
from tests.tools.test_predict import predict, rows, write_split_pngs

pytestmark = pytest.mark.slow


def _post(url: str, body: bytes) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def _body(images: list[bytes], column: str = "image") -> bytes:
    """The documented request: one column `image`, each row an image file's bytes in base64."""
    data = [[base64.b64encode(image).decode()] for image in images]
    return json.dumps({"dataframe_split": {"columns": [column], "data": data}}).encode()


def _huge_png() -> bytes:
    """A 60 kB file that decodes to more pixels than data.max_image_pixels allows (a decompression bomb)."""
    import io

    buffer = io.BytesIO()
    Image.new("L", (10_000, 6_000)).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def test_mlflow_serves_the_champion_over_http_like_predict(dvc_repo: dict[str, Any], tmp_path: Path) -> None:
    repo, port = dvc_repo["repo"], free_port()
    files = sorted(write_split_pngs(repo, tmp_path / "split").rglob("*.png"))[:40]
    predict(repo, *map(str, files), "--out", str(tmp_path / "expected.csv"))
    expected = rows(tmp_path / "expected.csv")
    serve = ["mlflow", "models", "serve", "-m", "models:/lockstep-classifier@champion", "--env-manager", "local"]
    # started outside the project (cwd tmp_path): the registered model carries the code it runs
    with service(
        [*serve, "-h", "127.0.0.1", "-p", str(port)],
        tmp_path,
        f"http://127.0.0.1:{port}/ping",
        tmp_path / "serve.log",
        MLFLOW_TRACKING_URI=f"sqlite:///{repo / 'mlflow.db'}",
    ):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=10) as ping:
            assert ping.status == 200
        url = f"http://127.0.0.1:{port}/invocations"
        status, answer = _post(url, _body([path.read_bytes() for path in files]))
        assert status == 200, answer
        served = answer["predictions"]
        assert [p["class"] for p in served] == [r["class"] for r in expected]
        assert [p["top_k"] for p in served] == [r["top_k"] for r in expected]
        assert np.allclose([p["probability"] for p in served], [float(r["probability"]) for r in expected], atol=1e-6)

        one = files[0].read_bytes()
        bad = {  # what each must be refused for: a word of the reason the answer gives
            "not JSON": (b"{", "Invalid input"),
            "not base64": (json.dumps({"dataframe_split": {"columns": ["image"], "data": [["%%%"]]}}).encode(), ""),
            "not an image": (_body([b"hello"]), "not a readable image"),
            "no image column": (_body([one], column="picture"), ""),
            "too many pixels": (_body([_huge_png()]), "more than data.max_image_pixels"),
            "too many bytes": (_body([b"\0" * (MAX_IMAGE_BYTES + 1)]), f"up to {MAX_IMAGE_BYTES}"),
            "too many images": (_body([one] * (MAX_IMAGES + 1)), f"at most {MAX_IMAGES}"),
        }
        for what, (body, reason) in bad.items():
            status, answer = _post(url, body)
            assert 400 <= status < 500 and reason in answer, (what, status, answer[:2000])
        # and it still serves after them; an empty batch is an empty answer
        assert _post(url, _body([one]))[1]["predictions"][0]["class"] == expected[0]["class"]
        assert _post(url, _body([])) == (200, {"predictions": []})
