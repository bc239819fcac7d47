"""Accuracy and time per data source: the default pipeline on realistic data of our own making.

    python -m benchmarks.sources [--sources mnist cifar10 ...] [--train-images 6000] [--test-images 1000]

For each built-in source the check data of benchmarks/synthetic_images/ is written in that source's
published format (MNIST's gzipped IDX files, the CIFAR-10 python archive; an ImageFolder tar.gz with
train/ and test/) and served from a loopback HTTP server; the download stage fetches and verifies it
like the real files, then every later stage runs as `python -m tasks <stage>` in a project folder of
its own, with params.yaml's defaults (`epochs`, `random_shift`, `hflip`: auto) and tracking off.

    mnist          glyphs: 28x28 grey handwritten digits     fashion_mnist  garments: 28x28 grey clothes
    cifar10        shapes: 32x32 RGB objects on clutter      imagefolder    shapes as PNGs in train/ test/
    cifar100       shapes100: shapes x 10 hue bands          digits         scikit-learn's 8x8 digits (offline)

`--real-sets NAME ...` runs the same pipeline on real images instead: the sets of
benchmarks/real_sets/ (built first if they are not, `make real-sets`), each through the `imagefolder`
source with `data.path` at its folder, so the split is the pipeline's own. Their rows also give macro
recall (the mean of the classes' recalls), which a model that ignores a small class cannot hide.

The published checksums are those of the real files, so this process points torchvision's tables
(md5 of each file) at the generated ones, as tests/data/test_download.py does; nothing else is changed.
A table per source goes to stdout and `<out>/sources.json` (`real-sets.json`): images, epochs, train seconds, fp32 test
accuracy, the shipped variant and its accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.fakedata.archives import pack
from benchmarks.fakedata.cifar import cifar_archive
from benchmarks.fakedata.mnist import mnist_files
from benchmarks.harness import ROOT, machine
from benchmarks.httpserver import FileServer
from benchmarks.real_sets.sets import SETS
from benchmarks.synthetic_images.datasets import DATASETS, generate
from benchmarks.synthetic_images.writers import write_imagefolder
from tasks.core.atomic import write_text
from tasks.core.config.data import DataConfig
from tasks.core.config.yaml_io import load_params, load_yaml
from tasks.data.download import download

DATASET = {
    "mnist": "glyphs",
    "fashion_mnist": "garments",
    "cifar10": "shapes",
    "cifar100": "shapes100",
    "imagefolder": "shapes",
}
STAGES_AFTER_DOWNLOAD = ("stats", "preprocess", "train", "evaluate", "compress", "export")


Tables = dict[type, dict[str, Any]]  # torchvision dataset class -> its checksum attributes for our files


def publish(source: str, served: Path, url: str, train_images: int, test_images: int) -> tuple[dict[str, Any], Tables]:
    """Write `source`'s files under `served` (to be reachable at `url`): about `train_images` and
    `test_images` in its published train and test sets, the same number of each class.

    Returns the data section that downloads them, and the torchvision checksum tables that name
    them (set them on the classes for as long as the download runs).
    """
    # heavy: torchvision (~3 s beyond torch), only for its checksum tables
    import torchvision

    if source == "digits":
        return {"source": "digits"}, {}
    name = DATASET[source]
    classes = len(DATASETS[name].classes)
    per_class, test_per_class = train_images // classes, test_images // classes
    if source == "imagefolder":
        write_imagefolder(served / "tree", name, seed=0, splits={"train": per_class, "test": test_per_class})
        sha = pack(served / "tree", served / "shapes.tar.gz", "tar.gz", prefix="shapes")
        return {"source": source, "url": f"{url}/shapes.tar.gz", "sha256": sha}, {}
    train_x, train_y, _ = generate(name, per_class, seed=0)
    test_x, test_y, _ = generate(name, test_per_class, seed=0, start=per_class)
    if source in ("cifar10", "cifar100"):
        archive = cifar_archive(served, source, given=(train_x, train_y, test_x, test_y))
        tables = {key: getattr(archive, key) for key in ("tgz_md5", "train_list", "test_list", "meta")}
        cls = torchvision.datasets.CIFAR10 if source == "cifar10" else torchvision.datasets.CIFAR100
        return {"source": source, "mirror": f"{url}/"}, {cls: tables}
    files = mnist_files(served, given=(train_x[..., 0], train_y, test_x[..., 0], test_y))
    cls = torchvision.datasets.MNIST if source == "mnist" else torchvision.datasets.FashionMNIST
    return {"source": source, "mirror": f"{url}/"}, {cls: {"resources": files.resources}}


def _project(folder: Path, data: dict[str, Any], variants: list[str], train: dict[str, Any]) -> Path:
    """A project folder: params.yaml as the repository's, but this source, no MLflow, `variants` built."""
    params = load_yaml((ROOT / "params.yaml").read_text())
    params["data"].update(data)
    params["train"].update(train)
    params["tracking"]["enabled"] = False
    params["compress"]["variants"] = variants
    params["export"]["candidates"] = [v for v in params["export"]["candidates"] if v in variants or v == "fp32"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return folder


def _stage(project: Path, stage: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tasks", stage], cwd=project, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{project.name}: {stage} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return time.perf_counter() - t0


def run_source(
    source: str, work: Path, train_images: int, test_images: int, variants: list[str], train: dict[str, Any]
) -> dict:
    """One source through the whole pipeline; its row of the table."""
    served = work / source / "served"
    served.mkdir(parents=True, exist_ok=True)
    with FileServer() as server:
        data, tables = publish(source, served, server.url, train_images, test_images)
        for cls, attributes in tables.items():  # this process only downloads: no need to put them back
            for key, value in attributes.items():
                setattr(cls, key, value)
        for path in served.rglob("*"):
            if path.is_file():
                server.add_file("/" + path.relative_to(served).as_posix(), path)
        project = _project(work / source / "project", data, variants, train)
        t0 = time.perf_counter()
        download(DataConfig(**data), project / "data", work / source / "cache")
        seconds = {"download": time.perf_counter() - t0}
    return {"source": source, **_run_stages(project, seconds)}


def run_real_set(name: str, work: Path, variants: list[str], train: dict[str, Any]) -> dict:
    """A real image set (benchmarks/real_sets/) through the whole pipeline as an image folder; its row."""
    # here, not at the top: only --real-sets needs the registry clients' code and Pillow's conversions
    from benchmarks.real_sets.build import build

    built = build(name, say=lambda line: print(line, file=sys.stderr))
    data = {"source": "imagefolder", "path": str(built.folder), "channels": SETS[name].channels}
    project = _project(work / name / "project", data, variants, train)
    t0 = time.perf_counter()
    download(DataConfig(**data), project / "data", work / name / "cache")
    row = _run_stages(project, {"download": time.perf_counter() - t0})
    return {"source": f"real:{name}", "classes": len(built.counts), "imbalance": round(built.ratio, 2), **row}


def _run_stages(project: Path, seconds: dict[str, float]) -> dict[str, Any]:
    """Every stage after download, each as its own `python -m tasks` process; what the row reports."""
    seconds |= {stage: _stage(project, stage) for stage in STAGES_AFTER_DOWNLOAD}
    artifacts = project / "artifacts"
    pre = json.loads((artifacts / "preprocessed" / "meta.json").read_text())
    history = json.loads((artifacts / "train" / "history.json").read_text())
    gates = json.loads((artifacts / "export" / "gates.json").read_text())
    metrics = json.loads((artifacts / "evaluate" / "metrics.json").read_text())
    trained = json.loads((artifacts / "train" / "train.json").read_text())
    return {
        "images": pre["split_sizes"],
        "shape": pre["image_shape"],
        "model": load_params(project / "params.yaml").train.model,  # auto resolved
        "epochs": len(history),
        "auto": {key: choice["value"] for key, choice in trained.get("recipe", {}).items()},  # chosen from the data
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "test_accuracy": metrics["accuracy"],
        "macro_recall": metrics["macro_recall"],
        "shipped": gates["variant"],
        "shipped_accuracy": gates["accuracy"],
        "fallback_reason": gates["fallback_reason"],
        "compress": json.loads((artifacts / "compress" / "metrics.json").read_text()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sources", description=__doc__.split("\n")[0])
    parser.add_argument("--sources", nargs="+", default=["digits", *DATASET], choices=["digits", *DATASET])
    parser.add_argument("--real-sets", nargs="+", choices=list(SETS), help="real image sets instead of --sources")
    parser.add_argument("--train-images", type=int, default=6000, help="in the published train set (all classes)")
    parser.add_argument("--test-images", type=int, default=1000, help="in the published test set (all classes)")
    parser.add_argument("--variants", nargs="+", default=["static_int8"], help="compress.variants to build")
    parser.add_argument("--epochs", type=int, help="train.epochs (default: auto, the source's recipe)")
    parser.add_argument("--model", help="train.model (default: params.yaml's)")
    parser.add_argument("--out", type=Path, default=ROOT / "artifacts" / "bench-sources")
    args = parser.parse_args(argv)
    rows = []
    train = {key: value for key, value in (("epochs", args.epochs), ("model", args.model)) if value}
    for name in args.real_sets or ():
        rows.append(run_real_set(name, args.out, args.variants, train))
        print(json.dumps(rows[-1]), flush=True)
    for source in () if args.real_sets else args.sources:
        rows.append(run_source(source, args.out, args.train_images, args.test_images, args.variants, train))
        print(json.dumps(rows[-1]), flush=True)
    report = {"machine": machine(), "train_images": args.train_images, "test_images": args.test_images, "rows": rows}
    write_text(args.out / ("real-sets.json" if args.real_sets else "sources.json"), json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
