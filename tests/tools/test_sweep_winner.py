"""The winner's weights on the coordinator (tasks/tools/sweep/results.py `winner_weights`): machines share no
disk, so weights trained on another machine come from the trial's MLflow run, and only with the sha256 the
trial reported. The fetch itself (MLflow's `download_artifacts`, and its client's artifact listing) is
replaced here by a stand-in that writes given bytes; across real hosts and a real server:
tests/hosts/test_sweep_hosts.py."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import pytest

from tasks.tools.sweep.results import WinnerUnavailable, winner_weights

WEIGHTS = b"the winner's weights"


def _summary(run_id: str | None = "a" * 32, digest: bytes = WEIGHTS) -> dict[str, Any]:
    best = {"trial": 3, "run_id": run_id, "best_sha256": hashlib.sha256(digest).hexdigest()}
    return {"study": "s", "best": best}


class Listing:
    """MLflow's client, standing in for its artifact listing: the size the store reports (None: unknown)."""

    size: int | None = len(WEIGHTS)

    def __init__(self, tracking_uri: str) -> None:
        assert tracking_uri == "http://tracking"

    def list_artifacts(self, run_id: str, path: str) -> list[Any]:
        from mlflow.entities import FileInfo

        return [FileInfo(f"{path}/best.safetensors", False, self.size)]


@pytest.fixture
def fetches(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """MLflow's download, standing in: what it was asked for, and the bytes it 'downloads' (WEIGHTS)."""
    import mlflow
    import mlflow.artifacts

    asked: list[dict[str, Any]] = []
    monkeypatch.setattr(mlflow, "MlflowClient", type("Store", (Listing,), {}))

    def download(**kwargs: Any) -> str:
        asked.append(kwargs)
        path = Path(kwargs["dst_path"]) / kwargs["artifact_path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(WEIGHTS)
        return str(path)

    monkeypatch.setattr(mlflow.artifacts, "download_artifacts", download)
    return asked


def test_weights_trained_here_are_used_as_they_are(tmp_path: Path, fetches: list[dict[str, Any]]) -> None:
    local = tmp_path / "trial-0003" / "best.safetensors"
    local.parent.mkdir()
    local.write_bytes(WEIGHTS)
    assert winner_weights(_summary(), tmp_path, "http://tracking") == local
    assert fetches == []


def test_weights_trained_elsewhere_are_fetched_from_the_trial_run(
    tmp_path: Path, fetches: list[dict[str, Any]]
) -> None:
    got = winner_weights(_summary(), tmp_path, "http://tracking")
    assert got == tmp_path / "trial-0003" / "best.safetensors" and got.read_bytes() == WEIGHTS
    (asked,) = fetches
    assert asked["run_id"] == "a" * 32 and asked["artifact_path"] == "checkpoints/best.safetensors"
    assert asked["tracking_uri"] == "http://tracking"
    # a stale file of another study under the same name is replaced, not trusted
    got.write_bytes(b"stale")
    assert winner_weights(_summary(), tmp_path, "http://tracking").read_bytes() == WEIGHTS


def test_other_bytes_in_the_run_are_refused_and_nothing_is_written(
    tmp_path: Path, fetches: list[dict[str, Any]]
) -> None:
    with pytest.raises(WinnerUnavailable, match="not the .* its trial reported"):
        winner_weights(_summary(digest=b"what the trial reported"), tmp_path, "http://tracking")
    assert not (tmp_path / "trial-0003" / "best.safetensors").exists()


def test_without_a_run_or_a_winner_nothing_is_fetched(
    tmp_path: Path, fetches: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    assert winner_weights({"study": "s", "best": None}, tmp_path, "http://tracking") is None
    with caplog.at_level(logging.WARNING):
        assert winner_weights(_summary(run_id=None), tmp_path, None) is None
    assert "on the worker that trained it" in caplog.text
    assert fetches == []


@pytest.mark.parametrize("listed", [len(WEIGHTS), None])  # a store that knows the size, and one that does not
def test_a_checkpoint_over_the_cap_is_refused_and_nothing_is_written(
    tmp_path: Path, fetches: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, listed: int | None
) -> None:
    import mlflow

    from tasks.tools.sweep import results

    monkeypatch.setattr(results, "MAX_CHECKPOINT_BYTES", len(WEIGHTS) - 1)
    monkeypatch.setattr(mlflow.MlflowClient, "size", listed)
    with pytest.raises(WinnerUnavailable, match="more than the"):
        winner_weights(_summary(), tmp_path, "http://tracking")
    assert len(fetches) == (0 if listed else 1)  # refused before the download where the size was listed
    assert not (tmp_path / "trial-0003" / "best.safetensors").exists()


@pytest.mark.parametrize("run_id", ["../../etc", "A" * 32, "a" * 31])
def test_a_malformed_run_id_from_the_studys_storage_names_nothing(
    tmp_path: Path, fetches: list[dict[str, Any]], run_id: str
) -> None:
    with pytest.raises(WinnerUnavailable, match="malformed"):
        winner_weights(_summary(run_id=run_id), tmp_path, "http://tracking")
    assert fetches == []
