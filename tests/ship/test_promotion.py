"""The promotion decision (tasks/ship/promotion.py): the champion's ONNX model, fetched from a real MLflow
registry, is scored on the challenger's test split, and the decision is taken on that paired
comparison (margin or McNemar), recorded on the model version; a champion that cannot be scored is a
recorded reason.

The models are the session's trained project's fp32 ONNX file and copies of it made worse on purpose
(a bias that pulls some images to one class), all scored on that project's test split.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tasks.core.config.ship import PromotionConfig
from tasks.data.preprocess import Preprocessed, load_split
from tasks.ship.promotion import Paired, decide_promotion, identity, score_pair, split_sha256

pytestmark = pytest.mark.slow  # the session's trained project
# as the export stage logs them: weights inside the file, requirements given (not inferred, ~4 s each)
LOGGED = {"save_as_external_data": False, "pip_requirements": ["onnx"]}


def _biased(source: Path, dest: Path, push: float) -> Path:
    """`source` with `push` added to class 0's logit: images near a boundary go to class 0."""
    model = onnx.load(str(source))
    last = [node for node in model.graph.node if node.op_type == "Gemm"][-1]
    bias = next(init for init in model.graph.initializer if init.name == last.input[2])
    values = numpy_helper.to_array(bias).copy()
    values[0] += push
    bias.CopyFrom(numpy_helper.from_array(values, bias.name))
    onnx.save(model, str(dest))
    return dest


