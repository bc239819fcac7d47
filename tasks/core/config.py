"""params.yaml parsed once into frozen, typed models.

Nothing downstream of `load_params` sees a raw dict. An unknown key, a wrong type or an impossible
value raises `ConfigError` naming the key; the entry points turn it into exit code 2 before any
file is written.

`STAGE_PARAMS` says which top-level sections each stage reads. dvc.yaml lists exactly these keys
(a test holds the two together) and each stage logs exactly these to MLflow.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PARAMS_FILE = "params.yaml"
MAX_PARAMS_BYTES = 1 << 20


class ConfigError(ValueError):
    """params.yaml is malformed; the message names the file and the key."""


# Upper bounds: every number has one, so that a typo or a hostile run record (tasks/tools/reproduce.py
# rebuilds from params logged on a shared server) is a clear error, not hours of training, a
# process per core times a thousand, or an OverflowError deep in torch.
MAX_EPOCHS = 10_000
MAX_BATCH = 65_536
MAX_STEPS = 10**9
MAX_PROCESSES = 256  # per node (GPUs or CPU ranks)
MAX_NODES = 1024
# Learning rates only need to stay finite: a huge one diverges, and training stops at the first
# non-finite loss (tests/reliability/test_nan_loss.py trains at 1e10 on purpose).
MAX_LR = 1e10


class _Section(BaseModel):
    # strict: a value of the wrong type is an error, not silently converted (`epochs: true` is not 1,
    # `strict: "no"` is not False, `epochs: 2.5` is not 2); ints are still fine where floats are
    # expected, and YAML lists where tuples are (those fields say `strict=False`, their items stay strict).
    # No inf or NaN anywhere: `lr: .inf` would pass `gt=0` and train a model of NaNs.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


Source = Literal["digits", "mnist", "fashion_mnist", "cifar10", "cifar100", "imagefolder"]


class DataConfig(_Section):
    """What the download stage ingests (every source ends up in the same format, tasks/data/formats.py)."""

    source: Source = "digits"
    # Base URL that replaces the published hosts (air-gapped sites): files are fetched from
    # <mirror>/<file name> and still verified against the published checksums.
    # Credentials for mirror and url: LOCKSTEP_DATA_TOKEN / LOCKSTEP_DATA_AUTH or ~/.netrc (tasks/data/fetch.py),
    # not user:pass@ in the URL, which params.yaml and dvc.lock would then record.
    mirror: str | None = Field(None, max_length=2048, pattern=r"^(https?|file)://\S+$")
    retries: int = Field(4, ge=0, le=20)  # extra attempts on connection errors and HTTP 5xx
    timeout_s: float = Field(60.0, gt=0, le=3600)  # per connection attempt / per read
    # Limits against a hostile or broken source: a server that never stops sending (or sends a byte
    # a second), an archive bomb, a decompression-bomb image. A real dataset above one raises it here.
    deadline_s: float = Field(3600.0, gt=0, le=7 * 86400)  # per downloaded file, every retry included
    max_download_bytes: int = Field(4 << 30, ge=1, le=1 << 44)  # per file, counted while it streams
    max_extracted_bytes: int = Field(16 << 30, ge=1, le=1 << 44)  # an archive's content, in total
    max_compression_ratio: float = Field(100.0, ge=1, le=10_000)  # extracted bytes / archive bytes
    max_archive_files: int = Field(1_000_000, ge=1, le=100_000_000)  # members (files, folders) per archive
    # per image, width x height; PIL itself refuses above 2 x 89,478,485 whatever is set here
    max_image_pixels: int = Field(50_000_000, ge=1, le=178_956_970)
    max_dataset_bytes: int = Field(16 << 30, ge=1, le=1 << 44)  # decoded images (data/images.npy)
    # imagefolder only: a local directory (or archive) of class sub-folders, or an archive URL
    # with its sha256; images are converted to `channels` and resized to `image_size` [H, W].
    path: str | None = Field(None, min_length=1, max_length=4096)
    url: str | None = Field(None, max_length=2048, pattern=r"^(https?|file)://\S+$")
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    image_size: tuple[int, int] | None = Field(None, strict=False)
    channels: Literal[1, 3] | None = None

    @field_validator("image_size", mode="before")
    @classmethod
    def _square_from_int(cls, value: Any) -> Any:
        return (value, value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("image_size")
    @classmethod
    def _positive_size(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and not 1 <= min(value) <= max(value) <= 16384:
            raise ValueError("must be positive and at most 16384: [height, width] or one int")
        return value

    @model_validator(mode="after")
    def _options_fit_the_source(self) -> DataConfig:
        folder_only = {
            "path": self.path,
            "url": self.url,
            "sha256": self.sha256,
            "image_size": self.image_size,
            "channels": self.channels,
        }
        if self.source != "imagefolder":
            misplaced = [key for key, value in folder_only.items() if value is not None]
            if misplaced:
                raise ValueError(f"{', '.join(misplaced)}: only for source 'imagefolder' (source is {self.source!r})")
            return self
        if (self.path is None) == (self.url is None):
            raise ValueError("source 'imagefolder' needs exactly one of path (local) or url (archive)")
        if self.url is not None and self.sha256 is None:
            raise ValueError("url needs sha256: downloads are verified before use")
        return self


class SplitConfig(_Section):
    # a source's published test set (MNIST, CIFAR, train/ test/ folders) is the one papers report on
    published: bool = True
    # hash: each image goes where a seeded hash of its content sends it, so that adding images never
    # moves an existing one to another split and copies of an image always share one (data that
    # grows: a fair comparison between models needs the same test images); random: a seeded,
    # stratified shuffle (exact class fractions, but any change to the data reshuffles everything)
    assign: Literal["hash", "random"] = "hash"
    train: float = Field(0.7, gt=0, lt=1)
    val: float = Field(0.15, gt=0, lt=1)  # model selection needs a validation split
    test: float = Field(0.15, gt=0, lt=1)

    @model_validator(mode="after")
    def _fractions_sum_to_one(self) -> SplitConfig:
        total = self.train + self.val + self.test
        if not math.isclose(total, 1.0, abs_tol=1e-9):
            raise ValueError(f"train + val + test must sum to 1, got {total:g}")
        return self


class StatsConfig(_Section):
    chunk_size: int = Field(4096, gt=0, le=1 << 20)


class DeterminismConfig(_Section):
    num_threads: int = Field(2, ge=1, le=1024)
    strict: bool = True
    cpu: Literal["portable", "native"] = "portable"


# torchvision's classification builders (`torchvision.models.list_models(module=torchvision.models)`,
# torchvision 0.29): written out because importing torchvision to ask costs 3-6 s in every process that
# reads params.yaml. tests/train/test_zoo.py holds the list to the installed torchvision; tasks/train/models.py asks
# torchvision again when it builds (an older torchvision, e.g. on a GPU box, may lack a name).
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
MAX_WEIGHTS_FILE = 1 << 40  # bytes; the largest torchvision classifier (regnet_y_128gf) is ~2.6 GB in fp32


OWN_MODELS = ("resnet9", "small_cnn")  # tasks/train/models.py
Auto = Literal["auto"]


@dataclass(frozen=True)
class SourceRecipe:
    """What `auto` in the train section means for one data source."""

    model: str
    epochs: int
    hflip: bool


# `train.model`, `train.epochs` and `train.hflip: auto`, per data.source. resnet9 for real images;
# on 8x8 digits its stages end at 1x1 pixel and small_cnn is as accurate, and int8 speeds it up more.
# Epochs: what fits minutes to tens of minutes of a 2-core CPU at the source's published size
# (README, "Accuracy and time per source"). Mirroring keeps the class of a garment or a CIFAR photo,
# not of a digit (a mirrored 2 is no 2); of an ImageFolder nothing is known: set it for photos.
SOURCE_RECIPES: dict[str, SourceRecipe] = {
    "digits": SourceRecipe(model="small_cnn", epochs=30, hflip=False),
    "mnist": SourceRecipe(model="resnet9", epochs=5, hflip=False),
    "fashion_mnist": SourceRecipe(model="resnet9", epochs=8, hflip=True),
    "cifar10": SourceRecipe(model="resnet9", epochs=12, hflip=True),
    "cifar100": SourceRecipe(model="resnet9", epochs=12, hflip=True),
    "imagefolder": SourceRecipe(model="resnet9", epochs=15, hflip=False),
}


class TrainConfig(_Section):
    # resnet9 or small_cnn (ours), or any of TORCHVISION_MODELS: adapted to the data's channels and
    # classes, with a stride-1 stem for images under 64 px (tasks/train/models.py).
    # auto (model, epochs, hflip): SOURCE_RECIPES[data.source], resolved by Params (params.yaml says
    # auto); a TrainConfig made alone gets the defaults below, or resolves with `for_source`.
    model: str = Field("resnet9", max_length=64)
    epochs: Annotated[int, Field(ge=1, le=MAX_EPOCHS)] | Auto = 30
    batch_size: int = Field(64, ge=1, le=MAX_BATCH)
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = Field(0.05, gt=0, le=MAX_LR)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0, le=1)
    scheduler: Literal["cosine", "step", "none"] = "cosine"
    step_size: int = Field(10, ge=1, le=MAX_EPOCHS)
    gamma: float = Field(0.1, gt=0, le=1)
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    # augmentation: a random translation by up to N pixels (auto: an eighth of the shorter image side,
    # at least 1: 1 px on 8x8 digits, 4 px on 28-32 px images, as the CIFAR baselines pad and crop)
    random_shift: Annotated[int, Field(ge=0, le=64)] | Auto = "auto"
    hflip: bool | Auto = False  # a random horizontal mirror, half the images (auto: SOURCE_RECIPES)
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
    pretrained_path: str | None = Field(None, min_length=1, max_length=4096)
    pretrained_url: str | None = Field(None, max_length=2048, pattern=r"^(https?|file)://\S+$")
    pretrained_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    pretrained_max_bytes: int = Field(4 << 30, ge=1, le=MAX_WEIGHTS_FILE)  # the weights file, downloaded or read
    freeze_backbone_epochs: int = Field(0, ge=0, le=MAX_EPOCHS)  # epochs 1..N train the head alone
    head_lr: float | None = Field(None, gt=0, le=MAX_LR)  # the head's peak learning rate (null: lr)
    # The seed of the model's initialisation, the batch order and the augmentation; null: the top-level
    # seed. A sweep trial trains with its own (tasks/tools/sweep.py) on the data the top-level seed split.
    seed: int | None = Field(None, ge=0, lt=2**32)

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        if value == "auto" or value in OWN_MODELS or value in TORCHVISION_MODELS:
            return value
        import difflib

        close = difflib.get_close_matches(value, [*OWN_MODELS, *sorted(TORCHVISION_MODELS)], n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise ValueError(
            "unknown model: auto, resnet9, small_cnn or a torchvision classification model (resnet18, "
            "mobilenet_v3_small, efficientnet_b0, convnext_tiny, regnet_x_400mf, vit_b_16, ...; "
            f"see tasks/core/config.py){hint}"
        )

    def for_source(self, source: str) -> TrainConfig:
        """This config with `auto` model, epochs and hflip replaced by `source`'s recipe (SOURCE_RECIPES)."""
        recipe = SOURCE_RECIPES[source]
        update = {key: getattr(recipe, key) for key in ("model", "epochs", "hflip") if getattr(self, key) == "auto"}
        return self.model_copy(update=update) if update else self

    @model_validator(mode="after")
    def _pretrained_is_verified(self) -> TrainConfig:
        if self.pretrained_path is not None and self.pretrained_url is not None:
            raise ValueError("pretrained_path and pretrained_url: give one (a local file, or a URL to download)")
        given = self.pretrained_path is not None or self.pretrained_url is not None
        if given and self.pretrained_sha256 is None:
            raise ValueError("pretrained weights need pretrained_sha256: they are verified before they are loaded")
        if not given and self.pretrained_sha256 is not None:
            raise ValueError("pretrained_sha256 without pretrained_path or pretrained_url")
        return self


