"""params.yaml parsed once into frozen, typed models.

Nothing downstream of `load_params` sees a raw dict. An unknown key, a wrong type or an impossible
value raises `ConfigError` naming the key; the entry points turn it into exit code 2 before any
file is written.

`STAGE_PARAMS` says which top-level sections each stage reads. dvc.yaml lists exactly these keys
(a test holds the two together) and each stage logs exactly these to MLflow.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PARAMS_FILE = "params.yaml"


class ConfigError(ValueError):
    """params.yaml is malformed; the message names the file and the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class DataConfig(_Section):
    # Later sources (mnist, cifar10, imagefolder, ...) write the same on-disk format.
    source: Literal["digits"] = "digits"


class SplitConfig(_Section):
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
    chunk_size: int = Field(4096, gt=0)


class DeterminismConfig(_Section):
    num_threads: int = Field(2, ge=1)
    strict: bool = True


class TrainConfig(_Section):
    model: Literal["small_cnn", "resnet18"] = "small_cnn"
    epochs: int = Field(30, ge=1)
    batch_size: int = Field(64, ge=1)
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0)
    scheduler: Literal["cosine", "step", "none"] = "cosine"
    step_size: int = Field(10, ge=1)
    gamma: float = Field(0.1, gt=0, le=1)
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    random_shift: int = Field(1, ge=0)
    num_workers: int = Field(2, ge=0)
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    max_batches: int | None = Field(None, ge=1)


class EvaluateConfig(_Section):
    batch_size: int = Field(512, ge=1)
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")


class TrackingConfig(_Section):
    enabled: bool = True
    experiment: str = Field("lockstep", min_length=1)
    registered_model: str = Field("lockstep-classifier", min_length=1)


class Params(_Section):
    seed: int = Field(42, ge=0, lt=2**32)
    data: DataConfig = DataConfig()
    split: SplitConfig = SplitConfig()
    stats: StatsConfig = StatsConfig()
    determinism: DeterminismConfig = DeterminismConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    tracking: TrackingConfig = TrackingConfig()

    def sections(self, stage: str) -> dict[str, Any]:
        """The params a stage reads, flattened to dotted keys (for MLflow and for humans)."""
        flat: dict[str, Any] = {}
        for section in STAGE_PARAMS[stage]:
            value = getattr(self, section)
            if isinstance(value, BaseModel):
                flat.update({f"{section}.{k}": v for k, v in value.model_dump().items()})
            else:
                flat[section] = value
        return flat


# Which top-level sections of params.yaml each stage reads. `tracking` is read by every stage's
# MLflow wrapper, not by the computation, so it is deliberately not a DVC dependency: renaming an
# experiment must not retrain a model.
STAGE_PARAMS: dict[str, tuple[str, ...]] = {
    "download": ("data",),
    "stats": ("seed", "data", "split", "stats"),
    "preprocess": ("seed", "data", "split"),
    "train": ("seed", "determinism", "train"),
    "evaluate": ("seed", "determinism", "evaluate"),
}
STAGES: tuple[str, ...] = tuple(STAGE_PARAMS)


def _format_error(path: Path, error: dict[str, Any]) -> str:
    key = ".".join(str(part) for part in error["loc"]) or "<top level>"
    got = error.get("input")
    shown = "" if isinstance(got, dict) or error["type"] == "missing" else f" (got {got!r})"
    message = error["msg"].removeprefix("Value error, ")
    return f"{path}: {key}: {message}{shown}"


def load_params(path: str | Path = PARAMS_FILE) -> Params:
    """Read and validate params.yaml; raise ConfigError naming the file and key on bad input."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}".replace("\n", " ")) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    try:
        return Params.model_validate(raw)
    except ValidationError as exc:
        lines = [_format_error(path, err) for err in exc.errors()]
        raise ConfigError("\n".join(lines)) from None
