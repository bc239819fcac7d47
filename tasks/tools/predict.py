"""`python -m tasks.tools.predict <folder|archive|image>...`: score images with the champion, into a CSV.

    python -m tasks.tools.predict photos/ more.tar.gz one.png              # the registry's champion
    python -m tasks.tools.predict photos/ --version 3                      # a given registered version
    python -m tasks.tools.predict photos/ --model artifacts/export/model.onnx   # a given ONNX file
    make predict ARGS="photos/ --out scores.csv"

The model runs in ONNX Runtime on the CPU; each image is decoded as ingest decodes training images
(tasks/data/images.py: the model's channels, resized bilinearly to its size). Folders are read
recursively (files with an image extension, sorted, links not followed; a FIFO, socket or device
named like an image is a row with its error, never opened: it would block); archives are extracted
with the download stage's limits (params.yaml `data`: size, ratio, file count; no path may leave
the extraction folder). The CSV (`--out`, written whole or not at all) has one row per image:
`path,class,probability,top_k,error`, `top_k` as "7:0.9912 1:0.0051 9:0.0013"; a cell that a
spreadsheet would run as a formula (one starting = + - @, a tab or a carriage return: a class name
from the registry, a folder or archive member name) is written with a leading ' (OWASP's advice for
CSV injection, tasks/core/spreadsheet.py), so that it shows as text. An image that does
not decode is a row with its error (and a line on stderr), not the end of the run; exit 1, the CSV
left as it was, when none could be scored or the model cannot be had; 2 on bad arguments. The
registered model's file comes from a tracking server others write to: it is size-bounded
(`promotion.max_champion_bytes`) and refused if it points at external files.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.core.atomic import write_text
from tasks.core.cli import configure_logging, exit_code, one_line
from tasks.core.config.params import Params
from tasks.core.config.yaml_io import PARAMS_FILE, load_params
from tasks.core.errors import ExpectedFailure
from tasks.core.spreadsheet import cell
from tasks.data.archive import ArchiveLimits, extract, is_archive
from tasks.data.images import IMG_EXTENSIONS, decode, mode_of
from tasks.determinism.threads import resolve
from tasks.ship.onnx_model import ModelInput, model_input, predict, session, top_k, top_k_text
from tasks.ship.promotion import CHAMPION, fetch_onnx
from tasks.tracking.store import tracking_uri

BATCH = 256  # images decoded and scored at a time: memory stays flat for any number of files
COLUMNS = ("path", "class", "probability", "top_k", "error")


@dataclass(frozen=True)
class Scored:
    path: str
    label: str = ""
    probability: float | None = None
    top_k: str = ""
    error: str = ""


def predict_files(model: Path, files: list[str], k: int, threads: int, max_pixels: int) -> list[Scored]:
    """Each of `files` scored by the ONNX model at `model`, in order; undecodable ones carry their error."""
    sess = session(model, threads)
    try:
        wanted = model_input(sess)
    except ValueError as exc:
        raise ExpectedFailure(f"{model}: {exc}") from None
    scored: list[Scored] = []
    for start in range(0, len(files), BATCH):
        scored += _score_batch(sess, wanted, files[start : start + BATCH], k, max_pixels)
    return scored


def _score_batch(sess: object, wanted: ModelInput, files: list[str], k: int, max_pixels: int) -> list[Scored]:
    decoded: dict[int, np.ndarray] = {}
    failed: dict[int, str] = {}
    for i, path in enumerate(files):
        try:
            decoded[i] = _decode_regular(path, wanted, max_pixels)
        except ExpectedFailure as exc:
            failed[i] = str(exc)
    rows = {i: Scored(files[i], error=error) for i, error in failed.items()}
    if decoded:
        logits = predict(sess, np.stack(list(decoded.values())).transpose(0, 3, 1, 2))
        order, probabilities = top_k(logits, min(k, len(wanted.classes)))
        for i, o, p in zip(decoded, order, probabilities, strict=True):
            rows[i] = Scored(files[i], wanted.classes[o[0]], float(p[0]), top_k_text(wanted.classes, o, p))
    return [rows[i] for i in range(len(files))]


def _decode_regular(path: str, wanted: ModelInput, max_pixels: int) -> np.ndarray:
    """`decode`, for a regular file only: opening a FIFO named like an image would block for ever."""
    try:
        mode = os.stat(path).st_mode  # a file given by a link is its target (links in folders are skipped)
    except OSError:
        mode = stat.S_IFREG  # gone or unreadable: decode says which
    if not stat.S_ISREG(mode):
        raise ExpectedFailure(f"{path}: not a regular file (a FIFO, socket or device); not opened")
    return decode(path, mode_of(wanted.channels), wanted.size, max_pixels)


def image_files(inputs: list[Path], scratch: Path, limits: ArchiveLimits) -> Iterator[str]:
    """The image files `inputs` name: files as given, folders recursively, archives extracted under `scratch`."""
    for n, given in enumerate(inputs):
        if given.is_symlink() and given.is_dir():
            raise ExpectedFailure(f"{given}: a link to a folder; give the folder itself")
        if given.is_dir():
            yield from _under(given)
        elif given.is_file() and is_archive(given):
            yield from _under(extract(given, scratch / str(n), limits))
        elif given.exists():
            yield str(given)  # a file, or a FIFO or device: a row with its error (_decode_regular)
        else:
            raise ExpectedFailure(f"{given}: no such file or folder")


def _under(folder: Path) -> Iterator[str]:
    for root, dirs, names in os.walk(folder):  # links to folders are not entered (followlinks=False)
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            if os.path.splitext(name)[1].lower() in IMG_EXTENSIONS and not os.path.islink(path):
                yield path


def write_csv(rows: list[Scored], out: Path) -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(COLUMNS)
    for r in rows:
        shown = "" if r.probability is None else f"{r.probability:.6f}"
        writer.writerow([cell(r.path), cell(r.label), shown, cell(r.top_k), cell(r.error)])
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text(out, buffer.getvalue())


def resolve_model(args: argparse.Namespace, params: Params, scratch: Path) -> tuple[Path, str]:
    """The ONNX file to score with, and how to name it: --model, --version N, or the champion."""
    if args.model is not None:
        if not args.model.is_file():
            raise ExpectedFailure(f"{args.model}: no such model file")
        return args.model, str(args.model)
    # heavy: mlflow (~4 s) and the store, only for --version or the champion (not --model)
    import mlflow

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one file: predict reports itself
    mlflow.set_tracking_uri(tracking_uri())
    name, client = params.tracking.registered_model, mlflow.MlflowClient()
    # Asked first, so that a missing model is one line naming it, not MLflow's traceback from the download.
    try:
        if args.version is None:
            version = client.get_model_version_by_alias(name, CHAMPION).version
        else:
            version = client.get_model_version(name, str(args.version)).version
    except mlflow.exceptions.MlflowException:
        wanted = f"@{CHAMPION}" if args.version is None else f"version {args.version}"
        hint = "run the pipeline, or give --version or --model"
        raise ExpectedFailure(f"{name}: no {wanted} in the registry at {tracking_uri()}; {hint}") from None
    return fetch_onnx(name, str(version), scratch, params.promotion.max_champion_bytes), f"{name} v{version}"


def _run(args: argparse.Namespace) -> int:
    params = load_params(args.params)
    data = params.data
    limits = ArchiveLimits(data.max_extracted_bytes, data.max_compression_ratio, data.max_archive_files)
    with tempfile.TemporaryDirectory(prefix="lockstep-predict-") as tmp:
        scratch = Path(tmp)
        files = list(image_files(args.inputs, scratch / "inputs", limits))
        if not files:
            raise ExpectedFailure(f"no image files in {', '.join(map(str, args.inputs))} ({' '.join(IMG_EXTENSIONS)})")
        model, named = resolve_model(args, params, scratch / "model")
        rows = predict_files(model, files, args.top_k, resolve(params.determinism.num_threads), data.max_image_pixels)
        given = [_given_name(r.path, args.inputs, scratch / "inputs") for r in rows]  # the CSV names what was given
        rows = [Scored(g, r.label, r.probability, r.top_k, r.error) for g, r in zip(given, rows, strict=True)]
    failed = [r for r in rows if r.error]
    for row in failed:
        print(f"unreadable: {one_line(row.error)}", file=sys.stderr)
    if len(failed) == len(rows):  # nothing worth a file: an earlier CSV stays as it was
        raise ExpectedFailure(f"none of the {len(rows)} images could be read (listed above)")
    write_csv(rows, args.out)
    print(f"{named}: {len(rows) - len(failed)} of {len(rows)} images scored -> {args.out}")
    return 0


def _given_name(path: str, inputs: list[Path], extracted: Path) -> str:
    """`<extracted>/N/a.png` as `<inputs[N]>!/a.png`; other paths as they are.

    By the folder's whole name, up to its separator: a plain prefix `<extracted>/1` matches input 10's too.
    """
    inside = str(extracted) + os.sep
    if not path.startswith(inside):
        return path
    n, _, member = path[len(inside) :].partition(os.sep)
    return f"{inputs[int(n)]}!/{member}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.tools.predict", description=__doc__.split("\n")[0])
    parser.add_argument("inputs", nargs="+", type=Path, help="image files, folders of them, or archives")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--version", type=int, help="a registered version (default: the @champion alias)")
    which.add_argument("--model", type=Path, help="an ONNX file exported by lockstep, instead of the registry")
    parser.add_argument("--out", type=Path, default=Path("predictions.csv"), help="the CSV (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=3, help="classes listed per image (default: %(default)s)")
    parser.add_argument("--params", default=PARAMS_FILE, help="params file (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.top_k < 1:
        parser.error("--top-k must be 1 or more")
    configure_logging()
    return exit_code(lambda: _run(args), context="predict: ")


if __name__ == "__main__":
    sys.exit(main())