@pytest.fixture(scope="module")
def setting(dvc_repo: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    repo, tmp = dvc_repo["repo"], tmp_path_factory.mktemp("promotion")
    good = repo / "artifacts/compress/models/fp32.onnx"
    test = load_split(repo / "artifacts/preprocessed", "test")
    models = {"good": good, "bad": _biased(good, tmp / "bad.onnx", 4.0), "slightly": _biased(good, tmp / "s.onnx", 1.0)}
    return {"test": test, "models": models, "tmp": tmp}


def _client(tmp_path: Path) -> Any:
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    return mlflow.MlflowClient()


def _register(client: Any, path: Path, test: Preprocessed, cfg: PromotionConfig | None = None) -> Any:
    import mlflow

    with mlflow.start_run():
        info = mlflow.onnx.log_model(onnx.load(str(path)), name="model", registered_model_name="m", **LOGGED)
    accuracy = 0.5  # the challenger's own number: the decision must not use it
    version = str(info.registered_model_version)
    return decide_promotion(client, "m", version, path, test, accuracy, cfg or PromotionConfig())


def _champion(client: Any) -> str:
    return str(client.get_registered_model("m").aliases["champion"])


def test_the_paired_scores_count_the_same_images(setting: dict[str, Any]) -> None:
    test, models = setting["test"], setting["models"]
    paired = score_pair(models["bad"], models["good"], test)
    assert paired.images == len(test.labels)
    assert paired.champion_accuracy > paired.challenger_accuracy
    # the discordant counts are exactly the accuracy difference
    assert math.isclose(paired.margin, (paired.challenger_only - paired.champion_only) / paired.images)
    assert score_pair(models["good"], models["good"], test).margin == 0


def test_mcnemar_exact_p_value() -> None:
    # 8 discordant images, the challenger wins 7: P(X >= 7 | n=8, p=1/2) = (8 + 1) / 256
    assert math.isclose(Paired(100, 0.9, 0.84, 7, 1).p_value, 9 / 256)
    assert Paired(100, 0.9, 0.9, 0, 0).p_value == 1.0


def test_the_champion_moves_only_to_a_challenger_that_wins_on_the_same_images(
    setting: dict[str, Any], tmp_path: Path
) -> None:
    client, test, models = _client(tmp_path), setting["test"], setting["models"]
    first = _register(client, models["slightly"], test)
    assert first.promoted and first.paired is None and "no champion yet" in first.verdict
    worse = _register(client, models["bad"], test)
    assert not worse.promoted and _champion(client) == "1"
    assert worse.paired.champion_accuracy > worse.paired.challenger_accuracy
    assert worse.verdict.startswith("m v2 not promoted (champion stays v1): challenger ")
    assert f"on the same {len(test.labels)} test images" in worse.verdict
    better = _register(client, models["good"], test)
    assert better.promoted and _champion(client) == "3" and better.paired.margin > 0
    # recorded on the version: both scores' verdict, the split's hash
    tags = client.get_model_version("m", "2").tags
    assert tags["promotion"] == "kept" and tags["promotion.verdict"] == worse.verdict
    assert tags["test_split.sha256"] == split_sha256(test) == worse.test_split_sha256
    assert str(client.get_registered_model("m").aliases["challenger"]) == "3"


def test_mcnemar_needs_a_significant_win(setting: dict[str, Any], tmp_path: Path) -> None:
    client, test, models = _client(tmp_path), setting["test"], setting["models"]
    strict = PromotionConfig(rule="mcnemar", alpha=0.05)
    _register(client, models["good"], test, strict)
    same = _register(client, models["good"], test, strict)  # a tie is no evidence
    assert not same.promoted and "McNemar p=1 not < 0.05" in same.verdict
    client.set_registered_model_alias("m", "champion", "1")
    _register(client, models["bad"], test, strict)  # kept: v1 stays
    client.set_registered_model_alias("m", "champion", "3")  # now the bad one is champion
    win = _register(client, models["good"], test, strict)
    assert win.promoted and win.paired.p_value < 0.05, win.verdict


def test_a_champion_that_cannot_be_scored_is_a_recorded_reason(setting: dict[str, Any], tmp_path: Path) -> None:
    client, test, models = _client(tmp_path), setting["test"], setting["models"]
    _register(client, models["good"], test)
    client.set_model_version_tag("m", "1", "classes.sha256", "0" * 64)  # as if trained on other classes
    kept = _register(client, models["bad"], test, PromotionConfig(incomparable="keep"))
    assert not kept.promoted and kept.paired is None
    assert "not promoted (champion stays v1): champion v1 has other class names (0000000000000000)" in kept.verdict
    promoted = _register(client, models["bad"], test)  # the default: the new data's model serves
    assert promoted.promoted and "has other class names" in promoted.verdict


def test_a_champion_with_external_data_is_refused_unread(setting: dict[str, Any], tmp_path: Path) -> None:
    import mlflow

    client, test = _client(tmp_path), setting["test"]
    # MLflow's own default for ONNX: the weights in a file beside model.onnx. An external-data entry
    # may name any path on the scoring machine, so such a champion is not read.
    with mlflow.start_run():
        info = mlflow.onnx.log_model(
            onnx.load(str(setting["models"]["good"])),
            name="model",
            registered_model_name="m",
            save_as_external_data=True,
        )
    client.set_registered_model_alias("m", "champion", str(info.registered_model_version))
    for key, value in identity(test).items():
        client.set_model_version_tag("m", str(info.registered_model_version), key, value)
    decision = _register(client, setting["models"]["good"], test)
    assert decision.paired is None and "uses external data" in decision.verdict, decision.verdict
    assert np.isfinite(decision.accuracy)


class _AnotherExportMeanwhile:
    """A real MlflowClient, except that while this decision scores the champion, another export
    promotes `other` (two exports deciding at once on one tracking server): on the read after
    scoring, the champion has moved."""

    def __init__(self, client: Any, other: str) -> None:
        self.client, self.other, self.reads = client, other, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def get_registered_model(self, name: str) -> Any:
        self.reads += 1
        if self.reads == 2:
            self.client.set_registered_model_alias(name, "champion", self.other)
        return self.client.get_registered_model(name)


def test_a_champion_moved_by_another_decision_meanwhile_is_compared_again(
    setting: dict[str, Any], tmp_path: Path
) -> None:
    import mlflow

    client, test, models = _client(tmp_path), setting["test"], setting["models"]
    _register(client, models["bad"], test)  # v1, champion
    with mlflow.start_run():  # v2, registered by the other export, which is about to promote it
        mlflow.onnx.log_model(onnx.load(str(models["good"])), name="model", registered_model_name="m", **LOGGED)
    for key, value in identity(test).items():
        client.set_model_version_tag("m", "2", key, value)
    with mlflow.start_run():
        info = mlflow.onnx.log_model(
            onnx.load(str(models["slightly"])), name="model", registered_model_name="m", **LOGGED
        )
    racing = _AnotherExportMeanwhile(client, "2")
    decision = decide_promotion(
        racing, "m", str(info.registered_model_version), models["slightly"], test, 0.5, PromotionConfig()
    )
    # it beats v1, but v2 became champion while it was scored: the decision is against v2, and it loses
    assert racing.reads >= 3
    assert decision.champion_version == "2" and not decision.promoted, decision.verdict
    assert "champion stays v2" in decision.verdict and _champion(client) == "2"
