"""The training recipe (train.*: early stopping, warm-up, clipping, accumulation, EMA, class balance,
augmentation presets, mixup/cutmix): each does what it says, and with all of them on a run is the same
bytes on any thread count and when killed and resumed. DDP with accumulation, clipping, warm-up and the
EMA is resumed after a SIGKILL in tests/train/test_ddp_resume.py."""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from tasks.core.config.base import ConfigError
from tasks.core.config.train import TrainConfig, recipe_changes
from tasks.core.config.yaml_io import load_params
from tasks.data.preprocess import Preprocessed, load_split
from tasks.determinism import cpu_mode
from tasks.determinism.bootstrap import start
from tasks.train import stage
from tasks.train.augment import ELASTIC_AT_PX, AugmentedBatches, BatchMixing, augmented_batches
from tasks.train.batches import BalancedSampler, class_weights
from tasks.train.checkpoints import cpu_state, read_safetensors, result_config
from tasks.train.loop import build_training
from tasks.train.recipe import epochs_without_improvement, should_stop, warmup_factor
from tasks.train.stage import train
from tasks.train.warps import AffineWarp, blurred_noise
from tests.conftest import write_params

# Every option on: what a run with all of them must still hold to.
EVERYTHING = {
    "model": "small_cnn",
    "epochs": 4,
    "hflip": True,
    "max_batches": 6,
    "warmup_epochs": 1,
    "grad_clip_norm": 1.0,
    "accumulate_steps": 2,
    "ema_decay": 0.9,
    "class_balance": "sampler",
    "augment": "trivialaugment",
    "mixup_alpha": 0.2,
    "cutmix_alpha": 1.0,
    "monitor": "val_loss",
    "early_stop_patience": 3,
}
PLAIN = {"model": "small_cnn", "hflip": False, "augment": "none", "scheduler": "none", "momentum": 0.0}


def _digests(out: Path) -> dict[str, str]:
    return {
        name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in ("best.safetensors", "last.safetensors")
    }


class Killed(Exception):
    pass


def test_every_option_at_once_is_the_same_bytes_on_any_thread_count_and_resumed(pre: Path, tmp_path: Path) -> None:
    cfg = TrainConfig(**EVERYTHING)
    start(42, 1)
    whole = train(cfg, 42, pre, tmp_path / "whole", resume_dir=tmp_path / "whole-resume")

    def die_at_epoch_3(row: dict[str, float]) -> None:
        if row["epoch"] == 3:
            raise Killed  # before epoch 3's checkpoint: the file holds epoch 2

    # portable bytes do not depend on the thread count (native ones do: there the same count is kept)
    threads = 2 if cpu_mode.resolve("auto") == "portable" else 1
    # and in two loader workers: the policy's draws are the batch's, whoever fetches it
    broken = cfg.model_copy(update={"num_workers": 2})
    start(42, threads)
    with pytest.raises(Killed):
        train(broken, 42, pre, tmp_path / "broken", resume_dir=tmp_path / "broken-resume", on_epoch=die_at_epoch_3)
    start(42, threads)
    resumed = train(broken, 42, pre, tmp_path / "broken", resume_dir=tmp_path / "broken-resume")

    assert resumed.resumed_from_epoch == 2 and whole.resumed_from_epoch is None
    assert _digests(tmp_path / "broken") == _digests(tmp_path / "whole")
    # the options are in the checkpoint's config; options left at their defaults are not
    config = read_safetensors(tmp_path / "whole" / "best.safetensors", tensors=False)[0]["config"]
    assert {k: config[k] for k in recipe_changes(cfg)} == recipe_changes(cfg)
    assert "ema_decay" not in result_config(TrainConfig())