class EvaluateConfig(_Section):
    batch_size: int = Field(512, ge=1, le=MAX_BATCH)
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d{1,3})?)$")


Variant = Literal["dynamic_int8", "static_int8", "qat_int8", "pruned_l1", "pruned_ln"]


class CompressConfig(_Section):
    """Which smaller models the compress stage builds from the best checkpoint, and how it measures them."""

    variants: tuple[Variant, ...] = Field(
        ("dynamic_int8", "static_int8", "qat_int8", "pruned_l1", "pruned_ln"), strict=False
    )
    calibration_size: int = Field(512, ge=1, le=1_000_000)  # static int8: seeded subset of the training split
    qat_epochs: int = Field(2, ge=1, le=MAX_EPOCHS)  # quantization-aware fine-tuning epochs (qat_int8)
    qat_lr: float = Field(0.001, gt=0, le=MAX_LR)
    prune_amount: float = Field(0.5, gt=0, lt=1)  # pruned_l1: fraction of all conv/linear weights zeroed
    prune_channels: float = Field(0.25, gt=0, lt=1)  # pruned_ln: fraction of each conv's output channels
    prune_norm: int = Field(2, ge=1, le=16)  # pruned_ln: channels ranked by their L-n norm
    finetune_epochs: int = Field(3, ge=0, le=MAX_EPOCHS)  # after pruning (pruned_l1: the pruned weights held at zero)
    finetune_lr: float = Field(0.005, gt=0, le=MAX_LR)
    latency_runs: int = Field(30, ge=20, le=100_000)  # timed runs per variant and batch size; the median is reported
    latency_warmup: int = Field(5, ge=1, le=10_000)

    @field_validator("variants")
    @classmethod
    def _unique(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError(f"lists a variant twice: {list(value)}")
        return value


ExportFormat = Literal["onnx", "pt2", "torchscript"]


class ExportConfig(_Section):
    """What ships, and the gates it must pass first (tasks/ship/export.py)."""

    # tried in order; the first that passes its gates ships as model.onnx. fp32, if listed, comes last:
    # it has no gates of its own, so nothing after it could ever be tried.
    candidates: tuple[Literal["fp32"] | Variant, ...] = Field(("static_int8", "fp32"), min_length=1, strict=False)
    formats: tuple[ExportFormat, ...] = Field(("onnx", "pt2"), min_length=1, strict=False)
    parity_batch: int = Field(256, ge=1, le=MAX_BATCH)  # the first N test images: exported fp32 formats vs eager
    max_abs_diff: float = Field(1e-4, gt=0, le=1e3)  # fp32 ONNX / torch formats' logits vs eager
    min_top1_agreement: float = Field(0.99, ge=0, le=1)  # a candidate vs fp32 top-1, where fp32 is confident
    confidence: float = Field(0.5, ge=0, lt=1)  # fp32's top softmax probability that counts as confident
    max_accuracy_drop: float = Field(0.01, ge=0, le=1)  # fp32 test accuracy minus a candidate's

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and ("variant" in data or "fallback" in data):
            raise ValueError(
                "variant and fallback were replaced by candidates, the variants to try in order "
                "(e.g. [static_int8, fp32]: static_int8, or fp32 when static_int8 fails its gates)"
            )
        return data

    @field_validator("candidates", "formats")
    @classmethod
    def _no_repeats(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(values)) != len(values):
            raise ValueError(f"lists an entry twice: {list(values)}")
        return values

    @field_validator("candidates")
    @classmethod
    def _fp32_last(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        if "fp32" in values[:-1]:
            raise ValueError(f"fp32 must come last (nothing after it is ever tried): {list(values)}")
        return values

    @field_validator("formats")
    @classmethod
    def _onnx_listed(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        if "onnx" not in values:
            raise ValueError(f"must include onnx (model.onnx is what ships), got {list(values)}")
        return values


class ChecksConfig(_Section):
    """Data checks on a new snapshot before it replaces the last trained one (the download stage).

    A gate, not an input: a snapshot that passes is written exactly as without them, so these
    thresholds are not DVC params of any stage (changing one retrains nothing). A failed check
    refuses the snapshot: the stage fails with one line naming the check and its numbers, and data/
    stays as it was.
    """

    enabled: bool = True
    # fewer images than the last trained snapshot, as a fraction of it (0.1: a drop of over 10% is refused)
    max_image_drop: float = Field(0.1, ge=0, le=1)
    missing_classes: Literal["refuse", "warn"] = "refuse"  # a class the last trained snapshot had
    new_classes: Literal["refuse", "warn"] = "warn"  # a class it did not have (the head changes size)
    max_class_imbalance: float = Field(20.0, ge=1, le=1e9)  # largest class / smallest class
    max_mean_shift: float = Field(0.5, ge=0, le=1e3)  # per channel, in units of the last snapshot's std
    max_std_ratio: float = Field(1.5, ge=1, le=1e3)  # per channel, new std / last std or its inverse
    # population stability index of the class frequencies: < 0.1 little change, > 0.25 a large one
    max_label_psi: float = Field(0.25, ge=0, le=1e3)
    # test images whose exact content is also in train or val (they inflate test accuracy)
    max_duplicates_across_splits: float = Field(0.01, ge=0, le=1)  # as a fraction of the test split


class PromotionConfig(_Section):
    """How a new model version is judged against the champion (tasks/ship/registry.py), on the same test
    images: the champion's ONNX model is scored on the challenger's test split. Read by the export
    stage's registry step only, like `tracking`: not a DVC param (changing it re-exports nothing)."""

    # margin: promote when challenger accuracy - champion accuracy >= min_margin on the same images;
    # mcnemar: promote only when the challenger is better by McNemar's exact test at `alpha`
    rule: Literal["margin", "mcnemar"] = "margin"
    min_margin: float = Field(0.0, ge=-1, le=1)  # 0.0: at least as accurate as the champion
    alpha: float = Field(0.05, gt=0, lt=1)
    # a champion that cannot be scored on the new data (other classes or input shape)
    incomparable: Literal["promote", "keep"] = "promote"
    max_champion_bytes: int = Field(2 << 30, ge=1, le=1 << 40)  # the champion's files, fetched from the registry


class NotifyConfig(_Section):
    """Who is told when a run fails, crashes or is refused, and of each promotion decision
    (flows/notify.py). Webhook URLs carry tokens: they are never params. They come from a Prefect
    block (`block`, made with `prefect block create` or the UI) or from an environment variable
    (`url_env`); with neither set, nobody is told and the run says so once."""

    events: tuple[Literal["failed", "crashed", "refused", "promotion"], ...] = Field(
        ("failed", "crashed", "refused", "promotion"), strict=False
    )
    block: str | None = Field(None, max_length=256, pattern=r"^[a-z0-9-]+/[a-z0-9-]+$")  # <block type>/<name>
    url_env: str = Field("LOCKSTEP_NOTIFY_URL", max_length=128, pattern=r"^[A-Z_][A-Z0-9_]*$")
    format: Literal["slack", "generic"] = "slack"  # slack: {"text": ...}; generic: the event as JSON fields
    timeout_s: float = Field(5.0, gt=0, le=60)  # per message; a slow or dead receiver never stalls a run


class TrackingConfig(_Section):
    enabled: bool = True
    experiment: str = Field("lockstep", min_length=1, max_length=256)
    registered_model: str = Field("lockstep-classifier", min_length=1, max_length=256)


class OrchestrationConfig(_Section):
    """How the pipeline runs as a service (flows/deployments.py); read by no stage, so
    changing a schedule never retrains a model."""

    # lockstep-pipeline/<deployment>
    deployment: str = Field("nightly", max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    # Five cron fields (Prefect checks the values when the deployment is created); null: no schedule.
    cron: str | None = Field("0 3 * * *", max_length=256, pattern=r"^\s*(\S+\s+){4}\S+\s*$")
    timezone: str = Field("UTC", max_length=64)
    reingest: bool = True  # scheduled runs re-read the source first; unchanged data means nothing retrains
    lock_wait_s: float = Field(3600.0, ge=0, le=7 * 24 * 3600)  # an overlapping run waits this long, then is refused
    notify: NotifyConfig = NotifyConfig()

    @field_validator("timezone")
    @classmethod
    def _known_timezone(cls, value: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError("not an IANA time zone (e.g. UTC, Europe/Berlin)") from None
        return value


# Train keys a sweep may search. Not: where and how it runs (launch keys, device: the trials are the
# parallelism), what it starts from (pretrained_*: a file verified by digest) or the seed (each
# trial's is derived from sweep.seed and its number).
SWEEP_FORBIDDEN = frozenset(
    {"strategy", "nproc_per_node", "nnodes", "rdzv_endpoint", "max_restarts", "checkpoint_every", "num_workers"}
    | {"device", "seed", "pretrained_path", "pretrained_url", "pretrained_sha256", "pretrained_max_bytes"}
)
Scalar = Annotated[bool | int | float | str, Field(union_mode="left_to_right")]


class SearchSpace(_Section):
    """One searched train key: a float or int range (log scale optional), or a list of choices."""

    type: Literal["float", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = Field(None, gt=0)  # float/int: a grid (int default 1)
    choices: tuple[Scalar, ...] | None = Field(None, min_length=1, max_length=64, strict=False)

    @model_validator(mode="after")
    def _consistent(self) -> SearchSpace:
        if self.type == "categorical":
            if self.choices is None or self.low is not None or self.high is not None or self.log:
                raise ValueError("categorical: give choices (a list), not low/high/log")
            return self
        if self.choices is not None or self.low is None or self.high is None:
            raise ValueError(f"{self.type}: give low and high, not choices")
        if not self.low < self.high:
            raise ValueError(f"{self.type}: low ({self.low}) must be below high ({self.high})")
        if self.log and (self.low <= 0 or self.step is not None):
            raise ValueError(f"{self.type}: log scale needs low > 0 and no step")
        if self.type == "int" and not all(float(v).is_integer() for v in (self.low, self.high, self.step or 1)):
            raise ValueError("int: low, high and step must be whole numbers")
        return self

    def values(self) -> tuple[Any, ...]:
        """The values that must each be valid for the key: the choices, or both bounds."""
        if self.type == "categorical":
            return self.choices or ()
        assert self.low is not None and self.high is not None
        return (int(self.low), int(self.high)) if self.type == "int" else (self.low, self.high)


class AppliedSweep(_Section):
    """Written by `python -m flows.sweep --apply`: the trial whose params train uses (lineage; a DVC param)."""

    study: str = Field(max_length=64)
    trial: int = Field(ge=0)
    run_id: str = Field(pattern=r"^[0-9a-f]{32}$")  # the trial's MLflow run (make reproduce ARGS=...)


class SweepConfig(_Section):
    """A hyperparameter search over train keys (flows/sweep.py, tasks/tools/sweep.py). Read by no stage but
    `applied`, which train records."""

    name: str = Field("lockstep", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # the Optuna study
    trials: int = Field(8, ge=1, le=10_000)
    # Trials asked together, run in parallel and told back in trial-number order: results depend on
    # this, never on how many workers run them (tasks/tools/sweep.py).
    batch: int = Field(2, ge=1, le=256)
    seed: int = Field(0, ge=0, lt=2**32)
    sampler: Literal["tpe", "random"] = "tpe"
    startup_trials: int = Field(4, ge=0, le=10_000)  # tpe: random trials before it models the results
    pruner: Literal["median", "none"] = "median"
    warmup_epochs: int = Field(1, ge=0, le=MAX_EPOCHS)  # median: epochs every trial runs before it can be pruned
    metric: Literal["val_accuracy", "val_loss"] = "val_accuracy"
    direction: Literal["maximize", "minimize"] = "maximize"
    retries: int = Field(1, ge=0, le=10)  # a crashed trial is run again this many times, then recorded failed
    space: dict[str, SearchSpace] = Field(default_factory=dict, max_length=32)
    # Where trials run: a Dask scheduler (tcp://host:8786; or env LOCKSTEP_DASK_ADDRESS); null: a local
    # cluster of `workers` processes. Storage: an Optuna RDB URL (credentials: env LOCKSTEP_SWEEP_STORAGE,
    # never here); null: a journal file, artifacts/sweep/<name>.journal.
    address: str | None = Field(None, max_length=255, pattern=r"^(tcp|tls)://[^\s/@]+:\d{1,5}$")
    workers: int = Field(2, ge=1, le=MAX_PROCESSES)
    storage: str | None = Field(None, max_length=1024, pattern=r"^(sqlite|postgresql|mysql)(\+\w+)?://\S+$")
    applied: AppliedSweep | None = None

    @field_validator("space")
    @classmethod
    def _train_keys(cls, space: dict[str, SearchSpace]) -> dict[str, SearchSpace]:
        for key in space:
            leaf = key.removeprefix("train.")
            if not key.startswith("train.") or leaf not in TrainConfig.model_fields or leaf in SWEEP_FORBIDDEN:
                raise ValueError(
                    f"{shown(key)}: a sweep searches train keys (train.lr, train.weight_decay, ...), "
                    f"not {', '.join(sorted(SWEEP_FORBIDDEN))}"
                )
        return space

    @field_validator("storage")
    @classmethod
    def _no_credentials(cls, value: str | None) -> str | None:
        if value is not None and re.search(r"://[^/@]*:[^/@]*@", value):
            raise ValueError("a password in a URL: put the URL in env LOCKSTEP_SWEEP_STORAGE (or use ~/.pgpass)")
        return value

    @model_validator(mode="after")
    def _direction_fits_metric(self) -> SweepConfig:
        wanted = "maximize" if self.metric == "val_accuracy" else "minimize"
        if self.direction != wanted:
            raise ValueError(f"direction: {self.metric} is optimised by {wanted}, got {self.direction}")
        return self


class Params(_Section):
    seed: int = Field(42, ge=0, lt=2**32)
    sweep: SweepConfig = SweepConfig()
    data: DataConfig = DataConfig()
    split: SplitConfig = SplitConfig()
    stats: StatsConfig = StatsConfig()
    determinism: DeterminismConfig = DeterminismConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    compress: CompressConfig = CompressConfig()
    export: ExportConfig = ExportConfig()
    checks: ChecksConfig = ChecksConfig()
    promotion: PromotionConfig = PromotionConfig()
    tracking: TrackingConfig = TrackingConfig()
    orchestration: OrchestrationConfig = OrchestrationConfig()

    @model_validator(mode="after")
    def _train_recipe_for_the_source(self) -> Params:
        # Resolved here, once: every stage and the MLflow params see numbers, never "auto".
        return self.model_copy(update={"train": self.train.for_source(self.data.source)})

    @model_validator(mode="after")
    def _candidates_are_built(self) -> Params:
        for variant in self.export.candidates:
            if variant != "fp32" and variant not in self.compress.variants:
                raise ValueError(
                    f"export.candidates: {variant!r} is not built: add it to compress.variants "
                    f"(now {list(self.compress.variants)}) or drop it from export.candidates"
                )
        return self

    @property
    def train_seed(self) -> int:
        """The seed the train stage computes with: train.seed, else the top-level seed."""
        return self.seed if self.train.seed is None else self.train.seed

    @model_validator(mode="after")
    def _sweep_space_fits_train(self) -> Params:
        # every bound and choice must be a valid train value here, not a failed trial hours later
        base = self.train.model_dump()
        for key, space in self.sweep.space.items():
            leaf = key.removeprefix("train.")
            for value in space.values():
                try:
                    TrainConfig.model_validate({**base, leaf: value})
                except ValidationError as exc:
                    message = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
                    raise ValueError(f"sweep.space.{key}: {shown(value)} is not a valid {key}: {message}") from None
        return self

    def sections(self, stage: str) -> dict[str, Any]:
        """The params a stage reads, flattened to dotted keys (for MLflow and for humans)."""
        flat: dict[str, Any] = {}
        for section in STAGE_PARAMS[stage]:
            value = self
            for part in section.split("."):  # a section, or one key of one ("data.source")
                value = getattr(value, part)
            if isinstance(value, BaseModel):
                flat.update({f"{section}.{k}": v for k, v in value.model_dump().items()})
            else:
                flat[section] = value
        return flat


# Which top-level sections of params.yaml each stage reads. `tracking` is read by every stage's
# MLflow wrapper, not by the computation, so it is deliberately not a DVC dependency: renaming an
# experiment must not retrain a model. Likewise `data` is read by download only: later stages
# depend on the data itself (its hash), so a new mirror or retry count never retrains a model.
STAGE_PARAMS: dict[str, tuple[str, ...]] = {
    "download": ("data",),
    "stats": ("seed", "split", "stats"),
    "preprocess": ("seed", "split"),
    # data.source: what `auto` resolves to; sweep.applied: the sweep trial whose params these are (lineage)
    "train": ("seed", "determinism", "train", "data.source", "sweep.applied"),
    "evaluate": ("seed", "determinism", "evaluate"),
    # fine-tuning (pruning, QAT) continues with the train stage's optimiser and augmentation
    "compress": ("seed", "determinism", "train", "data.source", "compress"),
    "export": ("seed", "determinism", "export"),
}
STAGES: tuple[str, ...] = tuple(STAGE_PARAMS)


def shown(value: Any, limit: int = 80) -> str:
    """A key or value as one short line (YAML keys can be anything: numbers, null, text with newlines).
    reprlib, not repr: a huge or deeply nested value must not be rendered whole to show 80 characters."""
    import reprlib

    if isinstance(value, str) and value.isprintable() and value.strip() == value:
        text = value
    else:
        shortener = reprlib.Repr()  # Python 3.11 takes no arguments here
        shortener.maxlevel, shortener.maxstring, shortener.maxother, shortener.maxlong = 3, limit, limit, limit
        text = shortener.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# The tags pydantic puts in an error's location for the branch of a union that failed
# (`epochs: int | "auto"` fails as train.epochs.constrained-int and train.epochs.literal['auto']).
_UNION_BRANCH = re.compile(r"^(constrained-\w+|literal\[.*\]|int|bool|str|float)$")


def _merge_union_branches(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One error per key: a union's failed branches become one message ("... or 'auto'")."""
    merged: dict[tuple, dict[str, Any]] = {}
    for error in errors:
        loc = tuple(part for part in error["loc"] if not (isinstance(part, str) and _UNION_BRANCH.match(part)))
        if loc in merged and loc != tuple(error["loc"]):
            merged[loc]["msg"] += " or " + error["msg"].removeprefix("Input should be ")
        else:
            merged.setdefault(loc, {**error, "loc": loc})
    return list(merged.values())


def _format_error(error: dict[str, Any]) -> str:
    key = ".".join(shown(part) for part in error["loc"])
    got = error.get("input")
    value = "" if isinstance(got, dict) or error["type"] == "missing" else f" (got {shown(got)})"
    message = error["msg"].removeprefix("Value error, ")
    # checks across sections (e.g. export.candidates against compress.variants) name their keys themselves
    return f"{key}: {message}{value}" if key else f"{message}{value}"


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML silently keeps the last)
    and aliases (`*name`): nine nested aliases expand a few lines into a billion values ("billion
    laughs"), and params.yaml has no need for them."""

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            line = event.start_mark.line + 1 if event.start_mark else "?"
            raise ConfigError(
                f"line {line}: YAML aliases (*{shown(event.anchor, 40)}) are not accepted; write the value out"
            )
        return super().compose_node(parent, index)  # type: ignore[no-any-return]

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise ConfigError(f"{shown(key)}: given twice (lines {seen[key]} and {line}); keep one")
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


# YAML 1.2 floats with an exponent (`1e-3`, which ruamel also writes, and `1.5e3`): PyYAML's 1.1
# rules read them as strings unless the exponent has a sign, which strict validation would then refuse.
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)
MAX_NUMBER_DIGITS = 40  # far beyond any bound below; Python refuses over 4,300 digits with a ValueError


def _bounded_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    if len(node.value) > MAX_NUMBER_DIGITS:
        raise ConfigError(f"line {node.start_mark.line + 1}: a number of {len(node.value)} digits; no key takes one")
    return yaml.SafeLoader.construct_yaml_int(loader, node)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _bounded_int)


def load_yaml(text: str) -> Any:
    """YAML as params.yaml is read (safe, duplicate keys refused, `1e-3` a float); raises yaml.YAMLError."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def load_params(path: str | Path = PARAMS_FILE) -> Params:
    """Read and validate params.yaml; raise ConfigError (one line, naming the file and key) on bad input."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_PARAMS_BYTES:
            raise ConfigError(f"{path}: {path.stat().st_size} bytes; a params file is at most {MAX_PARAMS_BYTES}")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read: {exc.strerror}") from None
    return _validate(_parse(text, path), path)


def _parse(text: str, path: Path) -> Any:
    try:
        return load_yaml(text)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None


def _validate(raw: Any, path: Path) -> Params:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    try:
        return Params.model_validate(raw)
    except ValidationError as exc:
        # one line, every problem on it: entry points print it as their one error line
        raise ConfigError(
            f"{path}: " + "; ".join(_format_error(err) for err in _merge_union_branches(exc.errors()))
        ) from None


def with_overrides(path: str | Path, overrides: dict[str, Any]) -> tuple[str, Params]:
    """params.yaml with `overrides` ({"train.lr": 0.01}, as `dvc exp run -S train.lr=0.01`) applied:
    the new text (comments, quotes and order kept) and its validated params.
    Raises ConfigError naming the key for an unknown key or a bad value."""
    import io

    from ruamel.yaml import YAML  # round-trip YAML (DVC's own dependency): keeps comments and order

    path = Path(path)
    params = load_params(path)  # the file as it is must be valid too
    if not overrides:
        return path.read_text(), params
    rt = YAML()
    rt.preserve_quotes = True
    rt.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    doc = rt.load(path.read_text())
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = doc
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            raise ConfigError(f"{path}: {key}: no such key (in overrides)")
        node[leaf] = value
    out = io.StringIO()
    rt.dump(doc, out)
    return out.getvalue(), _validate(_parse(out.getvalue(), path), path)


# Keys whose values reach the network, other machines or files outside the project. A run started
# through the Prefect API (a deployment's `overrides`) may not change them unless whoever started the
# server allowed it (`python -m flows.deployments serve --allow-override KEY`): else a web page or
# anyone who can reach the API could point the data at their server or the train stage at their
# rendezvous, and the flow would write it into params.yaml for good.
REMOTE_KEYS = (
    "data.url",
    "data.mirror",
    "data.path",
    "data.sha256",
    "train.rdzv_endpoint",
    "train.nnodes",
    "train.pretrained_url",
    "train.pretrained_path",
    "train.pretrained_sha256",
    "sweep.address",
    "sweep.storage",
)


def refuse_remote_overrides(overrides: dict[str, Any], allowed: frozenset[str] | set[str]) -> None:
    """Raise ConfigError if `overrides` sets a REMOTE_KEYS key (or its whole section) not in `allowed`."""
    refused = sorted(
        key
        for key in overrides
        if key not in allowed and any(key == remote or remote.startswith(f"{key}.") for remote in REMOTE_KEYS)
    )
    if refused:
        raise ConfigError(
            f"overrides: {', '.join(refused)} reach the network or other machines and cannot be overridden "
            "through a deployment run unless the server was started with --allow-override for them"
        )


def set_params(path: str | Path, overrides: dict[str, Any]) -> Params:
    """Write `overrides` into params.yaml, validated first (a bad one leaves the file untouched).

    The file stays the one record of what ran: DVC decides staleness from it, so a run with other
    values must write them there first, as `dvc exp run -S` does.
    """
    from tasks.core.atomic import write_text

    text, params = with_overrides(path, overrides)
    write_text(Path(path), text)
    return params
