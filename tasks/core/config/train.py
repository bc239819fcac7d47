"""The training sections: `determinism`, `train` and `evaluate`, with two registries (tasks/core/registry.py):
`MODELS`, the architectures of our own that `train.model` names (tasks/train/models.py builds them), and
`AUGMENT_PRESETS`, what `train.augment` names (tasks/train/augment.py draws them). The per-source recipes
`auto` resolves to are the data sources' (tasks/core/config/data.py `SOURCES`)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from tasks.core.config.base import (
    MAX_BATCH,
    MAX_EPOCHS,
    MAX_LR,
    MAX_NODES,
    MAX_PROCESSES,
    MAX_STEPS,
    Auto,
    Section,
    Url,
    is_loopback,
)
from tasks.core.config.data import SOURCES
from tasks.core.registry import Registry


class DeterminismConfig(Section):
    # auto: the cores this process is given, shared among a sweep's workers or a node's DDP ranks
    # (tasks/determinism/threads.py)
    num_threads: Annotated[int, Field(ge=1, le=1024)] | Auto = "auto"
    strict: bool = True
    # auto: portable where the CPU supports it (x86-64 with AVX2 and FMA), native elsewhere
    cpu: Literal["auto", "portable", "native"] = "auto"


# torchvision's classification builders (`torchvision.models.list_models(module=torchvision.models)`,
# torchvision 0.29): written out because importing torchvision to ask costs 3-6 s in every process that
# reads params.yaml. tests/train/test_zoo.py holds the list to the installed torchvision; tasks/train/models.py asks
# torchvision again when it builds (an older torchvision, e.g. on a GPU box, may lack a name). The names
# live here rather than beside the models: params.yaml is validated before torch loads, and tasks/core
# imports nothing from the packages above it.
TORCHVISION_MODELS = frozenset(
    """
    alexnet convnext_base convnext_large convnext_small convnext_tiny densenet121 densenet161 densenet169
    densenet201 efficientnet_b0 efficientnet_b1 efficientnet_b2 efficientnet_b3 efficientnet_b4 efficientnet_b5
    efficientnet_b6 efficientnet_b7 efficientnet_v2_l efficientnet_v2_m efficientnet_v2_s googlenet inception_v3
    maxvit_t mnasnet0_5 mnasnet0_75 mnasnet1_0 mnasnet1_3 mobilenet_v2 mobilenet_v3_large mobilenet_v3_small
    regnet_x_16gf regnet_x_1_6gf regnet_x_32gf regnet_x_3_2gf regnet_x_400mf regnet_x_800mf regnet_x_8gf
    regnet_y_128gf regnet_y_16gf regnet_y_1_6gf regnet_y_32gf regnet_y_3_2gf regnet_y_400mf regnet_y_800mf
    regnet_y_8gf resnet101 resnet152 resnet18 resnet34 resnet50 resnext101_32x8d resnext101_64x4d resnext50_32x4d
    shufflenet_v2_x0_5 shufflenet_v2_x1_0 shufflenet_v2_x1_5 shufflenet_v2_x2_0 squeezenet1_0 squeezenet1_1 swin_b
    swin_s swin_t swin_v2_b swin_v2_s swin_v2_t vgg11 vgg11_bn vgg13 vgg13_bn vgg16 vgg16_bn vgg19 vgg19_bn vit_b_16
    vit_b_32 vit_h_14 vit_l_16 vit_l_32 wide_resnet101_2 wide_resnet50_2
    """.split()
)
# bytes; the largest torchvision classifier (regnet_y_128gf) is ~2.6 GB in fp32. The file is read into memory
# (hashed, then parsed, from the same bytes), so the bound is one a machine can hold, not 1 TiB.
MAX_WEIGHTS_FILE = 8 << 30


@dataclass(frozen=True)
class OwnModel:
    """An architecture of ours (tasks/train/models.py registers its class under the same name)."""

    summary: str  # one line for the docs' table


# `train.model`: ours, beside every name in TORCHVISION_MODELS. Ours are not probed for portable mode
# (tasks/train/models.py `refuse_unportable`): their ops are fixed and tests/determinism/ trains them.
MODELS: Registry[OwnModel] = Registry(
    "train.model",
    {
        "resnet9": OwnModel("the fast CIFAR-10 ResNet-9 at a quarter of its width: ~0.5M parameters, 8-32 px images"),
        "small_cnn": OwnModel("three conv blocks and global pooling: ~0.1M parameters, for 8x8..32x32 images"),
    },
)


@dataclass(frozen=True)
class AugmentPreset:
    """A `train.augment` value (tasks/train/augment.py registers its batch policy under the same name)."""

    summary: str  # what happens to each training image, for the docs' table
    shifts: bool  # `random_shift` applies (a random translation, while the batch is fetched)
    mirrors: bool = True  # `hflip` applies (a random mirror, after the shift)


AUGMENT_PRESETS: Registry[AugmentPreset] = Registry(
    "train.augment",
    {
        "shift_flip": AugmentPreset("random shift by up to `random_shift` px, mirrored when `hflip`", shifts=True),
        "affine": AugmentPreset(
            "shift and mirror, then a random affine map (as torchvision's `RandomAffine`): rotated up to 10°, "
            "scaled 0.9-1.1, sheared up to 10°",
            shifts=True,
        ),
        "elastic": AugmentPreset(
            "`affine`, then an elastic displacement (as torchvision's `ElasticTransform`, alpha 34, sigma 4: "
            "Simard et al.'s distortion for handwriting)",
            shifts=True,
        ),
        "none": AugmentPreset("nothing (`random_shift` and `hflip` are ignored)", shifts=False, mirrors=False),
        "trivialaugment": AugmentPreset("shift and mirror, then torchvision's `TrivialAugmentWide`", shifts=True),
        "randaugment": AugmentPreset("shift and mirror, then torchvision's `RandAugment`", shifts=True),
        "resized_crop": AugmentPreset(
            "`RandomResizedCrop` to the image size (area 25-100%), mirrored when `hflip`: for photos", shifts=False
        ),
    },
)
AugmentName = AUGMENT_PRESETS.named("auto")
# The train keys whose `auto` a data source's recipe decides (tasks/core/config/data.py SourceRecipe):
# resolved by `for_source`, or, what the recipe leaves to the data, by the train stage.
SOURCE_AUTO_KEYS = (
    "model",
    "epochs",
    "lr",
    "hflip",
    "augment",
    "early_stop_patience",
    "class_balance",
    "label_smoothing",
    "keep",
)


class TrainConfig(Section):
    # one of MODELS (ours: resnet9, small_cnn), or any of TORCHVISION_MODELS: adapted to the data's channels and
    # classes, with a stride-1 stem for images under 64 px (tasks/train/models.py). auto (model, epochs, lr, hflip,
    # augment, early_stop_patience, class_balance, label_smoothing, keep): the source's recipe, resolved by Params
    # (params.yaml says auto, and a params file that leaves them out gets auto: FILE_DEFAULTS in params.py), but for
    # what an image folder's recipe leaves to its data: the train stage chooses that (tasks/train/auto.py). A
    # TrainConfig made alone gets the defaults below, or resolves with `for_source`.
    model: str = Field("resnet9", max_length=64)
    epochs: Annotated[int, Field(ge=1, le=MAX_EPOCHS)] | Auto = 30
    batch_size: int = Field(64, ge=1, le=MAX_BATCH)
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: Annotated[float, Field(gt=0, le=MAX_LR)] | Auto = 0.05  # auto: the source's recipe (a folder's: image size)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0, le=1)
    scheduler: Literal["cosine", "step", "none"] = "cosine"
    step_size: int = Field(10, ge=1, le=MAX_EPOCHS)
    gamma: float = Field(0.1, gt=0, le=1)
    label_smoothing: Annotated[float, Field(ge=0, lt=1)] | Auto = 0.0
    # augmentation: a random translation by up to N pixels (auto: an eighth of the shorter image side,
    # at least 1: 1 px on 8x8 digits, 4 px on 28-32 px images, as the CIFAR baselines pad and crop)
    random_shift: Annotated[int, Field(ge=0, le=64)] | Auto = "auto"
    hflip: bool | Auto = False  # a random horizontal mirror, half the images (auto: the source's recipe)
    num_workers: int = Field(0, ge=0, le=256)
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d{1,3})?)$")
    max_batches: int | None = Field(None, ge=1, le=MAX_STEPS)
    # Distributed data parallel: the train stage launches torchrun itself (tasks/train/launcher.py).
    strategy: Literal["single", "ddp"] = "single"
    nproc_per_node: int = Field(2, ge=1, le=MAX_PROCESSES)  # processes per machine (GPUs per node; CPU: gloo ranks)
    nnodes: int = Field(1, ge=1, le=MAX_NODES)  # machines; > 1 uses c10d rendezvous at rdzv_endpoint
    rdzv_endpoint: str = Field("127.0.0.1:29500", max_length=255, pattern=r"^[^\s:]+:\d{1,5}$")
    max_restarts: int = Field(0, ge=0, le=100)  # torchrun restarts all ranks on failure; they resume
    checkpoint_every: int = Field(1, ge=1, le=MAX_EPOCHS)  # epochs between resumable checkpoints
    amp: Literal["none", "bf16", "fp16"] = "none"  # mixed precision (fp16: CUDA only, with GradScaler)
    sync_batchnorm: bool = False  # under ddp: BatchNorm statistics over the global batch
    # Fine-tuning (tasks/train/pretrained.py): weights from a local file or a URL, verified against their sha256
    # before a byte is parsed; safetensors, or a torch state dict that loads with weights_only=True.
    # Or torchvision's published weights of train.model by name (IMAGENET1K_V1, DEFAULT, ...): the URL and the
    # sha256 prefix torchvision publishes in the file name are torchvision's; fetched into the download cache
    # (from pretrained_mirror/<file name> when set), or read from pretrained_path on an offline machine.
    # That prefix is 8 hex digits, 32 bits: a file from a mirror or a path needs the full pretrained_sha256
    # (`_pretrained_is_verified`). Weights never come over plain http but from loopback (`_no_plain_http`).
    pretrained: str | None = Field(None, pattern=r"^[A-Z][A-Z0-9_]{0,63}$")
    pretrained_mirror: Url | None = None  # credentials: env or ~/.netrc, as for data.mirror
    pretrained_path: str | None = Field(None, min_length=1, max_length=4096)
    pretrained_url: Url | None = None  # credentials: env or ~/.netrc, as for data.url
    pretrained_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    pretrained_max_bytes: int = Field(4 << 30, ge=1, le=MAX_WEIGHTS_FILE)  # the weights file, downloaded or read
    freeze_backbone_epochs: int = Field(0, ge=0, le=MAX_EPOCHS)  # epochs 1..N train the head alone
    head_lr: float | None = Field(None, gt=0, le=MAX_LR)  # the head's peak learning rate (null: lr)
    # The seed of the model's initialisation, the batch order and the augmentation; null: the top-level
    # seed. A sweep trial trains with its own (tasks/tools/sweep/trials.py) on the data the top-level seed split.
    seed: int | None = Field(None, ge=0, lt=2**32)
    # The training recipe (tasks/train/recipe.py, tasks/train/augment.py, tasks/train/batches.py): every
    # option off by default, each a function of (seed, epoch, step), so deterministic and resumable.
    monitor: Literal["val_accuracy", "val_loss"] = "val_accuracy"  # picks best.safetensors; early stopping watches it
    # The epoch whose weights best.safetensors holds (evaluated, compressed, shipped): the best by `monitor`, or
    # the last (a validation split of a few dozen images picks its best epoch by luck); auto: the source's
    # recipe (best), an image folder's from the size of its validation split (tasks/train/auto.py)
    keep: Literal["best", "last", "auto"] = "best"
    # epochs without improvement; null: never; auto: the source's recipe (an image folder's: from the data)
    early_stop_patience: Annotated[int, Field(ge=1, le=MAX_EPOCHS)] | None | Auto = None
    early_stop_min_delta: float = Field(0.0, ge=0, le=1e6)  # a smaller change of `monitor` is no improvement
    warmup_epochs: int = Field(0, ge=0, le=MAX_EPOCHS)  # the lr rises linearly over the first N epochs' steps
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS)  # ... or over the first N optimiser steps (give one)
    grad_clip_norm: float | None = Field(None, gt=0, le=1e6)  # the gradients' global L2 norm, at most
    accumulate_steps: int = Field(1, ge=1, le=MAX_BATCH)  # batches per optimiser step (ddp: synced once per step)
    ema_decay: float | None = Field(None, gt=0, lt=1)  # an exponential moving average of the weights ships
    # inverse-frequency loss weights, or sampling; auto: the source's recipe (an image folder's: from the data)
    class_balance: Literal["none", "loss", "sampler", "auto"] = "none"
    augment: AugmentName = "shift_flip"  # AUGMENT_PRESETS, or auto
    mixup_alpha: float = Field(0.0, ge=0, le=100)  # > 0: mix image pairs (Beta(alpha, alpha) weights)
    cutmix_alpha: float = Field(0.0, ge=0, le=100)  # > 0: paste a patch of another image (both: one per batch)

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        if value == "auto" or value in MODELS or value in TORCHVISION_MODELS:
            return value

        close = difflib.get_close_matches(value, [*MODELS, *sorted(TORCHVISION_MODELS)], n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise ValueError(
            f"unknown model: auto, {', '.join(MODELS)} or a torchvision classification model (resnet18, "
            "mobilenet_v3_small, efficientnet_b0, convnext_tiny, regnet_x_400mf, vit_b_16, ...; "
            f"see TORCHVISION_MODELS in tasks/core/config/train.py){hint}"
        )

    def for_source(self, source: str, channels: int | None = None) -> TrainConfig:
        """This config with `auto` keys replaced by `source`'s recipe (augment's also by the images'
        `channels`, data.channels). What the recipe leaves to the data (FROM_DATA) stays `auto`, for the
        train stage to choose (tasks/train/auto.py)."""
        recipe = SOURCES[source].recipe
        resolved = {key: getattr(recipe, key) for key in SOURCE_AUTO_KEYS} | {"augment": recipe.augment_for(channels)}
        update = {key: value for key, value in resolved.items() if getattr(self, key) == "auto"}
        return self.model_copy(update=update) if update else self

    @model_validator(mode="after")
    def _one_warmup(self) -> TrainConfig:
        if self.warmup_epochs and self.warmup_steps:
            raise ValueError("warmup_epochs and warmup_steps: give one (the other stays 0)")
        return self

    @model_validator(mode="after")
    def _kept_epoch_is_not_the_stop(self) -> TrainConfig:
        if self.keep == "last" and isinstance(self.early_stop_patience, int):
            raise ValueError(
                f"keep: last with early_stop_patience {self.early_stop_patience}: the run would keep whichever "
                "epoch the stop fell on, mid-schedule; give early_stop_patience: null (or keep: best)"
            )
        return self

    @model_validator(mode="after")
    def _no_plain_http(self) -> TrainConfig:
        # Weights are code-adjacent (they decide every prediction), and over http anyone on the path reads
        # the credentials sent with them or swaps the file. Loopback stays allowed: its traffic never leaves
        # the machine (whoever can bind a port there already runs code on it), and a local mirror or a test
        # server (benchmarks/httpserver.py) serves plain http; the full sha256 is still required.
        for key in ("pretrained_mirror", "pretrained_url"):
            url = getattr(self, key)
            if url is not None and url.startswith("http://") and not is_loopback(url):
                raise ValueError(f"{key}: plain http:// for weights: use https:// (or a file:// path)")
        return self

    @model_validator(mode="after")
    def _pretrained_is_verified(self) -> TrainConfig:
        if self.pretrained_path is not None and self.pretrained_url is not None:
            raise ValueError("pretrained_path and pretrained_url: give one (a local file, or a URL to download)")
        if self.pretrained is not None:
            if self.pretrained_url is not None:
                raise ValueError("pretrained and pretrained_url: give one (a torchvision weights name, or a URL)")
            if self.model in MODELS:
                raise ValueError(f"pretrained: {self.model} has no published weights (give pretrained_path)")
            # Straight from torchvision's host over https, the name's 32-bit prefix is what torch.hub checks
            # too (and the whole digest goes into the lineage); a mirror or a file anyone could have made
            # needs the whole 256 bits, kept here, in params.yaml: committed, reviewed, recorded by dvc.lock.
            other = "pretrained_mirror" if self.pretrained_mirror is not None else "pretrained_path"
            if self.pretrained_sha256 is None and getattr(self, other) is not None:
                raise ValueError(
                    f"pretrained_sha256: required with {other}: torchvision's file name pins only 32 bits of "
                    "the sha256, which a forged file can match; give the file's full sha256 (sha256sum FILE)"
                )
            return self  # verified against torchvision's published hash (and pretrained_sha256, if given)
        if self.pretrained_mirror is not None:
            raise ValueError("pretrained_mirror: where the weights pretrained names are fetched from: set pretrained")
        given = self.pretrained_path is not None or self.pretrained_url is not None
        if given and self.pretrained_sha256 is None:
            raise ValueError("pretrained weights need pretrained_sha256: they are verified before they are loaded")
        if not given and self.pretrained_sha256 is not None:
            raise ValueError("pretrained_sha256 without pretrained, pretrained_path or pretrained_url")
        return self


# The recipe options above. A run that leaves one at its default records no key for it (checkpoints,
# resume signature: tasks/train/checkpoints.py), so its files are the bytes of a run from before the
# option existed, and the model card lists only the options a run changed.
RECIPE_KEYS = (
    "monitor",
    "keep",
    "early_stop_patience",
    "early_stop_min_delta",
    "warmup_epochs",
    "warmup_steps",
    "grad_clip_norm",
    "accumulate_steps",
    "ema_decay",
    "class_balance",
    "augment",
    "mixup_alpha",
    "cutmix_alpha",
)


def recipe_changes(cfg: TrainConfig) -> dict[str, object]:
    """The recipe options `cfg` sets away from their defaults."""
    return {k: getattr(cfg, k) for k in RECIPE_KEYS if getattr(cfg, k) != TrainConfig.model_fields[k].default}


class EvaluateConfig(Section):
    batch_size: int = Field(512, ge=1, le=MAX_BATCH)
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d{1,3})?)$")