def test_early_stopping_ends_the_run_and_the_best_epoch_ships(
    pre: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an improvement must beat 10 in val_loss: none does, so the run stops `patience` epochs after the first
    cfg = TrainConfig(
        **PLAIN, epochs=6, max_batches=3, monitor="val_loss", early_stop_patience=2, early_stop_min_delta=10.0
    )
    start(42, 1)
    result = train(cfg, 42, pre, tmp_path / "whole")
    assert result.stopped_early_at == 3
    history = load_history(tmp_path / "whole")
    assert [row["epoch"] for row in history] == [1, 2, 3]
    best = min(history, key=lambda row: row["val_loss"])
    assert read_safetensors(tmp_path / "whole" / "best.safetensors", tensors=False)[0]["epoch"] == best["epoch"]
    assert read_safetensors(tmp_path / "whole" / "last.safetensors", tensors=False)[0]["epoch"] == 3

    # killed after the stopping epoch's checkpoint, before the outputs: the restart trains no more epochs
    def killed(*args: object) -> None:
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(stage, "_write_outputs", killed)
        start(42, 1)
        with pytest.raises(Killed):
            train(cfg, 42, pre, tmp_path / "broken", resume_dir=tmp_path / "resume")
    start(42, 1)
    resumed = train(cfg, 42, pre, tmp_path / "broken", resume_dir=tmp_path / "resume")
    assert (resumed.resumed_from_epoch, resumed.stopped_early_at) == (3, 3)
    assert load_history(tmp_path / "broken") == history
    assert _digests(tmp_path / "broken") == _digests(tmp_path / "whole")


def test_keep_last_ships_the_last_epoch_and_resumes_to_the_same_bytes(pre: Path, tmp_path: Path) -> None:
    cfg = TrainConfig(**PLAIN, epochs=4, max_batches=3, keep="last")
    start(42, 1)
    result = train(cfg, 42, pre, tmp_path / "whole", resume_dir=tmp_path / "whole-resume")
    history = load_history(tmp_path / "whole")
    assert (result.best_epoch, result.best_val_accuracy) == (4, history[-1]["val_accuracy"])
    kept, kept_tensors = read_safetensors(tmp_path / "whole" / "best.safetensors")
    assert (kept["epoch"], kept["config"]["keep"]) == (4, "last")
    assert _digests(tmp_path / "whole")["best.safetensors"] == _digests(tmp_path / "whole")["last.safetensors"]
    # the same training with keep: best ends on the same weights; only which epoch ships differs
    start(42, 1)
    best = train(cfg.model_copy(update={"keep": "best"}), 42, pre, tmp_path / "best")
    last_tensors = read_safetensors(tmp_path / "best" / "last.safetensors")[1]
    assert kept_tensors.keys() == last_tensors.keys()
    assert all(torch.equal(kept_tensors[name], last_tensors[name]) for name in kept_tensors)
    scores = [row["val_accuracy"] for row in history]
    assert best.best_epoch == scores.index(max(scores)) + 1

    def die_at_epoch_3(row: dict[str, float]) -> None:
        if row["epoch"] == 3:
            raise Killed  # before epoch 3's checkpoint: the file holds epoch 2, and no best weights

    start(42, 1)
    with pytest.raises(Killed):
        train(cfg, 42, pre, tmp_path / "broken", resume_dir=tmp_path / "resume", on_epoch=die_at_epoch_3)
    start(42, 1)
    assert train(cfg, 42, pre, tmp_path / "broken", resume_dir=tmp_path / "resume").resumed_from_epoch == 2
    assert _digests(tmp_path / "broken") == _digests(tmp_path / "whole")


def load_history(out: Path) -> list[dict[str, float]]:
    return json.loads((out / "history.json").read_text())


@pytest.mark.parametrize(
    ("monitor", "values", "min_delta", "stale"),
    [
        ("val_accuracy", [0.5, 0.6, 0.6, 0.59], 0.0, 2),
        ("val_accuracy", [0.5, 0.6, 0.61, 0.614], 0.015, 2),  # compared with 0.6, not with each step
        ("val_loss", [1.0, 0.8, 0.9, 0.7], 0.0, 0),
        ("val_loss", [1.0, float("nan"), float("nan")], 0.0, 2),  # NaN never improves
    ],
)
def test_epochs_without_improvement_follow_monitor_and_min_delta(
    monitor: str, values: list[float], min_delta: float, stale: int
) -> None:
    history = [{"epoch": i, monitor: v} for i, v in enumerate(values, start=1)]
    cfg = TrainConfig(monitor=monitor, early_stop_min_delta=min_delta, early_stop_patience=2)
    assert epochs_without_improvement(history, cfg) == stale
    assert should_stop(history, cfg) == (stale >= 2)
    assert not should_stop(history, TrainConfig(monitor=monitor))  # no patience: never


def _lrs_at_each_step(training) -> list[float]:
    lrs: list[float] = []
    training.optimizer.register_step_pre_hook(lambda opt, args, kwargs: lrs.append(opt.param_groups[0]["lr"]))
    return lrs


def test_warmup_raises_the_lr_linearly_and_leaves_the_schedule_alone(pre: Path) -> None:
    split, val = load_split(pre, "train"), load_split(pre, "val")
    rows = {}
    for warmup in (0, 4):
        start(42, 1)
        cfg = TrainConfig(**{**PLAIN, "scheduler": "cosine"}, epochs=2, max_batches=3, lr=0.1, warmup_steps=warmup)
        training = build_training(cfg, 42, split, torch.device("cpu"))
        lrs = _lrs_at_each_step(training)
        rows[warmup] = [training.epoch(epoch, val)["lr"] for epoch in (1, 2)]
        if warmup:
            cosine_epoch_2 = rows[0][0]
            expected = [0.1 / 4, 0.1 * 2 / 4, 0.1 * 3 / 4, cosine_epoch_2 * 4 / 4, cosine_epoch_2, cosine_epoch_2]
            assert lrs == pytest.approx(expected, rel=1e-12)
    assert rows[4] == rows[0]  # the epoch schedule is the one a run without warm-up follows
    assert [warmup_factor(step, 3) for step in (1, 2, 3, 4)] == pytest.approx([1 / 3, 2 / 3, 1, 1])


def test_accumulated_batches_step_once_and_equal_one_big_batch(pre: Path) -> None:
    split = load_split(pre, "train")

    def linear() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))  # no BatchNorm: its statistics follow the batch

    weights = {}
    for batch, accumulate in ((64, 1), (32, 2)):  # the same 384 images in 6 steps
        batches = 6 * accumulate
        cfg = TrainConfig(
            **PLAIN, optimizer="adamw", epochs=1, batch_size=batch, max_batches=batches, accumulate_steps=accumulate
        )
        training = build_training(cfg, 42, split, torch.device("cpu"), model=linear())
        lrs = _lrs_at_each_step(training)
        training.train_epoch(1)
        weights[accumulate] = cpu_state(training.model)
        assert len(lrs) == 6  # optimiser steps
    for name, tensor in weights[1].items():
        torch.testing.assert_close(weights[2][name], tensor, rtol=0, atol=1e-6)
    # 5 batches in threes: a step after 3, and one for the last 2 (an epoch's rest is not carried over)
    cfg = TrainConfig(**PLAIN, epochs=1, max_batches=5, accumulate_steps=3)
    training = build_training(cfg, 42, split, torch.device("cpu"), model=linear())
    lrs = _lrs_at_each_step(training)
    training.train_epoch(1)
    assert len(lrs) == 2 and training.steps_per_epoch == 2


