"""Stage 5 — evaluate: the best checkpoint on the held-out test split.

Outputs (`artifacts/evaluate/`): `metrics.json` (for `dvc metrics show`; the accuracy with its 95%
interval, which says how far a test split of this size can be trusted), `per_class.json`
(precision/recall/F1/support per class), `predictions.csv` (actual and predicted class name of each
test image: the confusion matrix `dvc plots show` draws) and `confusion_matrix.png` (the same
matrix as a picture, for the MLflow UI and readers without a browser).
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tasks.core.atomic import atomic_file, write_text
from tasks.core.config.train import EvaluateConfig
from tasks.data.preprocess import load_split
from tasks.train.checkpoints import load_checkpoint
from tasks.train.devices import resolve_device
from tasks.train.models import predict

Z95 = 1.959963984540054  # the standard normal's 97.5th percentile: a two-sided 95% interval


@dataclass(frozen=True)
class EvaluateResult:
    metrics: dict[str, float]  # accuracy and its 95% interval, macro precision/recall/F1, loss, num_samples
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
    confusion = confusion_matrix(test.labels, predicted, len(test.classes))
    precision, recall, f1, support = class_scores(confusion)
    correct = int((predicted == test.labels).sum())
    low, high = accuracy_interval(correct, len(test.labels))
    metrics = {
        "accuracy": correct / len(test.labels),  # (numpy's mean of the hits: the same float64)
        "accuracy_ci95_low": low,
        "accuracy_ci95_high": high,
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
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text(out_dir / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    write_text(out_dir / "per_class.json", json.dumps(per_class, indent=2) + "\n")
    write_text(out_dir / "predictions.csv", _predictions_csv(test.labels, predicted, test.classes))
    _plot_confusion(confusion, test.classes, out_dir / "confusion_matrix.png")
    return EvaluateResult(metrics=metrics, per_class=per_class, confusion=confusion.tolist())


def accuracy_interval(correct: int, total: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval of an accuracy of `correct` in `total` test images (95% by default).

    On a small test split one image moves the accuracy by points (3 on 33 images), and two recipes
    a few points apart may be one draw of the initialisation apart: the interval says so beside the
    number. Wilson's rather than the textbook p ± z·sqrt(p(1-p)/n), which shrinks to a point at 0 or
    100% and leaves [0, 1] on a small split; Wilson's keeps its coverage there (Brown, Cai and
    DasGupta 2001). It is scipy's `binomtest(...).proportion_ci(method="wilson")`, written out as
    the functions below are (tests/train/test_train_evaluate.py holds its defining equation): importing
    scipy.stats costs every evaluating process most of a second for four lines of arithmetic.
    """
    if total <= 0:
        raise ValueError(f"an accuracy interval needs test images: got {total}")
    p, z2 = correct / total, z * z
    centre = (p + z2 / (2 * total)) / (1 + z2 / total)
    half = z * math.sqrt(p * (1 - p) / total + z2 / (4 * total * total)) / (1 + z2 / total)
    # exactly 0 and 1 at the ends, where the arithmetic would leave a rounding error
    return (0.0 if correct == 0 else centre - half), (1.0 if correct == total else centre + half)


# These two are sklearn.metrics' confusion_matrix and precision_recall_fscore_support(zero_division=0),
# written out: importing sklearn.metrics (scipy with it) costs most of a second in every process that
# evaluates, for a bincount. tests/train/test_train_evaluate.py holds them equal to sklearn's.
def confusion_matrix(actual: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """Counts of (actual class, predicted class) pairs: row = actual, column = predicted."""
    pairs = actual.astype(np.int64) * num_classes + predicted.astype(np.int64)
    return np.bincount(pairs, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def class_scores(confusion: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per class: precision, recall, F1 (0 where undefined: no image predicted or none of the class)
    and support, from a confusion matrix."""
    hits = np.diag(confusion).astype(np.float64)
    support, predicted = confusion.sum(axis=1), confusion.sum(axis=0)

    def ratio(top: np.ndarray, bottom: np.ndarray) -> np.ndarray:
        return np.divide(top, bottom, out=np.zeros_like(top), where=bottom > 0)

    return ratio(hits, predicted), ratio(hits, support), ratio(2 * hits, support + predicted), support


def _predictions_csv(actual: np.ndarray, predicted: np.ndarray, classes: list[str]) -> str:
    """One row per test image, by class name: DVC's `confusion` template counts the pairs itself, and
    names (not indices) are what its axes and tooltips then show."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")  # quotes a class name holding a comma
    writer.writerow(["actual", "predicted"])
    writer.writerows((classes[a], classes[p]) for a, p in zip(actual.tolist(), predicted.tolist(), strict=True))
    return buffer.getvalue()


def _plot_confusion(matrix: np.ndarray, classes: list[str], path: Path) -> None:
    # heavy: matplotlib (~1.6 s), only when the confusion plot is drawn
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    # heavy: matplotlib after use("Agg"), only when the confusion plot is drawn
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
