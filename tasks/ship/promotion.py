"""Promotion: whether a newly registered version becomes champion, judged on the same test images.

Every registered version gets the alias `challenger`. Whether `champion` moves to it is decided on a
paired comparison: the current champion's ONNX model is fetched from the registry and scored on the
challenger's test split, with the same runtime, so both accuracies are over the same images (an
accuracy the champion reached on last month's test split says nothing about this month's). The
rule is params.yaml's `promotion`: a minimum margin, or McNemar's exact test on the images where
exactly one of the two is right. A champion that cannot be scored on the new data (other classes,
another input shape, files too large or not a plain ONNX model) is a recorded reason, and
`promotion.incomparable` says what then happens.

Both scores, the test split's hash, the margin, the p-value and the verdict are recorded on the
stage run and on the model version, so the MLflow UI shows why a version was or was not promoted.
A champion's files come from a tracking server others write to: their size is bounded, and a model
that points at external data files (which could name any path) is refused unread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import tempfile
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.core.config.ship import PromotionConfig
from tasks.core.errors import ExpectedFailure
from tasks.data.preprocess import Preprocessed, in_batches

log = logging.getLogger(__name__)

CHALLENGER, CHAMPION = "challenger", "champion"
ONNX_IN_MODEL = "artifacts/model.onnx"  # where the registered wrapper keeps the ONNX file
MAX_ROUNDS = 3  # comparisons made again when other decisions keep moving the champion meanwhile
ACCURACY_TAG = "test_accuracy"  # on the version's own test split
CLASSES_TAG, INPUT_TAG, SPLIT_TAG = "classes.sha256", "input_shape", "test_split.sha256"


@dataclass(frozen=True)
class Paired:
    """Two models scored on the same images."""

    images: int
    challenger_accuracy: float
    champion_accuracy: float
    challenger_only: int  # images the challenger gets right and the champion wrong
    champion_only: int

    @property
    def margin(self) -> float:
        return self.challenger_accuracy - self.champion_accuracy

    @property
    def p_value(self) -> float:
        """McNemar's exact test, one-sided: the chance of the challenger winning at least this many of
        the discordant images if both models were equally good. Written out (a binomial tail) rather
        than imported from scipy, which is not otherwise a dependency."""
        n, wins = self.challenger_only + self.champion_only, self.challenger_only
        return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2**n if n else 1.0


@dataclass(frozen=True)
class Promotion:
    name: str
    version: str
    accuracy: float  # the challenger's, on its own test split
    champion_version: str | None  # before this decision
    paired: Paired | None  # None: no champion, or one that could not be scored
    promoted: bool
    verdict: str  # one line: what was decided and why
    test_split_sha256: str


def identity(test: Preprocessed) -> dict[str, str]:
    """What a model version must share with the data to be scored on it (tags of every version)."""
    classes = hashlib.sha256(json.dumps(list(test.classes)).encode()).hexdigest()
    return {CLASSES_TAG: classes, INPUT_TAG: "x".join(str(n) for n in test.images.shape[1:])}


def split_sha256(test: Preprocessed) -> str:
    digest = hashlib.sha256(json.dumps(list(test.classes)).encode())
    for batch in in_batches(test.images, 1024):  # a streamed split a block at a time; the same digest
        digest.update(np.ascontiguousarray(batch).tobytes())
    digest.update(np.ascontiguousarray(test.labels).astype(np.int64).tobytes())
    return digest.hexdigest()


def decide_promotion(
    client: Any,
    name: str,
    version: str,
    shipped: Path,
    test: Preprocessed,
    accuracy: float,
    cfg: PromotionConfig,
    lock: AbstractContextManager[Any] | None = None,
) -> Promotion:
    """Alias `version` as challenger; move `champion` to it if it wins the paired comparison.

    Two exports may decide at once (`dvc queue start -j 2`, two machines on one tracking server), and
    MLflow's aliases have no compare-and-set. `lock` (the caller's: a file lock beside a local store)
    makes decisions take turns; without one, the champion is read again after scoring, and if another
    decision moved it meanwhile, the comparison is made again against the new one. That leaves only the
    moment between that read and the alias write, not the seconds of scoring.
    """
    split = split_sha256(test)
    for key, value in {**identity(test), ACCURACY_TAG: repr(accuracy), SPLIT_TAG: split}.items():
        client.set_model_version_tag(name, version, key, value)
    client.set_registered_model_alias(name, CHALLENGER, version)
    with lock or nullcontext():
        for _ in range(MAX_ROUNDS):
            champion = _champion_of(client, name)
            paired, problem = _paired_with(client, name, champion, shipped, test, cfg)
            if _champion_of(client, name) == champion:  # nobody moved it while we scored
                break
            log.info("registry: %s's champion moved while v%s was scored: comparing again", name, version)
        promoted, verdict = _judge(name, version, champion, paired, problem, cfg)
        if promoted:
            client.set_registered_model_alias(name, CHAMPION, version)
    client.set_model_version_tag(name, version, "promotion", "promoted" if promoted else "kept")
    client.set_model_version_tag(name, version, "promotion.verdict", verdict)
    return Promotion(name, version, accuracy, champion, paired, promoted, verdict, split)


def _champion_of(client: Any, name: str) -> str | None:
    champion = client.get_registered_model(name).aliases.get(CHAMPION)
    return str(champion) if champion is not None else None


def _paired_with(
    client: Any, name: str, champion: str | None, shipped: Path, test: Preprocessed, cfg: PromotionConfig
) -> tuple[Paired | None, str]:
    """Both models scored on `test`, or (None, why not)."""
    if champion is None:
        return None, "no champion yet"
    with tempfile.TemporaryDirectory(prefix="lockstep-champion-") as tmp:
        champion_file, problem = _fetch_champion(client, name, champion, test, Path(tmp), cfg)
        if champion_file is None:
            return None, problem
        # The challenger first and unguarded: it is this run's own file, so an error in it is a bug here
        # and must fail the stage. Only the champion comes from a registry others write to.
        challenger_right = right_answers(shipped, test)
        try:
            champion_right = right_answers(champion_file, test)
        except _runtime_errors() as exc:
            return None, f"champion v{champion} is not a usable ONNX model: {_one_line(exc)}"
        return _pair(challenger_right, champion_right), ""


def score_pair(challenger: Path, champion: Path, test: Preprocessed, threads: int = 1) -> Paired:
    """Both ONNX models on every test image, in ONNX Runtime."""
    return _pair(right_answers(challenger, test, threads), right_answers(champion, test, threads))


def right_answers(path: Path, test: Preprocessed, threads: int = 1) -> np.ndarray:
    """Per test image, whether the ONNX model at `path` predicts its label; ValueError for a model
    whose logits are not one row per image and one column per class (argmax would still answer)."""
    # heavy: onnx and onnxruntime (~1 s), only when a pair of models is scored
    from tasks.ship.onnx_model import OUTPUT, predict, session

    logits = predict(session(path, threads), test.images)
    if logits.shape != (len(test.labels), len(test.classes)):
        raise ValueError(f"its {OUTPUT} have shape {logits.shape}, not {(len(test.labels), len(test.classes))}")
    right: np.ndarray = logits.argmax(axis=1) == test.labels
    return right


def _pair(challenger: np.ndarray, champion: np.ndarray) -> Paired:
    return Paired(
        images=len(challenger),
        challenger_accuracy=float(challenger.mean()),
        champion_accuracy=float(champion.mean()),
        challenger_only=int(np.sum(challenger & ~champion)),
        champion_only=int(np.sum(champion & ~challenger)),
    )


def _runtime_errors() -> tuple[type[Exception], ...]:
    """What ONNX Runtime raises for a model it refuses to load or run (its own exception classes, none
    of them a RuntimeError subclass, plus the RuntimeError its Python layer raises), and ValueError:
    `right_answers`'s and `predict`'s checks of the logits' shape."""
    # heavy: onnxruntime (~1 s), only once a champion has been fetched to be scored
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    ort_errors = [c for c in vars(ort_state).values() if isinstance(c, type) and issubclass(c, Exception)]
    return (*ort_errors, RuntimeError, ValueError)