def test_clipping_bounds_the_update(pre: Path) -> None:
    split = load_split(pre, "train")
    start(42, 1)
    cfg = TrainConfig(**PLAIN, epochs=1, max_batches=1, lr=1.0, weight_decay=0.0, grad_clip_norm=1e-3)
    training = build_training(cfg, 42, split, torch.device("cpu"))
    before = torch.cat([p.detach().clone().flatten() for p in training.model.parameters()])
    training.train_epoch(1)
    after = torch.cat([p.detach().flatten() for p in training.model.parameters()])
    assert 0 < torch.linalg.vector_norm(after - before) <= 1e-3 * (1 + 1e-5)


@pytest.mark.skipif(
    cpu_mode.resolve("auto") != "portable", reason="portable mode only: native bytes follow the threads"
)
def test_the_clipping_norm_is_the_same_bits_on_any_thread_count() -> None:
    """Clipping's global norm reduces millions of numbers; portable mode promises bytes whatever the count
    of threads (ATen's plain `sum` would not keep it: it splits a long reduction per thread)."""
    torch.manual_seed(0)
    grads = [torch.randn_like(p) * torch.rand(()) for p in torchvision.models.resnet18().parameters()]
    before = torch.get_num_threads()
    try:
        norms = set()
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            norms.add(nn.utils.get_total_norm(grads).item())
    finally:
        torch.set_num_threads(before)
    assert len(norms) == 1, norms


