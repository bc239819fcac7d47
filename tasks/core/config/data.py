"""The data sections: `data` (what download ingests), `split`, `stats`, and `checks` (its gates); and
`SOURCES`, the registry of what `data.source` names (tasks/core/registry.py), each with its training recipe."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final, Literal

from pydantic import Field, field_validator, model_validator

from tasks.core.config.base import (
    Section,
    Url,
)
from tasks.core.registry import Registry

# A recipe's value that the data decides: the key stays `auto` past Params, and the train stage chooses
# it from the training split it reads (tasks/train/auto.py), recording why.
FROM_DATA: Final = "auto"


@dataclass(frozen=True)
class SourceRecipe:
    """What `auto` in the train section means for one data source: `train.model`, `train.epochs`,
    `train.lr`, `train.hflip`, `train.augment`, `train.early_stop_patience`, `train.class_balance`,
    `train.label_smoothing` and `train.keep` (names of
    tasks/core/config/train.py's MODELS or a torchvision model, and of its AUGMENT_PRESETS), or
    FROM_DATA."""

    model: str
    epochs: int | str
    hflip: bool
    lr: float | str = 0.05  # per batch_size images: what every published source's recipe was measured with
    augment: str = "shift_flip"
    greyscale_augment: str | None = None  # `augment` when data.channels is 1, if it differs
    early_stop_patience: int | str | None = None
    class_balance: str = "none"
    label_smoothing: float | str = 0.1  # 3 seeds on 8x8 digits: 98.5-98.9% test accuracy (0.0: 97.0-99.6%)
    keep: str = "best"  # the epoch best.safetensors holds (published sources validate on 288 images or more)

    def augment_for(self, channels: int | None) -> str:
        return self.greyscale_augment if channels == 1 and self.greyscale_augment else self.augment


@dataclass(frozen=True)
class DataSource:
    """A `data.source` value (tasks/data/download.py registers its loader under the same name)."""

    summary: str  # what it is, for the docs' table
    needs: str  # what the download stage needs to fetch it
    recipe: SourceRecipe  # what `auto` in the train section resolves to
    folder_options: bool = False  # takes data.path / url / sha256 / image_size / channels


# The recipes: resnet9 for real images; on 8x8 digits its stages end at 1x1 pixel and small_cnn is as
# accurate, and int8 speeds it up more. Epochs: what fits minutes to tens of minutes of a 2-core CPU at the
# source's published size (docs/data.md, "Accuracy and time per source"). Mirroring keeps the class of a
# garment or a CIFAR photo, not of a digit (a mirrored 2 is no 2); of an ImageFolder nothing is known: set
# it for photos. An ImageFolder's images are also rotated, scaled and sheared a little (augment: affine: up
# to 10 degrees and 10%), too little to turn a digit, a letter or a photo into another class; on real
# handwritten digits and on generated glyphs it did as well as shift alone or better (docs/training.md).
# Greyscale folders (data.channels: 1: handwriting, glyphs, scans) add an elastic distortion: on real
# handwritten digits it beat `affine` on validation over three split seeds, on generated glyphs it tied
# on two and was two images worse on one; 12 or 10 epochs of it did worse than 15 (docs/training.md).
# Not on colour folders: unmeasured on photos. A folder's epochs, learning rate, early stopping, class
# balance, label smoothing and kept epoch are its data's (FROM_DATA): 15 epochs were 45 optimiser steps on 173 painted
# sprites, and left real colour folders underfit (docs/training.md, "Real image sets"); tasks/train/auto.py
# has the rules.
_PUBLISHED = "the published files (torchvision's URLs and md5s)"
SOURCES: Registry[DataSource] = Registry(
    "data.source",
    {
        "digits": DataSource(
            "scikit-learn's 8×8 digits, 1,797 greyscale images",
            "nothing (ships offline)",
            SourceRecipe(model="small_cnn", epochs=30, hflip=False),
        ),
        "mnist": DataSource(
            "70,000 28×28 greyscale handwritten digits",
            _PUBLISHED,
            SourceRecipe(model="resnet9", epochs=5, hflip=False),
        ),
        "fashion_mnist": DataSource(
            "70,000 28×28 greyscale garments", _PUBLISHED, SourceRecipe(model="resnet9", epochs=8, hflip=True)
        ),
        "cifar10": DataSource(
            "60,000 32×32 RGB photos, 10 classes",
            "the published archive (torchvision's URL and md5)",
            SourceRecipe(model="resnet9", epochs=12, hflip=True),
        ),
        "cifar100": DataSource(
            "60,000 32×32 RGB photos, 100 classes",
            "the published archive (torchvision's URL and md5)",
            SourceRecipe(model="resnet9", epochs=12, hflip=True),
        ),
        "imagefolder": DataSource(
            "your images: `root/<class>/**/*.png` (jpg, bmp, tif, webp, ...)",
            "`data.path` (a folder or archive), or `data.url` + `data.sha256`",
            SourceRecipe(
                model="resnet9",
                epochs=FROM_DATA,
                lr=FROM_DATA,
                hflip=False,
                augment="affine",
                greyscale_augment="elastic",
                early_stop_patience=FROM_DATA,
                class_balance=FROM_DATA,
                label_smoothing=FROM_DATA,
                keep=FROM_DATA,
            ),
            folder_options=True,
        ),
    },
)
Source = SOURCES.named()


class DataConfig(Section):
    """What the download stage ingests (every source ends up in the same format, tasks/data/formats.py)."""

    source: Source = "digits"
    # Base URL that replaces the published hosts (air-gapped sites): files are fetched from
    # <mirror>/<file name> and still verified against the published checksums.
    # Credentials for mirror and url: LOCKSTEP_DATA_TOKEN / LOCKSTEP_DATA_AUTH or ~/.netrc (tasks/core/fetch.py);
    # a URL holding any (user:pass@, ?token=) is refused (base.py `Url`): params.yaml and dvc.lock record it.
    mirror: Url | None = None
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
    url: Url | None = None
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
        if not SOURCES[self.source].folder_options:
            misplaced = [key for key, value in folder_only.items() if value is not None]
            if misplaced:
                takes = " or ".join(repr(name) for name, entry in SOURCES.items() if entry.folder_options)
                raise ValueError(f"{', '.join(misplaced)}: only for source {takes} (source is {self.source!r})")
            return self
        if (self.path is None) == (self.url is None):
            raise ValueError(f"source {self.source!r} needs exactly one of path (local) or url (archive)")
        if self.url is not None and self.sha256 is None:
            raise ValueError("url needs sha256: downloads are verified before use")
        return self


class SplitConfig(Section):
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


class StatsConfig(Section):
    chunk_size: int = Field(4096, gt=0, le=1 << 20)


class ChecksConfig(Section):
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