def _one_line(exc: BaseException, limit: int = 200) -> str:
    """`exc` as one short line: ONNX Runtime's messages span lines and can run to kilobytes (a tag's value)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fetch_champion(
    client: Any, name: str, version: str, test: Preprocessed, dest: Path, cfg: PromotionConfig
) -> tuple[Path | None, str]:
    """The champion's model.onnx if it can be scored on `test`, else (None, why not)."""
    tags = client.get_model_version(name, version).tags
    for key, expected in identity(test).items():
        if tags.get(key) != expected:
            what = "class names" if key == CLASSES_TAG else "input shape"
            found = "none recorded" if key not in tags else tags[key][:16]
            return None, f"champion v{version} has other {what} ({found}) than this data ({expected[:16]})"
    try:
        return fetch_onnx(name, version, dest, cfg.max_champion_bytes), ""
    except UnusableModelError as exc:
        return None, f"champion {exc}"


class UnusableModelError(ExpectedFailure):
    """A registered version whose ONNX file is missing, too large or not self-contained."""


def fetch_onnx(name: str, version: str, dest: Path, max_bytes: int) -> Path:
    """Version `version` of registered model `name`: its ONNX file, downloaded into `dest`.

    The registered model is the served wrapper (tasks/ship/serving.py) carrying the ONNX file as its
    artifact `ONNX_IN_MODEL`; versions registered before it was are the ONNX file itself.
    """
    # heavy: mlflow (~4 s), only when a registered champion is fetched
    import mlflow

    uri = f"models:/{name}/{version}"
    listed = {i.path: i.file_size or 0 for i in mlflow.artifacts.list_artifacts(artifact_uri=f"{uri}/artifacts")}
    listed |= {i.path: i.file_size or 0 for i in mlflow.artifacts.list_artifacts(artifact_uri=uri)}
    found = next((p for p in (ONNX_IN_MODEL, "model.onnx") if p in listed), None)
    if found is None:
        raise UnusableModelError(f"v{version} has no {ONNX_IN_MODEL}")
    if listed[found] > max_bytes:
        raise UnusableModelError(f"v{version}'s model.onnx is {listed[found]} bytes (promotion.max_champion_bytes)")
    path = Path(mlflow.artifacts.download_artifacts(f"{uri}/{found}", dst_path=str(dest)))
    if path.stat().st_size > max_bytes:  # the listing said otherwise: trust the bytes
        raise UnusableModelError(f"v{version}'s model.onnx is larger than listed")
    _check_onnx(path, version)
    return path


