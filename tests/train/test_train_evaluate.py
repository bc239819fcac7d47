"""train and evaluate: bit-for-bit determinism across processes, checkpoints, metrics."""

from __future__ import annotations

import hashlib
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tasks.core.config.data import SOURCES, DataConfig, SplitConfig
from tasks.core.config.params import Params
from tasks.core.config.train import EvaluateConfig, TrainConfig
from tasks.data.download import download
from tasks.data.formats import NpyRows
from tasks.data.preprocess import Preprocessed, in_batches, load_split, preprocess
from tasks.data.stats import compute_stats
from tasks.determinism.bootstrap import start
from tasks.train.augment import AugmentedBatches, shift_pixels
from tasks.train.checkpoints import CheckpointError, load_checkpoint, result_config
from tasks.train.evaluate import accuracy_interval, class_scores, confusion_matrix, evaluate
from tasks.train.loop import build_training
from tasks.train.models import predict
from tasks.train.stage import train
from tests.conftest import ROOT, run, subprocess_env, write_params

SPLIT = SplitConfig()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory laid out like the project, with the preprocessed digits in place."""
    work = tmp_path_factory.mktemp("work")
    download(DataConfig(), work / "data", work / "cache")
    stats = compute_stats(work / "data", SPLIT, 42, 4096)
    preprocess(work / "data", stats, SPLIT, 42, work / "artifacts" / "preprocessed")
    return work


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _train_in_subprocess(base: Path, name: str, **train: object) -> subprocess.Popen[str]:
    run_dir = base / name
    (run_dir / "artifacts").mkdir(parents=True)
    (run_dir / "artifacts" / "preprocessed").symlink_to(base / "artifacts" / "preprocessed")
    write_params(
        run_dir / "params.yaml",
        {
            "tracking": {"enabled": False},
            "determinism": {"num_threads": 1},
            # hflip: on (digits would not get it by default) so that mirroring is held to the same bytes too
            "train": {"epochs": 3, "num_workers": 2, "hflip": True, **train},
        },
    )
    return subprocess.Popen(
        ["python", "-m", "tasks", "train"],
        cwd=run_dir,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_training_is_bitwise_reproducible_in_separate_processes(workdir: Path) -> None:
    # "b" also loads its batches in its own process, where "a" has two loader workers: augmentation is
    # seeded per batch and shuffling per epoch, not per worker, so the worker count must not change the
    # weights either (nor, left out of the recorded config, the file). One pair shows both: a third
    # process for the worker count alone cost this test a quarter of its time. That another seed gives
    # other weights is the next test's, in-process.
    procs = {"a": _train_in_subprocess(workdir, "a"), "b": _train_in_subprocess(workdir, "b", num_workers=0)}
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}:\n{output}"
    out = {name: workdir / name / "artifacts" / "train" for name in procs}
    a, b = load_file(str(out["a"] / "last.safetensors")), load_file(str(out["b"] / "last.safetensors"))
    differ = sorted(k for k in a.keys() & b.keys() if not torch.equal(a[k], b[k]))
    assert a.keys() == b.keys() and not differ, f"tensors that differ (2 loader workers vs none): {differ[:5]}"
    for ckpt in ("last.safetensors", "best.safetensors"):  # whole files, metadata included
        assert _sha(out["a"] / ckpt) == _sha(out["b"] / ckpt), ckpt
    assert json.loads((out["a"] / "history.json").read_text()) == json.loads((out["b"] / "history.json").read_text())


def test_another_seed_trains_other_weights(workdir: Path, tmp_path: Path) -> None:
    """The seed reaches the weights, so the same bytes above say something. In this process, as the stage
    starts its own (`start`, then `train`): a third training process cost the test above ~7 CPU-seconds."""
    cfg = TrainConfig(epochs=1, num_workers=0, max_batches=2, hflip=True)
    weights = {}
    for seed in (42, 43):
        start(seed, 1)
        train(cfg, seed, workdir / "artifacts" / "preprocessed", tmp_path / str(seed))
        weights[seed] = load_file(str(tmp_path / str(seed) / "last.safetensors"))
    assert weights[42].keys() == weights[43].keys()
    assert all(not torch.equal(weights[42][k], weights[43][k]) for k in weights[42] if k.endswith(".weight"))


def test_checkpoint_is_plain_safetensors_with_provenance(workdir: Path, tmp_path: Path) -> None:
    start(42, 1)
    cfg = TrainConfig(epochs=2, num_workers=0, max_batches=3)
    result = train(cfg, 42, workdir / "artifacts" / "preprocessed", tmp_path)
    tensors = load_file(str(tmp_path / "best.safetensors"))  # no pickle involved
    assert "net.classifier.weight" in tensors and "mean" in tensors  # resnet9's head
    model, meta = load_checkpoint(tmp_path / "best.safetensors")
    assert meta["config"] == result_config(cfg) and meta["seed"] == 42 and meta["epoch"] == result.best_epoch
    assert meta["world_size"] == 1 and "num_workers" not in meta["config"]  # how it ran, not what it computed
    history = json.loads((tmp_path / "history.json").read_text())
    assert [row["epoch"] for row in history] == [1, 2]
    assert set(history[0]) == {"epoch", "train_loss", "train_accuracy", "val_loss", "val_accuracy", "lr"}


def test_training_shows_a_bar_per_batch_and_a_line_per_epoch(
    workdir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    from tqdm.auto import tqdm

    shown = io.StringIO()

    class OnATerminal(tqdm):  # tqdm as on a terminal (it stays quiet when stderr is not one, as under pytest)
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **{**kwargs, "disable": False, "file": shown, "mininterval": 0})

    monkeypatch.setattr("tasks.train.stage.tqdm", OnATerminal)
    start(42, 1)
    with caplog.at_level("INFO", logger="tasks.train.stage"):
        train(TrainConfig(epochs=2, num_workers=0, max_batches=3), 42, workdir / "artifacts" / "preprocessed", tmp_path)
    bar = shown.getvalue()
    assert "train: 100%" in bar and "6/6 [" in bar and "batch/s" in bar and "epoch=2/2" in bar, bar[-500:]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch ")]
    assert [line.split(":")[0] for line in lines] == ["epoch 1/2", "epoch 2/2"]
    assert all(all(f" {key} " in line for key in ("train_loss", "val_accuracy", "lr")) for line in lines), lines


def test_resnet18_adamw_and_step_schedule(workdir: Path, tmp_path: Path) -> None:
    start(0, 2)
    cfg = TrainConfig(
        model="resnet18",
        optimizer="adamw",
        lr=1e-3,
        scheduler="step",
        step_size=1,
        gamma=0.5,
        epochs=2,
        batch_size=32,
        num_workers=0,
        max_batches=2,
    )
    train(cfg, 0, workdir / "artifacts" / "preprocessed", tmp_path)
    history = json.loads((tmp_path / "history.json").read_text())
    assert [round(row["lr"], 8) for row in history] == [5e-4, 2.5e-4]
    model, meta = load_checkpoint(tmp_path / "last.safetensors")
    assert meta["model"] == "resnet18" and model.net.conv1.kernel_size == (3, 3)
    assert model(torch.rand(4, 1, 8, 8)).shape == (4, 10)


def test_checkpoint_of_another_architecture_is_refused(workdir: Path, tmp_path: Path) -> None:
    start(0, 1)
    train(TrainConfig(epochs=1, num_workers=0, max_batches=1), 0, workdir / "artifacts" / "preprocessed", tmp_path)
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(tmp_path / "last.safetensors"), framework="pt") as handle:
        meta = json.loads(handle.metadata()["lockstep"])
    meta["model"] = "resnet18"
    forged = {"lockstep": json.dumps(meta)}
    save_file(load_file(str(tmp_path / "last.safetensors")), str(tmp_path / "forged.safetensors"), metadata=forged)
    with pytest.raises(CheckpointError, match="forged.safetensors: weights do not fit model 'resnet18'"):
        load_checkpoint(tmp_path / "forged.safetensors")


def test_evaluate_reports_consistent_metrics(workdir: Path, tmp_path: Path) -> None:
    start(42, 2)
    pre = workdir / "artifacts" / "preprocessed"
    train(TrainConfig(epochs=3, num_workers=0), 42, pre, tmp_path / "train")
    result = evaluate(EvaluateConfig(batch_size=100), tmp_path / "train" / "best.safetensors", pre, tmp_path / "eval")
    confusion = np.array(result.confusion)
    test = load_split(pre, "test")
    assert confusion.sum() == len(test.labels) == result.metrics["num_samples"]
    assert result.metrics["accuracy"] == pytest.approx(np.trace(confusion) / confusion.sum())
    assert result.metrics["accuracy"] > 0.8
    correct, total = int(np.trace(confusion)), int(confusion.sum())
    interval = (result.metrics["accuracy_ci95_low"], result.metrics["accuracy_ci95_high"])
    assert interval == accuracy_interval(correct, total)
    assert interval[0] < result.metrics["accuracy"] < interval[1]
    assert set(result.per_class) == set(test.classes)
    for name, row in result.per_class.items():
        i = test.classes.index(name)
        assert row["support"] == confusion[i].sum()
        assert row["recall"] == pytest.approx(confusion[i, i] / confusion[i].sum())
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text()) == result.metrics
    assert (tmp_path / "eval" / "confusion_matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bf16_autocast_trains_on_cpu_and_fp16_and_syncbn_need_cuda(workdir: Path, tmp_path: Path) -> None:
    start(42, 1)
    result = train(
        TrainConfig(epochs=1, num_workers=0, max_batches=2, amp="bf16"),
        42,
        workdir / "artifacts" / "preprocessed",
        tmp_path / "bf16",
    )
    assert result.amp == "bf16" and json.loads((tmp_path / "bf16" / "train.json").read_text())["amp"] == "bf16"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="train.amp: fp16 needs a CUDA device"):
            train(
                TrainConfig(epochs=1, num_workers=0, max_batches=1, amp="fp16", device="cpu"),
                42,
                workdir / "artifacts" / "preprocessed",
                tmp_path / "fp16",
            )
        with pytest.raises(ValueError, match="train.sync_batchnorm: .* CUDA devices only"):
            train(
                TrainConfig(epochs=1, num_workers=0, sync_batchnorm=True, device="cpu"),
                42,
                workdir / "artifacts" / "preprocessed",
                tmp_path / "syncbn",
            )


_PIN_THEN_COMPILE = """
import sys
from tasks.determinism.bootstrap import start
pinned = start(0, 1, strict=True)
assert pinned["deterministic_algorithms"] and not pinned["deterministic_warn_only"], pinned
assert "torch._inductor.config" not in sys.modules, "pinning imported inductor (3.5 s per stage)"
import torch._inductor.config as inductor_config
assert inductor_config.deterministic, "a later torch.compile would not be deterministic"
"""


def test_pinning_is_cheap_and_still_reaches_inductor() -> None:
    run([sys.executable, "-c", _PIN_THEN_COMPILE], ROOT, PYTHONPATH=str(ROOT))


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_auto_epochs_and_mirroring_follow_the_source(source: str) -> None:
    extra = {"url": "https://example.org/a.tar.gz", "sha256": "0" * 64} if source == "imagefolder" else {}
    train = {"epochs": "auto", "hflip": "auto", "augment": "auto"}
    auto = Params.model_validate({"data": {"source": source, **extra}, "train": train})
    recipe = SOURCES[source].recipe
    assert (auto.train.epochs, auto.train.hflip, auto.train.augment) == (recipe.epochs, recipe.hflip, recipe.augment)
    # MLflow sees the number; an image folder's "auto" until the train stage chooses (train.json, auto.train.*)
    assert auto.sections("train")["train.epochs"] == SOURCES[source].recipe.epochs
    assert auto.sections("train")["data.source"] == source  # and what it was resolved from
    given = Params.model_validate({"data": {"source": source, **extra}, "train": {"epochs": 3, "hflip": True}})
    assert (given.train.epochs, given.train.hflip) == (3, True)


@pytest.mark.parametrize(("channels", "augment"), [(None, "affine"), (3, "affine"), (1, "elastic")])
def test_a_greyscale_folder_is_distorted_elastically(channels: int | None, augment: str) -> None:
    data = {"source": "imagefolder", "path": "/data/digits", "channels": channels}
    auto = Params.model_validate({"data": data, "train": {"augment": "auto"}})
    assert auto.train.augment == augment
    assert auto.sections("train")["data.channels"] == channels  # what it was resolved from, in MLflow and DVC
    assert auto.sections("compress")["data.channels"] == channels  # compress fine-tunes with the same augment
    given = Params.model_validate({"data": data, "train": {"augment": "shift_flip"}})
    assert given.train.augment == "shift_flip"


def test_mirroring_is_for_garments_and_photos_not_digits() -> None:
    assert [s for s, source in SOURCES.items() if source.recipe.hflip] == ["fashion_mnist", "cifar10", "cifar100"]
    assert {s: v.recipe.augment for s, v in SOURCES.items() if v.recipe.augment != "shift_flip"} == {
        "imagefolder": "affine"
    }


def test_an_unresolved_auto_is_refused_before_training() -> None:
    split = Preprocessed(np.zeros((4, 1, 8, 8), np.uint8), np.arange(4) % 2, ["a", "b"], [0.5], [0.25])
    with pytest.raises(ValueError, match=r"train.epochs: 'auto' depends on the data: resolve with TrainConfig"):
        build_training(TrainConfig(epochs="auto", num_workers=0), 0, split, torch.device("cpu"))


def test_shift_auto_is_an_eighth_of_the_shorter_side() -> None:
    sizes = [(8, 8), (28, 28), (32, 32), (32, 20), (4, 4), (224, 224)]
    assert [shift_pixels(TrainConfig(), size) for size in sizes] == [1, 4, 4, 2, 1, 28]
    assert shift_pixels(TrainConfig(random_shift=0), (32, 32)) == 0
    assert shift_pixels(TrainConfig(random_shift=3), (8, 8)) == 3


def test_mirroring_is_seeded_by_the_batch_and_flips_about_half() -> None:
    images = np.random.default_rng(0).integers(0, 256, (400, 3, 6, 5), dtype=np.uint8)
    split = Preprocessed(images, np.zeros(400, np.int64), ["a"], [0.5] * 3, [0.25] * 3)
    batches = AugmentedBatches(split, max_shift=0, hflip=True, seed=7)
    indices = list(range(0, 400, 2)) + list(range(1, 400, 2))
    out, _ = batches.__getitems__(indices)
    again, _ = AugmentedBatches(split, max_shift=0, hflip=True, seed=7).__getitems__(indices)
    assert torch.equal(out, again), "the same batch gets the same flips, whichever worker fetches it"
    original = torch.from_numpy(images[indices])
    flipped = (out == original.flip(-1)).flatten(1).all(1)
    kept = (out == original).flatten(1).all(1)
    assert bool((flipped | kept).all()), "each image is itself or its mirror, nothing else"
    assert 0.4 < flipped.float().mean().item() < 0.6
    other, _ = AugmentedBatches(split, max_shift=0, hflip=True, seed=8).__getitems__(indices)
    assert not torch.equal(out, other)
    plain, _ = AugmentedBatches(split, max_shift=0, hflip=False, seed=7).__getitems__(indices)
    assert torch.equal(plain, original)


def test_a_streamed_split_gives_the_batches_and_validation_of_one_in_memory(workdir: Path) -> None:
    """The train stage reads its splits from their files (a split larger than memory trains): the
    batches and the validation are the in-memory ones, and loader workers are sent no copy of it."""
    pre = workdir / "artifacts" / "preprocessed"
    memory, streamed = load_split(pre, "train"), load_split(pre, "train", stream=True)
    assert isinstance(streamed.images, NpyRows) and streamed.images.shape == memory.images.shape
    indices = [5, 3, 3, 900, 0, 1, 2, len(memory.labels) - 1]  # unordered, repeated, runs, the last row
    for batches in (AugmentedBatches(memory, 2, True, 7), AugmentedBatches(streamed, 2, True, 7)):
        images, labels = batches.__getitems__(indices)
        expected, _ = AugmentedBatches(memory, 2, True, 7).__getitems__(indices)
        assert torch.equal(images, expected) and labels.tolist() == memory.labels[indices].tolist()
    sent = pickle.dumps(AugmentedBatches(streamed, 2, True, 7))  # what a loader worker receives:
    assert len(sent) < memory.labels.nbytes + 4096  # the labels and where the images are, not the images
    start(42, 1)
    training = build_training(TrainConfig(model="small_cnn", epochs=1, hflip=False), 42, memory, torch.device("cpu"))
    in_memory = training.validate(load_split(pre, "val"))
    assert training.validate(load_split(pre, "val", stream=True)) == in_memory


def test_the_test_split_streamed_scores_as_it_does_in_memory(workdir: Path, tmp_path: Path) -> None:
    """evaluate, compress, export and promotion read the test split from its file, a few batches at a
    time: the same logits (torch and ONNX Runtime) and the same split digest as the split in memory."""
    from tasks.ship.onnx_model import export_onnx, session
    from tasks.ship.onnx_model import predict as onnx_predict
    from tasks.ship.promotion import split_sha256

    pre = workdir / "artifacts" / "preprocessed"
    memory, streamed = load_split(pre, "test"), load_split(pre, "test", stream=True)
    assert isinstance(streamed.images, NpyRows)
    batches = list(in_batches(streamed.images, 7))  # a batch size that does not divide the split
    assert [len(b) for b in batches[:-1]] == [7] * (len(batches) - 1) and len(batches[-1]) <= 7
    start(42, 1)
    model = build_training(TrainConfig(model="small_cnn", epochs=1, hflip=False), 42, memory, torch.device("cpu")).model
    expected = predict(model, memory.images, torch.device("cpu"), batch_size=7)
    assert torch.equal(predict(model, streamed.images, torch.device("cpu"), batch_size=7), expected)
    onnx_file = tmp_path / "model.onnx"
    export_onnx(model.eval(), torch.from_numpy(memory.images[:2]).float() / 255, onnx_file)
    sess = session(onnx_file, 1)
    assert np.array_equal(onnx_predict(sess, streamed.images, 7), onnx_predict(sess, memory.images, 7))
    assert split_sha256(streamed) == split_sha256(memory)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_confusion_matrix_and_class_scores_are_sklearns(seed: int) -> None:
    """evaluate's own metrics (written out to keep sklearn's import out of the stage) equal sklearn's,
    with a class that never occurs and one that is never predicted (sklearn's zero_division=0)."""
    from sklearn import metrics

    rng = np.random.default_rng(seed)
    actual = rng.choice([0, 1, 2, 4, 5], size=200)  # class 3 never occurs
    predicted = np.where(rng.random(200) < 0.7, actual, rng.choice([0, 1, 3, 4], size=200))  # 2 and 5 rarely
    predicted[predicted == 5] = 4  # class 5 never predicted
    confusion = confusion_matrix(actual, predicted, 6)
    np.testing.assert_array_equal(confusion, metrics.confusion_matrix(actual, predicted, labels=range(6)))
    ours = class_scores(confusion)
    theirs = metrics.precision_recall_fscore_support(actual, predicted, labels=range(6), zero_division=0)
    for mine, reference in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(mine, reference)
    assert ours[0][5] == 0 and ours[1][3] == 0 and ours[2][3] == 0  # the undefined ones are 0, not NaN


@pytest.mark.parametrize(("correct", "total"), [(25, 33), (0, 10), (10, 10), (1, 1), (750, 782), (5, 7), (1, 2)])
def test_the_accuracy_interval_is_wilsons_score_interval(correct: int, total: int) -> None:
    """evaluate's 95% interval is the set of accuracies p whose score test does not reject the observed
    one: its inner bounds solve (observed - p)^2 = z^2 p (1 - p) / total, and at 0 or all correct the
    outer bound is exactly 0 or 1. At 25 of 33 it is scipy's `binomtest(25, 33).proportion_ci(method=
    "wilson")`, 0.590-0.872 (scipy 1.17: the stage leaves scipy.stats' import out)."""
    low, high = accuracy_interval(correct, total)
    observed, z = correct / total, 1.959963984540054
    assert 0.0 <= low <= observed <= high <= 1.0
    for bound, at_the_end in ((low, correct == 0), (high, correct == total)):
        if at_the_end:
            assert bound == observed  # 0.0 or 1.0 exactly
        else:
            assert (observed - bound) ** 2 == pytest.approx(z * z * bound * (1 - bound) / total, rel=1e-9)
    if (correct, total) == (25, 33):
        assert (low, high) == pytest.approx((0.5897538017044264, 0.8716828662282499), abs=1e-15)


def test_an_accuracy_interval_of_no_test_images_is_refused() -> None:
    with pytest.raises(ValueError, match="an accuracy interval needs test images: got 0"):
        accuracy_interval(0, 0)
