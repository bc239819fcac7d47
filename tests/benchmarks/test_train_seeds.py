"""benchmarks/train_seeds.py's bookkeeping (issue 70.2 under other training seeds): what a training copy
holds, which copies train again, and the means the row reports. The trainings themselves are an hour
of a real set each (benchmarks/results/real-sets-sweeps.json), not a test."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import train_seeds
from benchmarks.defaults_vs_sweep import _seeds, main
from tasks.core.config.yaml_io import load_params
from tests.conftest import ROOT

WINNER = {"params": {"train.lr": 0.0123, "train.weight_decay": 0.0056, "train.label_smoothing": 0.0}, "seed": 7}


def _project(root: Path) -> Path:
    project = root / "project-x1"
    for rel in ("artifacts/sweep/lockstep/trial-0000", "artifacts/preprocessed", "mlartifacts/1", "data/cat"):
        (project / rel).mkdir(parents=True)
    _evaluated(project, 0.67, 0.61)  # the set's own defaults, evaluated
    (project / "artifacts/train").mkdir()
    (project / "artifacts/preprocessed/train_images.npy").write_bytes(b"x")
    (project / "mlflow.db").write_bytes(b"x")
    shutil.copy2(ROOT / "params.yaml", project / "params.yaml")
    return project


def _evaluated(copy: Path, accuracy: float, macro_recall: float, which: str = train_seeds.METRICS) -> None:
    metrics = copy / which
    metrics.parent.mkdir(parents=True, exist_ok=True)
    metrics.write_text(json.dumps({"accuracy": accuracy, "macro_recall": macro_recall, "num_samples": 252}))


def test_a_copy_keeps_the_data_drops_the_sweep_and_store_and_trains_alone_untracked(tmp_path: Path) -> None:
    project = _project(tmp_path)
    copy = tmp_path / "seeds" / "winner-3"
    train_seeds.copy_project(project, copy, {**WINNER["params"], "train.seed": 3})
    assert (copy / "artifacts/preprocessed/train_images.npy").read_bytes() == b"x"
    assert (copy / "data/cat").is_dir()
    for gone in ("artifacts/sweep", "mlartifacts", "mlflow.db", "artifacts/train", "artifacts/evaluate"):
        assert not (copy / gone).exists(), gone
    params = load_params(copy / "params.yaml")
    assert (params.tracking.enabled, params.determinism.num_threads, params.train.seed) == (False, 1, 3)
    assert (params.train.lr, params.train.weight_decay, params.train.label_smoothing) == (0.0123, 0.0056, 0.0)
    assert load_params(project / "params.yaml").train.seed is None  # the set's own project untouched


def test_only_copies_not_yet_evaluated_train_and_a_half_done_one_starts_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project, folder = _project(tmp_path), tmp_path / "seeds"
    _evaluated(folder / "defaults-1", 0.68, 0.62)  # finished earlier, its last epoch scored too
    _evaluated(folder / "defaults-1", 0.70, 0.63, train_seeds.LAST)
    _evaluated(folder / "defaults-2", 0.66, 0.60)  # evaluated before the last epoch was scored
    (folder / "winner-1" / "artifacts/train").mkdir(parents=True)  # stopped mid-training
    (folder / "winner-1" / "artifacts/train/last.safetensors").write_bytes(b"half")
    trained: list[str] = []
    monkeypatch.setattr(train_seeds, "train_and_evaluate", lambda copy, env: trained.append(copy.name))
    train_seeds.run(project, folder, [1, 2, 3], WINNER, env={})
    assert sorted(trained) == ["defaults-2", "defaults-3", "winner-1", "winner-2", "winner-3"]
    assert (folder / "defaults-2" / train_seeds.METRICS).exists()  # kept: only its last epoch is left to score
    assert not (folder / "winner-1" / "artifacts/train/last.safetensors").exists()
    assert load_params(folder / "winner-2" / "params.yaml").train.lr == 0.0123
    assert load_params(folder / "defaults-3" / "params.yaml").train.lr == load_params(project / "params.yaml").train.lr


def test_a_copy_trains_evaluates_and_scores_its_last_epoch_and_an_evaluated_one_only_scores_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[tuple[str, list[str]]] = []

    def records(args: list[str], cwd: Path, **_: object) -> subprocess.CompletedProcess[str]:
        ran.append((Path(cwd).name, args[1:]))
        return subprocess.CompletedProcess(args, 0)

    monkeypatch.setattr(train_seeds.subprocess, "run", records)
    for name in ("fresh", "evaluated"):
        (tmp_path / name).mkdir()
    _evaluated(tmp_path / "evaluated", 0.68, 0.62)
    train_seeds.train_and_evaluate(tmp_path / "fresh", env={})
    train_seeds.train_and_evaluate(tmp_path / "evaluated", env={})
    assert [args[:3] for name, args in ran if name == "fresh"] == [
        ["-m", "tasks", "train"],
        ["-m", "tasks", "evaluate"],
        ["-c", train_seeds._LAST_EPOCH],
    ]
    assert [args for name, args in ran if name == "evaluated"] == [["-c", train_seeds._LAST_EPOCH]]
    assert 'TRAIN_DIR / "last.safetensors"' in train_seeds._LAST_EPOCH and train_seeds.LAST.startswith(
        "artifacts/evaluate-last/"
    )


def test_a_failed_training_stops_the_run_naming_its_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(copy: Path, env: dict[str, str]) -> None:
        raise RuntimeError(f"`python -m tasks train` exited 1 in {copy}")

    monkeypatch.setattr(train_seeds, "train_and_evaluate", fails)
    with pytest.raises(RuntimeError, match="defaults-5"):
        train_seeds.run(_project(tmp_path), tmp_path / "seeds", [5], None, env={})


def test_the_summary_gives_each_recipes_seeds_and_means_and_the_gap_in_points(tmp_path: Path) -> None:
    folder = tmp_path / "seeds"
    _evaluated(folder / "defaults-1", 0.70, 0.64)
    _evaluated(folder / "defaults-2", 0.66, 0.60)
    _evaluated(folder / "winner-1", 0.69, 0.63)
    _evaluated(folder / "winner-2", 0.71, 0.65)
    own = {
        "defaults": {42: {"test_accuracy": 0.67, "macro_recall": 0.61}},
        "winner": {7: {"test_accuracy": 0.70, "macro_recall": 0.64}},
    }
    out = train_seeds.summary(folder, own)
    assert list(out["defaults"]["seeds"]) == ["1", "2", "42"]
    assert out["defaults"]["mean_test_accuracy"] == pytest.approx((0.70 + 0.66 + 0.67) / 3)
    assert out["winner"]["mean_macro_recall"] == pytest.approx((0.63 + 0.65 + 0.64) / 3)
    assert out["winner_minus_defaults_points"] == pytest.approx(100 * (0.70 - 0.67666667), abs=0.01)
    assert "last_epoch" not in out["defaults"]  # no copy's last epoch scored yet
    _evaluated(folder / "defaults-1", 0.76, 0.70, train_seeds.LAST)
    _evaluated(folder / "defaults-2", 0.64, 0.58, train_seeds.LAST)
    last = train_seeds.summary(folder, own)["defaults"]["last_epoch"]
    assert list(last["seeds"]) == ["1", "2"]  # the copies only: the row's own run has no last epoch scored
    assert last["mean_test_accuracy"] == pytest.approx(0.70)
    assert last["last_minus_kept_points"] == pytest.approx(100 * ((0.76 - 0.70) + (0.64 - 0.66)) / 2)


def test_seeds_are_integers_separated_by_commas() -> None:
    assert _seeds("1,2") == [1, 2]
    for bad in ("1,x", "1,-2"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"--seeds '{bad}': expected integers >= 0"):
            _seeds(bad)


def test_seeds_of_a_set_never_run_are_refused_and_nothing_is_created(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="has no run of the set: run its row first"):
        main(["twemoji", "--seeds", "1", "--work", str(tmp_path), "--out", str(tmp_path / "out.json")])
    assert list(tmp_path.iterdir()) == []
