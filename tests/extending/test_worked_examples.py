"""docs/extending.md, done: each extension point gets one new entry, made here at run time as a user makes
it in the code (the registry's entry, its implementation under the same name), and the entry goes through
the real stages it affects, in this process, on a tiny dataset:

    data source "shapes"        params.yaml validation, its recipe for `auto`, download, stats, preprocess
    model "tiny_cnn"            the train stage (`auto` resolves to it), a checkpoint evaluate rebuilds
    augmentation "vflip"        the batches the train stage fetches, and the training run on them
    compression "pruned_90"     the compress stage's table, then export ships it through its gates
    export format "pt2_fixed"   the export stage writes it, reads it back for its parity gate, hashes it
    notification "teams"        params.yaml validation, a message posted to a webhook

The chain of stages is made once for the module (`project`): tens of images, three epochs, one variant.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from flows import notify
from tasks.core.config.data import SOURCES, DataConfig, DataSource, SourceRecipe, SplitConfig
from tasks.core.config.service import NOTIFY_FORMATS, NotifyConfig, NotifyFormat
from tasks.core.config.ship import (
    COMPRESSION_VARIANTS,
    EXPORT_FORMATS,
    CompressConfig,
    CompressionVariant,
    ExportConfig,
    ExportFormat,
)
from tasks.core.config.train import AUGMENT_PRESETS, MODELS, AugmentPreset, EvaluateConfig, OwnModel, TrainConfig
from tasks.core.config.yaml_io import load_params
from tasks.data.download import LOADERS, Context, download, in_memory
from tasks.data.formats import RawDataset
from tasks.data.preprocess import load_split, preprocess
from tasks.data.stats import compute_stats
from tasks.determinism.pinning import pin_everything
from tasks.ship import prune
from tasks.ship.compress import BUILDERS, Build, compress
from tasks.ship.export import CardContext, export
from tasks.ship.formats import WRITERS, Writer
from tasks.ship.onnx_model import export_onnx
from tasks.train.augment import POLICIES, augmented_batches
from tasks.train.checkpoints import load_checkpoint
from tasks.train.evaluate import evaluate
from tasks.train.models import ARCHITECTURES
from tasks.train.stage import train
from tests.conftest import write_params
from tests.support.webhook import WebhookReceiver

pytestmark = pytest.mark.slow  # the real stages, in-process (about 20 CPU-seconds, torch's imports included)

SEED, THREADS = 42, 1
SIDE, CLASSES, PER_CLASS = 12, ("bar", "cross", "frame"), 40


# ----------------------------------------------------------------------------- the six new entries


@in_memory
def _shapes(ctx: Context) -> RawDataset:
    """The new source's loader: 12x12 greyscale bars, crosses and frames under seeded noise."""
    rng = np.random.default_rng(0)
    templates = np.zeros((len(CLASSES), SIDE, SIDE), dtype=np.int64)
    templates[0, :, 5:7] = 200
    templates[1, 5:7, :] = templates[1, :, 5:7] = 200
    templates[2, [1, -2], 1:-1] = templates[2, 1:-1, [1, -2]] = 200
    labels = np.repeat(np.arange(len(CLASSES)), PER_CLASS)
    images = templates[labels] + rng.integers(0, 56, (len(labels), SIDE, SIDE))
    return RawDataset(images.astype(np.uint8)[..., None], labels, list(CLASSES), ctx.cfg.source)