def test_the_ema_is_what_is_validated_and_kept(pre: Path) -> None:
    split, val = load_split(pre, "train"), load_split(pre, "val")
    start(42, 1)
    decay = 0.8
    training = build_training(
        TrainConfig(**PLAIN, epochs=1, max_batches=4, ema_decay=decay), 42, split, torch.device("cpu")
    )
    expected: dict[str, torch.Tensor] = {}

    def fold() -> None:  # after each optimiser step: e = w at the first, then e = d e + (1 - d) w
        for name, value in training.model.state_dict().items():
            if value.is_floating_point():
                old = expected.get(name)
                expected[name] = value.clone() if old is None else decay * old + (1 - decay) * value

    training.on_batch = fold
    training.epoch(1, val)
    kept = training.progress.best_state
    for name, value in expected.items():
        torch.testing.assert_close(kept[name], value, rtol=1e-5, atol=1e-6)
    raw = cpu_state(training.model)
    assert any(not torch.equal(raw[name], kept[name]) for name in expected)


def test_the_balanced_sampler_evens_out_classes_and_is_seeded() -> None:
    labels = np.array([0] * 1800 + [1] * 200)
    sampler = BalancedSampler(labels, num_replicas=1, rank=0, seed=7)
    sampler.set_epoch(1)
    first = list(sampler)
    assert len(first) == 2000 and abs(np.mean(labels[first]) - 0.5) < 0.05
    assert list(sampler) == first  # a function of (seed, epoch)
    sampler.set_epoch(2)
    assert list(sampler) != first
    ranks = [BalancedSampler(labels, num_replicas=2, rank=r, seed=7) for r in (0, 1)]
    for rank in ranks:
        rank.set_epoch(1)
    shards = [list(rank) for rank in ranks]
    assert [len(shard) for shard in shards] == [1000, 1000] and shards[0] != shards[1]


def test_balanced_loss_weights_are_inverse_frequencies(pre: Path) -> None:
    assert class_weights(np.array([0] * 90 + [1] * 10), 3).tolist() == pytest.approx([100 / 180, 100 / 20, 0.0])
    assert class_weights(np.array([0, 1, 2, 0, 1, 2]), 3).tolist() == [1.0, 1.0, 1.0]
    split = load_split(pre, "train")
    training = build_training(TrainConfig(**PLAIN, epochs=1, class_balance="loss"), 42, split, torch.device("cpu"))
    assert torch.equal(training.criterion.weight, class_weights(split.labels, len(split.classes)))
    assert build_training(TrainConfig(**PLAIN, epochs=1), 42, split, torch.device("cpu")).criterion.weight is None


