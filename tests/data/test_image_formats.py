"""Issue 35, point 4: images are decoded only as the formats lockstep lists (tasks/data/images.py
`IMG_EXTENSIONS`: PNG, JPEG, BMP, PPM/PGM, TIFF, WebP), chosen by content. An EPS body named .png made
Pillow run Ghostscript; here a fake `gs` on PATH records any call, and ingest (`python -m tasks
download`), predict and the served model (`mlflow models serve`) each refuse the file in one line (a
400 from the server) without calling it. A file in another format Pillow knows is refused (exit 3);
one that no decoder recognises stays unreadable (exit 1)."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks.core.errors import ExitCode
from tasks.data.images import IMG_EXTENSIONS, formats
from tests.conftest import ROOT, VENV_BIN, copy_project, free_port, run, service, subprocess_env, write_params
from tests.support.tiny_onnx import tiny_model

EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 4 4\n0 0 moveto 4 4 lineto stroke\nshowpage\n%%EOF\n"


@pytest.fixture()
def fake_gs(tmp_path: Path) -> tuple[str, Path]:
    """A `gs` first on PATH that records each call in a file: (PATH, the record)."""
    folder, record = tmp_path / "fake-bin", tmp_path / "gs-called"
    folder.mkdir()
    gs = folder / "gs"
    gs.write_text(f'#!/bin/sh\necho "$@" >> {record}\nexit 1\n')
    gs.chmod(0o755)
    return os.pathsep.join([str(VENV_BIN), str(folder), os.environ["PATH"]]), record


def _png(pixel: int = 200, size: int = 4) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((size, size), pixel, np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _decode_in_a_process(path: Path, env_path: str) -> tuple[str, int, str]:
    """decode(path) in a fresh process (Pillow looks for gs once per process): the outcome's class
    name, exit code and message."""
    code = (
        "import sys; from tasks.data.images import decode\n"
        "try:\n    decode(sys.argv[1], 'L', None, 10**6); print('decoded', 0, '')\n"
        "except Exception as exc:\n    print(type(exc).__name__, int(getattr(exc, 'exit_code', 1)), exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        cwd=ROOT,
        env=subprocess_env(PATH=env_path),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    kind, exit_code, message = done.stdout.strip().split(" ", 2)
    return kind, int(exit_code), message


def test_the_decoders_are_the_listed_formats_and_each_decodes_by_content(tmp_path: Path) -> None:
    assert formats() == ("BMP", "JPEG", "PNG", "PPM", "TIFF", "WEBP")
    assert {Image.registered_extensions()[e] for e in IMG_EXTENSIONS} == set(formats())
    from tasks.data.images import decode

    pixels = np.full((4, 4), 200, np.uint8)
    for name in formats():
        path = tmp_path / f"{name.lower()}-named.png"  # the name lies; the content decides
        Image.fromarray(pixels).save(path, format=name, **({"lossless": True} if name == "WEBP" else {}))
        decoded = decode(str(path), "L", None, 10**6)
        assert decoded.shape == (4, 4, 1) and (name == "JPEG" or (decoded[..., 0] == pixels).all()), name


def test_an_eps_named_png_is_refused_without_running_ghostscript(tmp_path: Path, fake_gs: tuple[str, Path]) -> None:
    env_path, record = fake_gs
    (tmp_path / "photo.png").write_bytes(EPS)
    kind, exit_code, message = _decode_in_a_process(tmp_path / "photo.png", env_path)
    assert not record.exists(), f"Ghostscript ran: {record.read_text()}"
    assert (kind, exit_code) == ("Refused", ExitCode.REFUSED), message
    assert "photo.png: its content is EPS, not one of the formats lockstep decodes" in message


def test_other_known_formats_are_refused_and_unknown_bytes_are_unreadable(tmp_path: Path) -> None:
    from tasks.core.errors import ExpectedFailure, Refused
    from tasks.data.images import decode

    gif, broken = io.BytesIO(), tmp_path / "broken.png"
    Image.new("L", (4, 4)).save(gif, format="GIF")
    with pytest.raises(Refused, match="row 0: its content is GIF"):
        decode(gif, "L", None, 10**6, name="row 0")
    broken.write_bytes(b"not an image at all")
    with pytest.raises(ExpectedFailure, match="not a readable image") as raised:
        decode(str(broken), "L", None, 10**6)
    assert raised.value.exit_code == ExitCode.FAILED  # damage, not a refusal
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(_png(size=64)[:60])
    with pytest.raises(ExpectedFailure, match="truncated.png") as raised:
        decode(str(truncated), "L", None, 10**6)
    assert raised.value.exit_code == ExitCode.FAILED


def test_ingest_refuses_an_eps_in_an_image_folder_in_one_line(tmp_path: Path, fake_gs: tuple[str, Path]) -> None:
    env_path, record = fake_gs
    folder = tmp_path / "photos"
    for name, pixel in (("cat", 50), ("dog", 200)):
        (folder / name).mkdir(parents=True)
        for i in range(2):
            (folder / name / f"{i}.png").write_bytes(_png(pixel + i))
    (folder / "dog" / "9.png").write_bytes(EPS)
    repo = copy_project(tmp_path / "repo", {"data": {"source": "imagefolder", "path": str(folder), "channels": 1}})
    done = run(["python", "-m", "tasks", "download"], repo, check=False, PATH=env_path)
    assert not record.exists(), f"Ghostscript ran: {record.read_text()}"
    assert done.returncode == ExitCode.REFUSED, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "dog/9.png: its content is EPS" in done.stderr, done.stderr
    assert not (repo / "data").exists()


def test_predict_lists_an_eps_as_unreadable_in_one_line(tmp_path: Path, fake_gs: tuple[str, Path]) -> None:
    env_path, record = fake_gs
    model = tiny_model(tmp_path / "model.onnx", ["a", "b"])
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "good.png").write_bytes(_png())
    (tmp_path / "in" / "evil.png").write_bytes(EPS)
    params = write_params(tmp_path / "params.yaml", {})
    done = run(
        ["python", "-m", "tasks.tools.predict", "in", "--model", str(model), "--params", str(params)],
        tmp_path,
        check=False,
        PATH=env_path,
        PYTHONPATH=str(ROOT),
    )
    assert not record.exists(), f"Ghostscript ran: {record.read_text()}"
    assert done.returncode == 0 and "1 of 2 images scored" in done.stdout, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "unreadable: in/evil.png: its content is EPS" in done.stderr, done.stderr
    rows = (tmp_path / "predictions.csv").read_text().splitlines()
    assert rows[1].startswith('in/evil.png,,,,"in/evil.png: its content is EPS'), rows


@pytest.mark.slow
def test_the_served_model_answers_an_eps_with_a_400(
    tmp_path: Path, fake_gs: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow

    # save_model records a logged model in the tracking store, its files under ./mlruns: both here,
    # not in the checkout
    from mlflow.tracking._tracking_service import utils as tracking

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setattr(tracking, "_tracking_uri", None)  # (what mlflow.set_tracking_uri set, restored after)
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, Schema

    from tasks.tracking.registry import _serving_code

    env_path, record = fake_gs
    model = tmp_path / "served"
    mlflow.pyfunc.save_model(
        str(model),
        python_model=str(ROOT / "tasks/ship/serving.py"),
        artifacts={"onnx": str(tiny_model(tmp_path / "model.onnx", ["a", "b"]))},
        code_paths=[str(_serving_code(tmp_path / "code"))],
        model_config={"threads": 1, "max_pixels": 10**6},
        signature=ModelSignature(inputs=Schema([ColSpec(DataType.binary, "image")])),  # as registered: base64 in
    )
    port = free_port()
    serve = ["mlflow", "models", "serve", "-m", str(model), "--env-manager", "local", "-h", "127.0.0.1"]
    with service(
        [*serve, "-p", str(port)], tmp_path, f"http://127.0.0.1:{port}/ping", tmp_path / "serve.log", PATH=env_path
    ):

        def post(image: bytes) -> tuple[int, str]:
            rows = [[base64.b64encode(image).decode()]]
            body = json.dumps({"dataframe_split": {"columns": ["image"], "data": rows}}).encode()
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/invocations", data=body, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    return response.status, response.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read().decode(errors="replace")

        assert post(_png())[0] == 200
        status, answer = post(EPS)
        assert status == 400 and "row 0: its content is EPS" in answer, (status, answer[:2000])
        assert post(_png())[0] == 200  # and it still serves
    assert not record.exists(), f"Ghostscript ran: {record.read_text()}"


def test_a_shape_drawn_in_the_alpha_channel_survives_decoding(tmp_path: Path) -> None:
    """Icons are mostly one colour on a transparent background, their shape in the alpha channel:
    dropping alpha (PIL's convert) made every such icon one flat square. Composited over white, two
    shapes stay two images; an image without transparency decodes to exactly its pixels."""
    from tasks.data.images import decode

    def icon(box: tuple[int, int, int, int]) -> Path:
        image = Image.new("RGBA", (16, 16), (46, 52, 54, 0))  # Adwaita's grey, fully transparent
        image.paste((46, 52, 54, 255), box)
        path = tmp_path / f"icon-{box[0]}-{box[2]}.png"
        image.save(path)
        return path

    square, bar = (decode(str(icon(box)), "RGB", None, 10**6) for box in ((4, 4, 12, 12), (0, 6, 16, 10)))
    assert not np.array_equal(square, bar)
    assert square[0, 0].tolist() == [255, 255, 255] and square[8, 8].tolist() == [46, 52, 54]
    grey = decode(str(icon((4, 4, 12, 12))), "L", None, 10**6)
    assert grey[0, 0, 0] == 255 and grey[8, 8, 0] < 60
    plain = np.arange(16 * 16 * 3, dtype=np.uint8).reshape(16, 16, 3)
    Image.fromarray(plain).save(tmp_path / "plain.png")
    assert np.array_equal(decode(str(tmp_path / "plain.png"), "RGB", None, 10**6), plain)
