"""Stage 5 — evaluate: the best checkpoint on the held-out test split.

Outputs (`artifacts/evaluate/`): `metrics.json` (for `dvc metrics show`), `per_class.json`
(precision/recall/F1/support per class), `predictions.csv` (actual and predicted class name of each
test image: the confusion matrix `dvc plots show` draws) and `confusion_matrix.png` (the same
matrix as a picture, for the MLflow UI and readers without a browser).
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.metrics import confusion_matrix, precision_recall_fscore_support

from tasks.core.atomic import atomic_file, write_text
from tasks.core.config.train import EvaluateConfig
from tasks.data.preprocess import load_split
from tasks.train.checkpoints import load_checkpoint
from tasks.train.devices import resolve_device
from tasks.train.models import predict


@dataclass(frozen=True)
class EvaluateResult:
    metrics: dict[str, float]  # accuracy, macro precision/recall/F1, loss, num_samples
    per_class: dict[str, dict[str, float]]
    confusion: list[list[int]]


def evaluate(cfg: EvaluateConfig, checkpoint: Path, pre_dir: Path, out_dir: Path) -> EvaluateResult:
    """Score `checkpoint` on the test split of `pre_dir`; write metrics and plots to `out_dir`."""
    dev = resolve_device(cfg.device)
    test = load_split(pre_dir, "test", stream=True)  # read a block at a time: the split may outgrow memory
    model, _ = load_checkpoint(checkpoint, test)
    logits = predict(model.to(dev), test.images, dev, cfg.batch_size)
    labels = torch.from_numpy(test.labels)
    predicted = logits.argmax(1).numpy()
    classes = list(range(len(test.classes)))
    precision, recall, f1, support = precision_recall_fscore_support(
        test.labels, predicted, labels=classes, zero_division=0
    )
    metrics = {
        "accuracy": float((predicted == test.labels).mean()),
        "loss": float(torch.nn.functional.cross_entropy(logits, labels)),
        "macro_precision": float(precision.mean()),
        "macro_recall": float(recall.mean()),
        "macro_f1": float(f1.mean()),
        "num_samples": len(test.labels),
    }
    per_class = {
        name: {"precision": float(p), "recall": float(r), "f1": float(f), "support": int(s)}
        for name, p, r, f, s in zip(test.classes, precision, recall, f1, support, strict=True)
    }
    confusion = confusion_matrix(test.labels, predicted, labels=classes)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text(out_dir / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    write_text(out_dir / "per_class.json", json.dumps(per_class, indent=2) + "\n")
    write_text(out_dir / "predictions.csv", _predictions_csv(test.labels, predicted, test.classes))
    _plot_confusion(confusion, test.classes, out_dir / "confusion_matrix.png")
    return EvaluateResult(metrics=metrics, per_class=per_class, confusion=confusion.tolist())


def _predictions_csv(actual: np.ndarray, predicted: np.ndarray, classes: list[str]) -> str:
    """One row per test image, by class name: DVC's `confusion` template counts the pairs itself, and
    names (not indices) are what its axes and tooltips then show."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")  # quotes a class name holding a comma
    writer.writerow(["actual", "predicted"])
    writer.writerows((classes[a], classes[p]) for a, p in zip(actual.tolist(), predicted.tolist(), strict=True))
    return buffer.getvalue()


def _plot_confusion(matrix: np.ndarray, classes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    size = max(4.0, 0.5 * len(classes) + 2)
    fig, ax = plt.subplots(figsize=(size, size), dpi=100)
    ax.imshow(matrix, cmap="Blues")
    ax.set(
        xticks=range(len(classes)),
        yticks=range(len(classes)),
        xticklabels=classes,
        yticklabels=classes,
        xlabel="predicted",
        ylabel="true",
        title="confusion matrix (test split)",
    )
    threshold = matrix.max() / 2 if matrix.size else 0
    for (row, col), count in np.ndenumerate(matrix):
        ax.text(
            col, row, str(count), ha="center", va="center", fontsize=8, color="white" if count > threshold else "black"
        )
    fig.tight_layout()
    # PNG metadata carries matplotlib's version and no timestamp: deterministic bytes.
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", metadata={"Software": None})
    plt.close(fig)