@pytest.mark.parametrize("preset", ["affine", "elastic", "trivialaugment", "randaugment", "resized_crop"])
def test_a_preset_changes_each_image_seeded_by_the_batch(preset: str, pre: Path) -> None:
    split = load_split(pre, "train")
    batches = augmented_batches(split, TrainConfig(augment=preset, hflip=False), seed=1)
    indices = list(range(16))
    plain, _ = AugmentedBatches(split, 0, False, seed=1).__getitems__(indices)
    rng = torch.get_rng_state()
    out, _ = batches.__getitems__(indices)
    assert torch.equal(torch.get_rng_state(), rng)  # nobody else's random stream moved
    assert out.dtype == torch.uint8 and out.shape == plain.shape
    assert sum(not torch.equal(a, b) for a, b in zip(out, plain, strict=True)) >= 8  # a draw per image
    assert torch.equal(batches.__getitems__(indices)[0], out)  # a function of (seed, indices)
    assert not torch.equal(batches.__getitems__(indices[1:] + indices[:1])[0], out)


def _elastic_shift_px(side: int) -> float:
    """The mean displacement, in pixels, of `elastic`'s field on a side x side image (20 draws)."""
    elastic = augmented_batches(_blank_split(side), TrainConfig(augment="elastic"), seed=1).policy
    noise = torch.rand(20, 2, side, side, generator=torch.Generator().manual_seed(0)) * 2 - 1
    return float((elastic.displacement(noise) * side / 2).abs().mean())  # from [-1, 1] grid units


def _blank_split(side: int) -> Preprocessed:
    return Preprocessed(np.zeros((2, 1, side, side), np.uint8), np.arange(2), ["a", "b"], [0.5], [0.25])


def test_the_elastic_field_is_smaller_in_proportion_on_small_images() -> None:
    """Simard et al.'s field in pixels from 28 px up; below, the same share of the image's side (an
    8 px digit moved by 0.7 px on average would be moved by a tenth of itself)."""
    at = {side: _elastic_shift_px(side) for side in (8, 14, ELASTIC_AT_PX, 64)}
    assert 0.5 < at[ELASTIC_AT_PX] < 0.9, at  # what torchvision's alpha 34, sigma 4 draws
    for side in (8, 14):
        assert at[side] / side == pytest.approx(at[ELASTIC_AT_PX] / ELASTIC_AT_PX, rel=0.25), at
    assert at[64] == pytest.approx(at[ELASTIC_AT_PX], rel=0.25), at  # not larger above: the blur's cost


def _torchvisions(preset: str, ours: AffineWarp) -> Callable[[torch.Tensor], torch.Tensor]:
    """What `ours` stands for: the v2 transforms of one image."""
    from torchvision.transforms import v2

    affine = v2.RandomAffine(degrees=ours.degrees, scale=ours.scale, shear=ours.shear)
    return affine if preset == "affine" else v2.Compose([affine, v2.ElasticTransform(ours.alpha, ours.sigma)])


