"""`auto` chosen from the data (tasks/train/auto.py): an image folder's epochs, early stopping, class
balance and kept epoch follow its training and validation splits, each choice is recorded with its
reason (train.json, the checkpoint's config, MLflow, the model card), and fine-tuning continues with
what train chose."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from benchmarks.fakedata.imagefolder import imagefolder_tree
from tasks.core import layout
from tasks.core.config.data import SOURCES
from tasks.core.config.params import Params
from tasks.core.config.train import TrainConfig
from tasks.core.config.yaml_io import load_params
from tasks.data.download import download
from tasks.data.preprocess import Preprocessed, preprocess
from tasks.data.stats import compute_stats
from tasks.determinism.bootstrap import start
from tasks.train import auto
from tasks.train.auto import DataProfile, as_trained, resolve
from tasks.train.checkpoints import read_safetensors, result_config
from tasks.train.stage import train
from tests.conftest import write_params

FOLDER = {"source": "imagefolder", "path": "/data/photos"}
FROM_DATA = {
    "epochs": "auto",
    "lr": "auto",
    "early_stop_patience": "auto",
    "class_balance": "auto",
    "label_smoothing": "auto",
    "keep": "auto",
}


def _profile(*counts: int, shape: tuple[int, int, int] = (3, 32, 32), val: int = 300) -> DataProfile:
    return DataProfile(tuple(counts), shape, val)


@pytest.mark.parametrize(
    ("images", "epochs"),
    [
        (173, 200),  # 3 steps an epoch: 1,600 steps would be 534 epochs; 200 is the most
        (726, 134),  # 12 steps: 134 epochs reach 1,600
        (1374, 73),  # 22 steps
        (3486, 30),  # 55 steps: the real digits' 30 epochs (docs/training.md)
        (12000, 15),  # 188 steps: 1,600 in 9 epochs, but never fewer than 15
        (12, 200),  # one step an epoch: the most, not 1,600
    ],
)
def test_epochs_give_a_small_folder_the_steps_a_large_one_gets(images: int, epochs: int) -> None:
    cfg, choices = resolve(TrainConfig(**FROM_DATA), _profile(images // 2, images - images // 2))
    assert cfg.epochs == choices["epochs"].value == epochs
    assert f"{images} training images" in choices["epochs"].reason


def test_accumulated_batches_count_as_one_step() -> None:
    cfg, _ = resolve(TrainConfig(**FROM_DATA, batch_size=32, accumulate_steps=2), _profile(363, 363))
    assert cfg.epochs == 134  # 12 optimiser steps of 64 images, as batch_size 64 alone


def test_patience_is_half_the_run_and_absent_when_it_would_never_stop() -> None:
    long, choices = resolve(TrainConfig(**FROM_DATA), _profile(100, 73))
    assert (long.epochs, long.early_stop_patience) == (200, 100)
    assert "half of 200 epochs" in choices["early_stop_patience"].reason
    short, _ = resolve(TrainConfig(**FROM_DATA), _profile(6000, 6000))
    assert (short.epochs, short.early_stop_patience) == (15, 10)
    given, _ = resolve(TrainConfig(**{**FROM_DATA, "epochs": 8}), _profile(100, 73))
    assert given.early_stop_patience is None  # 10 epochs of patience in 8: it could never stop


@pytest.mark.parametrize(
    ("side", "lr"),
    [
        (8, 0.05),  # the 8x8 digits' rate
        (28, 0.05),
        (32, 0.05),
        (48, 0.022222),  # (32 / 48)² of it
        (64, 0.0125),  # a quarter: the real 64 px sets' better rate
        (224, 0.0125),  # never below a quarter: unmeasured beyond 64 px
    ],
)
def test_the_learning_rate_falls_with_the_image_area_above_32_px(side: int, lr: float) -> None:
    cfg, choices = resolve(TrainConfig(**FROM_DATA), _profile(300, 250, shape=(3, side, side)))
    assert cfg.lr == choices["lr"].value == lr
    assert f"{side} px images" in choices["lr"].reason
    wide, _ = resolve(TrainConfig(**FROM_DATA), _profile(300, 250, shape=(3, side, 1000)))
    assert wide.lr == lr  # the shorter side decides


@pytest.mark.parametrize(
    ("val", "keep", "patience"),
    [
        (39, "last", None),  # the real sprites' split: an image is 2.6 points; the schedule runs to its end
        (99, "last", None),
        (0, "last", None),  # nothing to pick the best by
        (100, "best", 100),  # an image is a point: the best epoch, early stopping on as before
        (280, "best", 100),  # the real emoji's split
    ],
)
def test_a_small_validation_split_keeps_the_last_epoch(val: int, keep: str, patience: int | None) -> None:
    cfg, choices = resolve(TrainConfig(**FROM_DATA), _profile(100, 73, val=val))  # 200 epochs
    assert cfg.keep == choices["keep"].value == keep
    assert f"{val} validation images" in choices["keep"].reason or val == 0
    assert cfg.early_stop_patience == choices["early_stop_patience"].value == patience
    if keep == "last":
        assert "the last epoch is kept" in choices["early_stop_patience"].reason


def test_keep_last_beside_early_stopping_is_refused_and_auto_keeps_the_best_beside_a_given_patience() -> None:
    with pytest.raises(ValueError, match="keep: last with early_stop_patience 20: the run would keep whichever"):
        TrainConfig(keep="last", early_stop_patience=20)
    cfg, choices = resolve(TrainConfig(**{**FROM_DATA, "early_stop_patience": 20}), _profile(100, 73, val=39))
    assert (cfg.keep, cfg.early_stop_patience) == ("best", 20)
    assert "early stopping is on (early_stop_patience 20)" in choices["keep"].reason


@pytest.mark.parametrize(
    ("counts", "balance"), [((100, 90, 80), "none"), ((300, 100), "sampler"), ((500, 50), "sampler")]
)
def test_class_balance_follows_the_largest_class_over_the_smallest(counts: tuple[int, ...], balance: str) -> None:
    cfg, choices = resolve(TrainConfig(**FROM_DATA), _profile(*counts))
    assert cfg.class_balance == choices["class_balance"].value == balance
    assert f"{max(counts) / min(counts):.1f}x" in choices["class_balance"].reason
    # label smoothing: hard targets where the classes are drawn equally often, 0.1 elsewhere
    assert cfg.label_smoothing == choices["label_smoothing"].value == (0.0 if balance == "sampler" else 0.1)
    assert f"{max(counts) / min(counts):.1f}x" in choices["label_smoothing"].reason


def test_what_the_user_set_is_kept_and_a_published_source_is_resolved_when_params_load() -> None:
    given = TrainConfig(
        epochs=7, lr=0.2, early_stop_patience=3, class_balance="sampler", label_smoothing=0.2, keep="best"
    )
    assert resolve(given, _profile(500, 5)) == (given, {})
    digits = Params.model_validate({"train": FROM_DATA}).train  # digits: a measured recipe, no data rule
    assert (digits.epochs, digits.early_stop_patience, digits.class_balance) == (30, None, "none")
    assert (digits.label_smoothing, digits.keep, digits.lr) == (0.1, "best", 0.05)
    assert resolve(digits, _profile(500, 5)) == (digits, {})
    folder = Params.model_validate({"data": FOLDER, "train": FROM_DATA}).train
    assert (folder.epochs, folder.early_stop_patience, folder.class_balance) == ("auto", "auto", "auto")
    assert folder.label_smoothing == folder.keep == folder.lr == "auto"
    assert SOURCES["imagefolder"].recipe.epochs == "auto"


def test_compress_continues_with_what_train_chose() -> None:
    folder = Params.model_validate({"data": FOLDER, "train": FROM_DATA}).train
    chosen, _ = resolve(folder, _profile(300, 60))
    # the checkpoint records the recipe keys that differ from their defaults: patience and balance here
    tuned = as_trained(folder, result_config(chosen))
    assert (tuned.epochs, tuned.early_stop_patience, tuned.class_balance) == (200, 100, "sampler")  # 6 steps an epoch
    unweighted, _ = resolve(folder, _profile(300, 250))  # class_balance "none": left out of the checkpoint
    assert as_trained(folder, result_config(unweighted)).class_balance == "none"
    assert as_trained(folder, result_config(unweighted)).keep == "best"  # at its default: left out too
    assert as_trained(folder, result_config(unweighted)).lr == 0.05
    small, _ = resolve(folder, _profile(300, 60, val=39, shape=(3, 64, 64)))
    assert as_trained(folder, result_config(small)).lr == 0.0125
    assert result_config(small)["keep"] == "last"
    assert (
        as_trained(folder, result_config(small)).keep,
        as_trained(folder, result_config(small)).early_stop_patience,
    ) == ("last", None)


def test_the_profile_counts_the_splits_without_reading_their_images() -> None:
    split = Preprocessed(np.zeros((5, 3, 4, 6), np.uint8), np.array([0, 2, 2, 2, 0]), ["a", "b", "c"], [0.5], [0.2])
    val = Preprocessed(np.zeros((2, 3, 4, 6), np.uint8), np.array([1, 2]), ["a", "b", "c"], [0.5], [0.2])
    assert auto.profile(split, val) == DataProfile((2, 0, 3), (3, 4, 6), 2)
    assert auto.profile(split, val).imbalance == 1.5  # an absent class is no class to balance


def test_the_train_stage_chooses_and_records_why(pre: Path, tmp_path: Path) -> None:
    cfg = TrainConfig(model="small_cnn", augment="none", max_batches=1, num_workers=0, **FROM_DATA)
    start(42, 1)
    result = train(cfg, 42, pre, tmp_path)
    recorded = json.loads((tmp_path / "train.json").read_text())["recipe"]
    assert recorded == result.recipe
    assert recorded["epochs"]["value"] == 80  # 1,238 digits make 20 steps an epoch: 80 epochs for 1,600
    assert "1238 training images make 20 optimiser steps an epoch" in recorded["epochs"]["reason"]
    assert recorded["class_balance"]["value"] == "none"
    assert recorded["keep"]["value"] == "best" and "validation images: the best epoch" in recorded["keep"]["reason"]
    assert recorded["lr"]["value"] == 0.05 and recorded["lr"]["reason"].startswith("8 px images")
    config = read_safetensors(tmp_path / "best.safetensors", tensors=False)[0]["config"]
    assert config["epochs"] == 80 and config["early_stop_patience"] == 40  # numbers, never "auto"
    rows = json.loads((tmp_path / "history.json").read_text())
    assert result.stopped_early_at == (len(rows) if len(rows) < 80 else None)


@pytest.fixture
def folder_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Params, str]:
    """A project of 8x8 grey noise in three classes, 5:5:1 (imbalanced): params with every `auto` left
    in, and an MLflow store of its own (sqlite), the process inside it as `python -m tasks` would be."""
    from mlflow import MlflowClient

    photos = tmp_path / "photos"
    imagefolder_tree(photos, classes=("a", "b"), per_class=50, size=(8, 8), mode="L")
    imagefolder_tree(photos, classes=("c",), per_class=10, size=(8, 8), mode="L", seed=1)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    MlflowClient(tracking_uri=uri).create_experiment("lockstep", artifact_location=(tmp_path / "mlruns").as_uri())
    params = load_params(
        write_params(
            tmp_path / "params.yaml",
            {
                "data": {"source": "imagefolder", "path": str(photos), "channels": 1},
                "train": {"model": "small_cnn", "augment": "none", "max_batches": 1, "num_workers": 0},
                "determinism": {"num_threads": 1},
                "compress": {"latency_runs": 20, "latency_warmup": 1},
            },
        )
    )
    return params, uri


@pytest.mark.slow
def test_a_folder_run_records_each_choice_in_mlflow_the_card_and_compress(folder_project: tuple[Params, str]) -> None:
    from mlflow import MlflowClient

    from tasks.runner import run_stage
    from tasks.tracking.runs import pipeline_run

    params, uri = folder_project
    assert params.train.epochs == params.train.class_balance == "auto"  # left to the train stage
    # the data stages as functions (their runs would `dvc add` in a folder that is no DVC repo)
    download(params.data, layout.DATA_DIR, Path("cache"))
    stats = compute_stats(layout.DATA_DIR, params.split, params.seed, 4096)
    layout.STATS_FILE.parent.mkdir(parents=True)
    layout.STATS_FILE.write_text(json.dumps(asdict(stats)))
    preprocess(layout.DATA_DIR, stats, params.split, params.seed, layout.PREPROCESSED_DIR)
    for stage in ("train", "evaluate", "compress", "export"):
        run_stage(stage, params)
    recipe = json.loads((layout.TRAIN_DIR / "train.json").read_text())["recipe"]
    # 84 training images: 2 steps an epoch, 800 wanted, 200 at most; the largest class 5x the smallest;
    # a validation split of a few images: the last epoch kept, the schedule run to its end
    assert {key: choice["value"] for key, choice in recipe.items()} == {
        "epochs": 200,
        "lr": 0.05,  # 8 px
        "keep": "last",
        "early_stop_patience": None,
        "class_balance": "sampler",
        "label_smoothing": 0.0,  # as imbalanced
    }
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("lockstep").experiment_id
    (train_run,) = client.search_runs(experiment, "tags.`lockstep.stage` = 'train'")
    logged = train_run.data.params
    assert logged["train.epochs"] == "auto" and logged["auto.train.epochs"] == "200"
    assert logged["auto.train.class_balance.reason"] == recipe["class_balance"]["reason"]
    assert logged["train.label_smoothing"] == "auto" and logged["auto.train.label_smoothing"] == "0.0"
    card = (layout.EXPORT_DIR / "model_card.md").read_text()
    assert f"- class_balance (auto, from the data): `sampler`: {recipe['class_balance']['reason']}" in card
    assert "- kept epoch: 200, the last (train.keep: last), validation accuracy" in card
    # compress fine-tuned nothing here, but resolved from the checkpoint what it would fine-tune with
    config = read_safetensors(layout.TRAIN_DIR / "best.safetensors", tensors=False)[0]["config"]
    assert (as_trained(params.train, config).class_balance, as_trained(params.train, config).keep) == (
        "sampler",
        "last",
    )
    # the pipeline's run, recorded from these outputs, names what auto became beside what params.yaml says
    with pipeline_run(params.tracking, entry_point="dvc", params=params) as pipeline_id:
        assert pipeline_id is not None
    shown = client.get_run(pipeline_id).data.params
    assert shown["train.epochs"] == "auto" and shown["auto.train.epochs"] == "200"
    assert shown["auto.train.class_balance"] == "sampler"