def _check_onnx(path: Path, version: str) -> None:
    """UnusableModelError unless `path` parses as ONNX with every weight inside the file: an
    external-data entry could name any file on this machine."""
    # heavy: onnx (~0.7 s), only when a fetched champion is checked
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(str(path), load_external_data=False)
    except DecodeError as exc:
        raise UnusableModelError(f"v{version} is not a usable ONNX model: {_one_line(exc)}") from exc
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        raise UnusableModelError(f"v{version}'s model.onnx uses external data")


def _judge(
    name: str, version: str, champion: str | None, paired: Paired | None, problem: str, cfg: PromotionConfig
) -> tuple[bool, str]:
    if paired is None:
        promoted = champion is None or cfg.incomparable == "promote"
        return promoted, f"{name} v{version} {_action(promoted, champion)}: {problem}"
    if cfg.rule == "mcnemar":
        promoted = paired.margin > 0 and paired.p_value < cfg.alpha
        rule = f"McNemar p={paired.p_value:.3g} {'<' if promoted else 'not <'} {cfg.alpha:g}"
    else:
        promoted = paired.margin >= cfg.min_margin
        rule = f"margin {paired.margin:+.4f} {'>=' if promoted else '<'} {cfg.min_margin:g}"
    return promoted, (
        f"{name} v{version} {_action(promoted, champion)}: challenger {paired.challenger_accuracy:.4f} vs "
        f"champion v{champion} {paired.champion_accuracy:.4f} on the same {paired.images} test images ({rule})"
    )


def _action(promoted: bool, champion: str | None) -> str:
    return "promoted to champion" if promoted else f"not promoted (champion stays v{champion})"