@pytest.mark.parametrize(
    ("preset", "side", "channels"),
    [("affine", 32, 3), ("affine", 64, 3), ("elastic", 8, 1), ("elastic", 28, 3), ("elastic", 64, 1)],
)
def test_a_warp_is_torchvisions_transform_applied_to_the_batch(preset: str, side: int, channels: int) -> None:
    """The batch as v2's RandomAffine (then ElasticTransform) makes it image by image from the same
    generator: the same draws (the generator ends where v2's does), the same resampling (at 64 px in
    two calls of the kernel). Only the elastic field's blur rounds differently (separable), which moves
    a rare pixel by one grey level."""
    ours = augmented_batches(_blank_split(side), TrainConfig(augment=preset), seed=1).policy
    theirs = _torchvisions(preset, ours)
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (24, channels, side, side), dtype=torch.uint8, generator=generator)
    images[:, :, : side // 4] = 0  # an edge of black, as around a digit
    with torch.random.fork_rng():
        torch.manual_seed(3)
        warped = ours(images)
        after_ours = torch.get_rng_state()
        torch.manual_seed(3)
        expected = torch.stack([theirs(image) for image in images])
        assert torch.equal(torch.get_rng_state(), after_ours)
    assert warped.dtype == torch.uint8 and warped.shape == images.shape
    if preset == "affine":
        assert torch.equal(warped, expected)
    else:
        assert (warped.int() - expected.int()).abs().max() <= 1
        assert (warped != expected).float().mean() < 1e-3
    assert (warped != images).float().mean() > 0.5  # moved


@pytest.mark.parametrize("side", [8, 20, ELASTIC_AT_PX, 64])
def test_the_separable_blur_is_torchvisions_gaussian_blur(side: int) -> None:
    """Two 1-D passes instead of one 2-D one: torchvision's blurred field to float rounding."""
    from torchvision.transforms.v2 import functional as tvf

    elastic = augmented_batches(_blank_split(side), TrainConfig(augment="elastic"), seed=1).policy
    noise = torch.rand(3, 2, side, side, generator=torch.Generator().manual_seed(3)) * 2 - 1
    taps = int(8 * elastic.sigma + 1) | 1
    expected = tvf.gaussian_blur(noise.reshape(6, 1, side, side), [taps, taps], [elastic.sigma] * 2)
    blurred = blurred_noise(noise, elastic.sigma)
    torch.testing.assert_close(blurred, expected.reshape(3, 2, side, side), rtol=0, atol=1e-6)
    assert blurred.abs().max() > 1e-3  # a field, not nothing


def test_a_forkserver_worker_gets_the_policy_pickled() -> None:
    for preset in ("affine", "elastic"):
        batches = augmented_batches(_blank_split(20), TrainConfig(augment=preset), seed=1)
        batches.images[1] = 200  # something to move
        sent = pickle.loads(pickle.dumps(batches))
        assert torch.equal(sent.__getitems__([0, 1])[0], batches.__getitems__([0, 1])[0])


def test_the_default_presets_draw_no_policy(pre: Path) -> None:
    split = load_split(pre, "train")
    assert augmented_batches(split, TrainConfig(augment="shift_flip", hflip=True), 1).policy is None
    none = augmented_batches(split, TrainConfig(augment="none", hflip=True), 1)
    assert (none.policy, none.max_shift, none.hflip) == (None, 0, False)


@pytest.mark.parametrize(
    "mix", [{"mixup_alpha": 0.4}, {"cutmix_alpha": 1.0}, {"mixup_alpha": 0.4, "cutmix_alpha": 1.0}]
)
def test_mixup_and_cutmix_mix_images_and_targets(mix: dict[str, float]) -> None:
    x, y = torch.rand(8, 3, 16, 16), torch.arange(8) % 4
    mixing = BatchMixing(TrainConfig(**mix), 4, seed=1, rank=0)
    rng = torch.get_rng_state()
    mixed, target = mixing(x, y, epoch=1, step=1)
    assert torch.equal(torch.get_rng_state(), rng)
    assert target.shape == (8, 4) and torch.allclose(target.sum(1), torch.ones(8))
    assert not torch.equal(mixed, x) and target.max() < 1  # every image is part another one
    again, target_again = mixing(x, y, epoch=1, step=1)
    assert torch.equal(again, mixed) and torch.equal(target_again, target)
    assert not torch.equal(BatchMixing(TrainConfig(**mix), 4, seed=1, rank=1)(x, y, 1, 1)[1], target)
    unmixed = BatchMixing(TrainConfig(), 4, 1, 0)(x, y, 1, 1)
    assert unmixed[0] is x and unmixed[1] is y


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"warmup_epochs": 1, "warmup_steps": 10}, "warmup_epochs and warmup_steps: give one"),
        ({"augment": "autoaugment"}, "train.augment"),
        ({"monitor": "train_loss"}, "train.monitor"),
        ({"ema_decay": 1.0}, "train.ema_decay"),
        ({"accumulate_steps": 0}, "train.accumulate_steps"),
    ],
)
def test_bad_recipe_values_name_the_key(tmp_path: Path, train: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_params(write_params(tmp_path / "params.yaml", {"train": train}))
