"""A champion that anyone who can set the `champion` alias on a shared registry may have registered
(tasks/ship/promotion.py): whatever its file holds, the decision for a new version is taken and
recorded, with the reason the champion could not be scored. Only the challenger, this run's own file,
fails loudly.

Tiny ONNX models (tests/support/tiny_onnx.py) in a real MLflow registry on sqlite, without a trained
project.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidProtobuf

from tasks.core.config.ship import PromotionConfig
from tasks.data.preprocess import Preprocessed
from tasks.ship.promotion import Promotion, decide_promotion, identity
from tests.support.tiny_onnx import tiny_model

CLASSES = ["a", "b"]
# tiny_model's last class always wins: on labels [0, 1, 0, 1] every model scores 0.5
TEST = Preprocessed(
    images=np.full((4, 1, 4, 4), 128, np.uint8), labels=np.array([0, 1, 0, 1]), classes=CLASSES, mean=[0], std=[1]
)


class _Registry:
    """Registered model "m" in a sqlite MLflow store under `tmp`, its versions' files written as given."""

    def __init__(self, tmp: Path) -> None:
        import mlflow

        mlflow.set_tracking_uri(f"sqlite:///{tmp / 'mlflow.db'}")
        self.tmp, self.client = tmp, mlflow.MlflowClient()
        self.experiment = self.client.create_experiment("e", artifact_location=(tmp / "artifacts").as_uri())
        self.client.create_registered_model("m")

    def version(self, content: bytes) -> str:
        """A version whose model.onnx holds `content`, tagged as scoreable on TEST (as an export tags it)."""
        run = self.client.create_run(self.experiment)
        local = self.tmp / run.info.run_id / "model.onnx"
        local.parent.mkdir()
        local.write_bytes(content)
        self.client.log_artifact(run.info.run_id, str(local), "model")
        source = f"{run.info.artifact_uri}/model"
        version = str(self.client.create_model_version("m", source, run_id=run.info.run_id).version)
        for key, value in identity(TEST).items():
            self.client.set_model_version_tag("m", version, key, value)
        return version

    def decide(self, challenger: Path, cfg: PromotionConfig | None = None) -> Promotion:
        version = self.version(challenger.read_bytes())
        return decide_promotion(self.client, "m", version, challenger, TEST, 0.5, cfg or PromotionConfig())

    def champion(self) -> str:
        return str(self.client.get_registered_model("m").aliases["champion"])


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> _Registry:
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return _Registry(tmp_path)


def _renamed_output(tmp: Path) -> bytes:
    """A valid ONNX model whose output is `scores`, not `logits`: ONNX Runtime refuses to run it as asked."""
    model = onnx.load(str(tiny_model(tmp / "scores.onnx", CLASSES, size=(4, 4))))
    model.graph.node[-1].output[0] = "scores"
    model.graph.output[0].name = "scores"
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _assert_incomparable(registry: _Registry, champion: str, challenger: Path, reason: str) -> None:
    """Kept under `incomparable: keep`, promoted under the default, the reason recorded on the version."""
    kept = registry.decide(challenger, PromotionConfig(incomparable="keep"))
    assert not kept.promoted and kept.paired is None and registry.champion() == champion
    stays = f"m v{kept.version} not promoted (champion stays v{champion}): "
    stays += f"champion v{champion} is not a usable ONNX model: "
    assert kept.verdict.startswith(stays) and reason in kept.verdict, kept.verdict
    assert "\n" not in kept.verdict and len(kept.verdict) < 400
    tags = registry.client.get_model_version("m", kept.version).tags
    assert tags["promotion"] == "kept" and tags["promotion.verdict"] == kept.verdict
    promoted = registry.decide(challenger)
    assert promoted.promoted and registry.champion() == promoted.version, promoted.verdict
    assert registry.client.get_model_version("m", promoted.version).tags["promotion"] == "promoted"


def test_a_champion_of_garbage_bytes_is_a_recorded_reason(registry: _Registry, tmp_path: Path) -> None:
    champion = registry.version(b"not an onnx model")
    registry.client.set_registered_model_alias("m", "champion", champion)
    challenger = tiny_model(tmp_path / "challenger.onnx", CLASSES)
    _assert_incomparable(registry, champion, challenger, "Error parsing message")


def test_a_champion_onnx_runtime_cannot_run_is_a_recorded_reason(registry: _Registry, tmp_path: Path) -> None:
    champion = registry.version(_renamed_output(tmp_path))
    registry.client.set_registered_model_alias("m", "champion", champion)
    challenger = tiny_model(tmp_path / "challenger.onnx", CLASSES)
    _assert_incomparable(registry, champion, challenger, "Invalid output name:logits")


def test_a_champion_with_logits_for_other_classes_is_a_recorded_reason(registry: _Registry, tmp_path: Path) -> None:
    # tagged as this data's classes, but its logits have three columns: argmax alone would not notice
    champion = registry.version(tiny_model(tmp_path / "three.onnx", ["a", "b", "c"]).read_bytes())
    registry.client.set_registered_model_alias("m", "champion", champion)
    challenger = tiny_model(tmp_path / "challenger.onnx", CLASSES)
    _assert_incomparable(registry, champion, challenger, "logits have shape (4, 3), not (4, 2)")


def test_a_challenger_that_cannot_be_scored_still_fails_loudly(registry: _Registry, tmp_path: Path) -> None:
    champion = registry.version(tiny_model(tmp_path / "champion.onnx", CLASSES).read_bytes())
    registry.client.set_registered_model_alias("m", "champion", champion)
    broken = tmp_path / "challenger.onnx"
    broken.write_bytes(b"not an onnx model")
    with pytest.raises(InvalidProtobuf):  # this run's own file: a bug here, never a recorded reason
        registry.decide(broken)
    assert registry.champion() == champion