class TinyCNN(nn.Module):
    """The new model: takes (in_channels, num_classes) like ours; any image size (global pooling first)."""

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(8 * 16, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class VerticalFlip:
    """The new preset's batch policy: each image upside down with probability 1/2, drawn from torch's
    generator (which the batch's seed sets). A class: the loader's workers get it pickled."""

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        flip = torch.rand(len(images)) < 0.5
        return torch.where(flip[:, None, None, None], images.flip(-2), images)


def _pruned_90(job: Build) -> None:
    """The new variant: 90% of the weights pruned (prune.py's mechanism), no fine-tuning."""
    model = copy.deepcopy(job.model)  # the stage's model: the other variants start from it too
    prune.global_l1(model, 0.9)
    prune.make_permanent(model)
    export_onnx(model.eval(), job.example, job.out)


def _save_pt2_fixed(model: nn.Module, parity: torch.Tensor, path: Path) -> None:
    """The new format: a torch.export program for the parity batch's size only (no dynamic batch axis)."""
    torch.export.save(torch.export.export(model, (parity,)), path)


def _load_pt2(path: Path) -> nn.Module:
    return torch.export.load(path).module()


def _teams(event: notify.Event) -> dict[str, Any]:
    """The new notification format: a Microsoft Teams message card."""
    return {"@type": "MessageCard", "summary": f"{event.flow}: {event.event}", "text": event.text()}


@dataclass(frozen=True)
class Project:
    data: Path
    pre: Path
    train: Path  # the train stage's outputs (tiny_cnn with vflip)
    compress: Path
    evaluate: Path


@pytest.fixture(scope="module")
def registered() -> Iterator[None]:
    """The six entries, each as docs/extending.md adds it: the registry's entry, then its implementation
    (through `register`, as the implementing module does); taken out again after the module."""
    with pytest.MonkeyPatch.context() as patch:
        entries = [
            (SOURCES, LOADERS, "shapes", _shapes,
             DataSource("bars, crosses and frames", "nothing", SourceRecipe(model="tiny_cnn", epochs=3, hflip=False,
                                                                             augment="vflip"))),
            (MODELS, ARCHITECTURES, "tiny_cnn", TinyCNN, OwnModel("a conv, pooling to 4x4 and a linear head")),
            (AUGMENT_PRESETS, POLICIES, "vflip", lambda size: VerticalFlip(),
             AugmentPreset("upside down, half the images", shifts=False, mirrors=False)),
            (COMPRESSION_VARIANTS, BUILDERS, "pruned_90", _pruned_90, CompressionVariant("90% pruned, not fine-tuned")),
            (EXPORT_FORMATS, WRITERS, "pt2_fixed", Writer(_save_pt2_fixed, _load_pt2),
             ExportFormat("torch.export, fixed batch", "torch/model_fixed.pt2", ".pt2 (fixed batch)")),
            (NOTIFY_FORMATS, notify.PAYLOADS, "teams", _teams, NotifyFormat("a Teams message card")),
        ]  # fmt: skip
        for registry, implementations, name, implementation, entry in entries:
            patch.setitem(registry, name, entry)  # 1. the entry
            patch.setitem(implementations, name, implementation)  # (only so that the undo takes it out)
            implementations.register(name)(implementation)  # 2. its implementation, as its module registers it
            assert not implementations.missing()
        yield


@pytest.fixture(scope="module")
def project(registered: None, tmp_path_factory: pytest.TempPathFactory) -> Project:
    """The new source downloaded and preprocessed; the new model trained on it with the new preset,
    evaluated, and compressed into the new variant: the stage functions, as tasks/runner.py calls them."""
    work = tmp_path_factory.mktemp("extending")
    pin_everything(SEED, THREADS)
    download(DataConfig(source="shapes"), work / "data", work / "cache")
    stats = compute_stats(work / "data", SplitConfig(), SEED, 4096)
    preprocess(work / "data", stats, SplitConfig(), SEED, work / "pre")
    cfg = TrainConfig(model="auto", epochs="auto", hflip="auto", augment="auto", num_workers=0).for_source("shapes")
    train(cfg, SEED, work / "pre", work / "train")
    evaluate(EvaluateConfig(), work / "train" / "best.safetensors", work / "pre", work / "evaluate")
    variants = {"variants": ("pruned_90",), "latency_runs": 20, "latency_warmup": 1}
    best = work / "train" / "best.safetensors"
    compress(CompressConfig(**variants), cfg, SEED, THREADS, best, work / "pre", work / "compress")
    return Project(work / "data", work / "pre", work / "train", work / "compress", work / "evaluate")


# ----------------------------------------------------------------------------- the stages they went through


def test_a_new_data_source_is_a_params_value_with_its_recipe_and_downloads(
    registered: None, project: Project, tmp_path: Path
) -> None:
    params = load_params(write_params(tmp_path / "params.yaml", {"data": {"source": "shapes"}}))
    assert (params.train.model, params.train.epochs, params.train.augment) == ("tiny_cnn", 3, "vflip")
    with pytest.raises(ValueError, match="only for source 'imagefolder'"):
        DataConfig(source="shapes", path="folder")  # the folder options stay the image folder's
    meta = json.loads((project.pre / "meta.json").read_text())
    assert meta["classes"] == list(CLASSES) and sum(meta["split_sizes"].values()) == len(CLASSES) * PER_CLASS


def test_a_new_model_trains_and_its_checkpoint_reloads(project: Project) -> None:
    model, meta = load_checkpoint(project.train / "best.safetensors")
    assert meta["model"] == "tiny_cnn" and isinstance(model.net, TinyCNN)
    metrics = json.loads((project.evaluate / "metrics.json").read_text())  # evaluate rebuilt it by name
    assert metrics["accuracy"] > 1 / len(CLASSES)  # it learnt something in 3 epochs


def test_a_new_augmentation_preset_changes_what_training_fetches(project: Project) -> None:
    split = load_split(project.pre, "train")
    batches = augmented_batches(split, TrainConfig(augment="vflip", hflip=True), SEED)
    rows = list(range(20))
    images, _ = batches.__getitems__(rows)
    plain = torch.from_numpy(split.images[rows])
    flipped = [not torch.equal(image, original) for image, original in zip(images, plain, strict=True)]
    assert 0 < sum(flipped) < len(rows)  # some, not all: the policy drew, and no shift or mirror moved the rest
    assert all(torch.equal(images[i], plain[i].flip(-2)) for i in range(len(rows)) if flipped[i])
    assert torch.equal(batches.__getitems__(rows)[0], images)  # the batch's seed fixes the draws
    assert load_checkpoint(project.train / "best.safetensors")[1]["config"]["augment"] == "vflip"  # trained so


def test_a_new_compression_variant_is_built_measured_and_ships(project: Project, tmp_path: Path) -> None:
    rows = json.loads((project.compress / "metrics.json").read_text())
    assert list(rows) == ["fp32", "pruned_90"] and rows["pruned_90"]["sparsity"] > 0.85
    cfg = ExportConfig(candidates=("pruned_90", "fp32"), formats=("onnx",), min_top1_agreement=0, max_accuracy_drop=1)
    result = _export(project, cfg, tmp_path)
    assert result.variant == "pruned_90"


def test_a_new_export_format_is_written_gated_and_hashed(project: Project, tmp_path: Path) -> None:
    cfg = ExportConfig(candidates=("fp32",), formats=("onnx", "pt2_fixed"))
    result = _export(project, cfg, tmp_path)
    assert "torch/model_fixed.pt2" in result.sha256
    assert [gate.name for gate in result.gates] == [
        "fp32 ONNX vs eager max |logit diff|",
        ".pt2 (fixed batch) vs eager max |logit diff|",
    ]
    assert all(gate.passed for gate in result.gates)


def test_a_new_notification_format_is_a_params_value_and_posts_its_json(registered: None, tmp_path: Path) -> None:
    params = load_params(write_params(tmp_path / "params.yaml", {"orchestration": {"notify": {"format": "teams"}}}))
    assert params.orchestration.notify.format == "teams"
    message = notify.Event("failed", "lockstep-pipeline", "run-1", "id-1", None, "Failed", "train", "boom")
    with WebhookReceiver() as receiver:
        env = {"LOCKSTEP_NOTIFY_URL": receiver.url()}
        assert notify.send(message, NotifyConfig(format="teams"), logging.getLogger(__name__), env)
        [posted] = receiver.wait_for(1)
    assert posted["@type"] == "MessageCard" and "stage: train" in posted["text"]


def _export(project: Project, cfg: ExportConfig, tmp_path: Path) -> Any:
    return export(
        cfg,
        THREADS,
        project.train / "best.safetensors",
        project.pre,
        project.compress,
        project.evaluate / "metrics.json",
        tmp_path / "export",
        CardContext(data_md5="worked example", params={"seed": SEED}),
    )
