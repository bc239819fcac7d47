"""Data checks: a new snapshot against the last trained one, before it replaces data/.

Scheduled retraining re-reads the source every night; what it finds is untrusted until checked. The
download stage profiles the new snapshot (`profile_snapshot`: image count, classes and their counts,
per-channel mean and std, copies of one image) and `check_snapshot` compares that profile with the
one the current model was trained on (`artifacts/train/data_profile.json`, copied there by the train
stage). A refusing check raises `DataRefused` before the new snapshot is swapped in, so data/,
data.dvc and everything downstream stay as they were; warnings are recorded and the run goes on.

Checks (thresholds in params.yaml `checks`):
    image_count      fewer images than the last trained snapshot, beyond max_image_drop
    missing_classes  a class the last trained snapshot had (refuse or warn)
    new_classes      a class it did not have (refuse or warn)
    class_balance    largest class / smallest class
    mean_shift       per channel, |new mean - last mean| in units of the last std
    std_ratio        per channel, new std / last std, or its inverse
    label_psi        population stability index of the class frequencies (over the classes both have)
    duplicates_across_splits
                     test images whose exact content is also in train or val (they inflate test
                     accuracy); by content hash, with the split the preprocess stage will make
The comparisons need a last trained snapshot; on a first run only class_balance and the duplicates
are checked, and the report says so.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from tasks.core.config.data import ChecksConfig, DataConfig, SplitConfig
from tasks.core.errors import DataRefused, ExpectedFailure
from tasks.data.formats import RawSnapshot
from tasks.data.splits import content_digests, split_indices

Status = Literal["pass", "warn", "refuse", "skipped"]
PSI_FLOOR = 1e-4  # a class share of 0 in one snapshot would make the PSI infinite


@dataclass(frozen=True)
class Profile:
    """What the checks compare: a snapshot summarised in a few numbers (written as profile.json)."""

    num_images: int
    image_shape: list[int]  # (H, W, C)
    classes: list[str]
    class_counts: list[int]
    mean: list[float]  # per channel, pixels scaled to [0, 1], over every image
    std: list[float]
    duplicate_images: int  # images whose exact content an earlier image already has
    origin: str = ""  # which data this is (`data_origin`): another origin is not compared with


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    value: float | None
    limit: float | None
    detail: str


@dataclass(frozen=True)
class Report:
    checks: list[Check]
    profile: Profile
    reference: Profile | None
    duplicates_across_splits: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def refused(self) -> list[Check]:
        return [check for check in self.checks if check.status == "refuse"]

    @property
    def warnings(self) -> list[Check]:
        return [check for check in self.checks if check.status == "warn"]

    def as_json(self) -> dict[str, Any]:
        return {"refused": bool(self.refused), **asdict(self)}

    def metrics(self) -> dict[str, float]:
        """The numbers as MLflow metrics (`checks.<name>`)."""
        return {f"checks.{c.name}": float(c.value) for c in self.checks if c.value is not None}


def profile_snapshot(snapshot: RawSnapshot, chunk_size: int = 4096) -> tuple[Profile, np.ndarray]:
    """The snapshot's profile, and the content digest of every image (tasks/data/formats.py).

    One streamed pass of float64 sums per channel (as the stats stage does), so memory stays at one
    block whatever the dataset's size.
    """
    rows = snapshot.rows
    channels = rows.shape[-1]
    total, squares = np.zeros(channels), np.zeros(channels)
    for block in rows.chunks(np.arange(rows.shape[0]), chunk_size):
        pixels = block.reshape(-1, channels).astype(np.float64) / 255.0
        total += pixels.sum(axis=0)
        squares += np.square(pixels).sum(axis=0)
    count = max(rows.shape[0] * int(np.prod(rows.shape[1:-1])), 1)
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - np.square(mean), 0.0))
    digests = content_digests(rows, chunk_size)
    unique = len(np.unique(digests, axis=0)) if len(digests) else 0
    profile = Profile(
        num_images=int(rows.shape[0]),
        image_shape=[int(n) for n in rows.shape[1:]],
        classes=list(snapshot.classes),
        class_counts=np.bincount(snapshot.labels, minlength=len(snapshot.classes)).tolist(),
        mean=mean.tolist(),
        std=std.tolist(),
        duplicate_images=int(rows.shape[0] - unique),
    )
    return profile, digests


def data_origin(data: DataConfig) -> str:
    """Which data a snapshot is, as params.yaml names it: the source and where it lives, not its
    version (a new `data.sha256` of the same URL is the same data, grown; that is what is checked).
    A user who points `data` elsewhere on purpose changes the origin, and nothing is compared."""
    named = {key: getattr(data, key) for key in ("source", "path", "url", "image_size", "channels")}
    return hashlib.sha256(json.dumps(named, sort_keys=True, default=list).encode()).hexdigest()


def run_checks(
    snapshot: RawSnapshot, data: DataConfig, cfg: ChecksConfig, split: SplitConfig, seed: int, reference: Profile | None
) -> Report:
    """Profile `snapshot` and check it against `reference`; the split is the one preprocess will make."""
    profile, digests = profile_snapshot(snapshot)
    profile = replace(profile, origin=data_origin(data))
    if not cfg.enabled:
        return Report([], profile, reference, notes=["checks.enabled is false: nothing checked"])
    splits = split_indices(snapshot, split, seed, digests)
    return check_snapshot(profile, reference, cfg, duplicates_across_splits(digests, splits), len(splits["test"]))


def duplicates_across_splits(digests: np.ndarray, splits: dict[str, np.ndarray]) -> int:
    """Test images whose exact content is also somewhere in train or val."""
    seen = {bytes(row) for name in ("train", "val") for row in digests[splits[name]]}
    return sum(bytes(row) in seen for row in digests[splits["test"]])


def read_profile(path: Path) -> Profile | None:
    """The profile at `path`, or None when there is none yet (a first run)."""
    if not path.exists():
        return None
    try:
        return Profile(**json.loads(path.read_text()))
    except (ValueError, TypeError, OSError) as exc:
        raise ExpectedFailure(f"{path}: not a readable data profile ({exc}); delete it to skip comparing") from None


def check_snapshot(
    new: Profile, reference: Profile | None, cfg: ChecksConfig, duplicates_across: int, test_size: int
) -> Report:
    """Every check of `new` against `reference` (the last trained snapshot's profile, or None)."""
    checks = [_class_balance(new, cfg), _duplicates(duplicates_across, test_size, cfg)]
    notes = []
    if reference is None:
        notes.append("no trained snapshot to compare with (a first run): count, classes and drift not checked")
    elif reference.origin != new.origin:
        notes.append("data now names another source than the one trained on: count, classes and drift not compared")
    else:
        checks += [_image_count(new, reference, cfg), *_classes(new, reference, cfg), _label_psi(new, reference, cfg)]
        if new.image_shape[-1] == reference.image_shape[-1]:
            checks += _drift(new, reference, cfg)
        else:
            channels = f"{reference.image_shape[-1]} -> {new.image_shape[-1]}"
            notes.append(f"channels changed ({channels}): mean and std not compared")
    return Report(checks, new, reference, duplicates_across, notes)


def refuse_if_failed(report: Report) -> None:
    """Raise DataRefused naming the failed checks and their numbers; nothing when all passed."""
    if report.refused:
        first = "; ".join(f"{c.name}: {c.detail}" for c in report.refused)
        raise DataRefused(f"data check(s) refused the new snapshot, nothing retrained: {first}", report.as_json())


def _status(failed: bool, action: Literal["refuse", "warn"] = "refuse") -> Status:
    return action if failed else "pass"


def _image_count(new: Profile, ref: Profile, cfg: ChecksConfig) -> Check:
    drop = max(ref.num_images - new.num_images, 0) / max(ref.num_images, 1)
    return Check(
        "image_drop",
        _status(drop > cfg.max_image_drop),
        drop,
        cfg.max_image_drop,
        f"{new.num_images} images vs {ref.num_images} last trained "
        f"({drop:.1%} fewer, allowed {cfg.max_image_drop:.1%})",
    )


def _classes(new: Profile, ref: Profile, cfg: ChecksConfig) -> list[Check]:
    missing = [name for name in ref.classes if name not in new.classes]
    added = [name for name in new.classes if name not in ref.classes]
    return [
        Check(
            "missing_classes",
            _status(bool(missing), cfg.missing_classes),
            len(missing),
            0,
            f"{len(missing)} class(es) of the last trained snapshot missing: {_names(missing)}",
        ),
        Check(
            "new_classes",
            _status(bool(added), cfg.new_classes),
            len(added),
            0,
            f"{len(added)} new class(es): {_names(added)}",
        ),
    ]


def _names(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return (shown + f" and {len(names) - limit} more" if len(names) > limit else shown) or "none"


def _class_balance(new: Profile, cfg: ChecksConfig) -> Check:
    counts = list(new.class_counts)
    smallest, largest = min(counts, default=0), max(counts, default=0)
    ratio = largest / smallest if smallest else math.inf
    small = new.classes[counts.index(smallest)] if counts else "none"
    return Check(
        "class_imbalance",
        _status(ratio > cfg.max_class_imbalance),
        ratio if math.isfinite(ratio) else None,
        cfg.max_class_imbalance,
        f"largest class {largest} images, smallest {small!r} {smallest} (ratio {ratio:.3g}, "
        f"allowed {cfg.max_class_imbalance:g})",
    )


def _label_psi(new: Profile, ref: Profile, cfg: ChecksConfig) -> Check:
    # Over the classes both snapshots have (new and missing ones are checks of their own): each is
    # a share of those classes' images.
    names = [name for name in ref.classes if name in new.classes]
    new_share, ref_share = _shares(new, names), _shares(ref, names)
    psi = float(np.sum((new_share - ref_share) * np.log(new_share / ref_share))) if names else 0.0
    return Check(
        "label_psi",
        _status(psi > cfg.max_label_psi),
        psi,
        cfg.max_label_psi,
        f"class-frequency PSI {psi:.4f} over the {len(names)} classes both have (allowed {cfg.max_label_psi:g})",
    )


def _shares(profile: Profile, names: list[str]) -> np.ndarray:
    counts = dict(zip(profile.classes, profile.class_counts, strict=True))
    share = np.array([counts[name] for name in names], dtype=np.float64)
    return np.maximum(share / max(share.sum(), 1.0), PSI_FLOOR)


def _drift(new: Profile, ref: Profile, cfg: ChecksConfig) -> list[Check]:
    new_mean, ref_mean = np.array(new.mean), np.array(ref.mean)
    new_std, ref_std = np.maximum(np.array(new.std), 1e-12), np.maximum(np.array(ref.std), 1e-12)
    shift = np.abs(new_mean - ref_mean) / ref_std
    ratio = np.maximum(new_std / ref_std, ref_std / new_std)
    worst_shift, worst_ratio = int(np.argmax(shift)), int(np.argmax(ratio))
    return [
        Check(
            "mean_shift",
            _status(shift[worst_shift] > cfg.max_mean_shift),
            float(shift[worst_shift]),
            cfg.max_mean_shift,
            f"channel {worst_shift} mean {new_mean[worst_shift]:.4f} vs {ref_mean[worst_shift]:.4f} last trained: "
            f"{shift[worst_shift]:.3g} stds (allowed {cfg.max_mean_shift:g})",
        ),
        Check(
            "std_ratio",
            _status(ratio[worst_ratio] > cfg.max_std_ratio),
            float(ratio[worst_ratio]),
            cfg.max_std_ratio,
            f"channel {worst_ratio} std {new_std[worst_ratio]:.4f} vs {ref_std[worst_ratio]:.4f} last trained "
            f"(ratio {ratio[worst_ratio]:.3g}, allowed {cfg.max_std_ratio:g})",
        ),
    ]


def _duplicates(count: int, test_size: int, cfg: ChecksConfig) -> Check:
    share = count / test_size if test_size else 0.0
    return Check(
        "duplicates_across_splits",
        _status(share > cfg.max_duplicates_across_splits),
        share,
        cfg.max_duplicates_across_splits,
        f"{count} of {test_size} test images also in train or val ({share:.2%}, "
        f"allowed {cfg.max_duplicates_across_splits:.2%})",
    )
