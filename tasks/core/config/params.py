"""The whole params.yaml as one frozen model, and which sections each stage reads."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, ValidationError, model_validator

from tasks.core.config.base import (
    Section,
    shown,
)
from tasks.core.config.data import ChecksConfig, DataConfig, SplitConfig, StatsConfig
from tasks.core.config.service import OrchestrationConfig, TrackingConfig
from tasks.core.config.ship import CompressConfig, ExportConfig, PromotionConfig
from tasks.core.config.sweep import SweepConfig
from tasks.core.config.train import SOURCE_AUTO_KEYS, DeterminismConfig, EvaluateConfig, TrainConfig

# What a params file that leaves a key out gets, where params.yaml ships another value than a section
# made alone in code has (a TrainConfig() has concrete values, for the tests and tools that build one
# without a data source): a key left out means what params.yaml and docs/params.md say.
# (tests/core/test_config.py holds an empty file equal to params.yaml.)
FILE_DEFAULTS: dict[str, dict[str, Any]] = {
    "train": {
        **dict.fromkeys(SOURCE_AUTO_KEYS, "auto"),
    },
    "sweep": {
        "space": {
            "train.lr": {"type": "float", "low": 0.005, "high": 0.5, "log": True},
            "train.weight_decay": {"type": "float", "low": 1.0e-5, "high": 1.0e-2, "log": True},
            "train.label_smoothing": {"type": "categorical", "choices": [0.0, 0.1]},
        }
    },
}


class Params(Section):
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

    @model_validator(mode="before")
    @classmethod
    def _file_defaults(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw  # (pydantic names the wrong type)
        filled = dict(raw)
        for section, defaults in FILE_DEFAULTS.items():
            given = filled.get(section, {})
            if isinstance(given, dict):
                filled[section] = {**defaults, **given}
        return filled

    @model_validator(mode="after")
    def _train_recipe_for_the_source(self) -> Params:
        # Resolved here, once: every stage and the MLflow params see numbers, never "auto".
        return self.model_copy(update={"train": self.train.for_source(self.data.source, self.data.channels)})

    @model_validator(mode="after")
    def _variants_for_the_candidates(self) -> Params:
        # Resolved here, once, before the check below: the compress stage, its MLflow params and the
        # model card see the list it builds, never "auto".
        return self.model_copy(update={"compress": self.compress.for_candidates(self.export.candidates)})

    @model_validator(mode="after")
    def _candidates_are_built(self) -> Params:
        for variant in self.export.candidates:
            if variant != "fp32" and variant not in self.compress.variants:
                raise ValueError(
                    f"export.candidates: {variant!r} is not built: add it to compress.variants "
                    f"(now {list(self.compress.variants)}), set that to auto, or drop it from export.candidates"
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
    # data.source and data.channels: what `auto` resolves from; sweep.applied: the sweep trial whose
    # params these are (lineage)
    "train": ("seed", "determinism", "train", "data.source", "data.channels", "sweep.applied"),
    "evaluate": ("seed", "determinism", "evaluate"),
    # fine-tuning (pruning, QAT) continues with the train stage's optimiser and augmentation;
    # export.candidates: what `compress.variants: auto` builds
    "compress": ("seed", "determinism", "train", "data.source", "data.channels", "compress", "export.candidates"),
    "export": ("seed", "determinism", "export"),
}
STAGES: tuple[str, ...] = tuple(STAGE_PARAMS)
# The data stages compute with numpy alone: they pin its seeds and never load torch, which costs seconds
# in each of their processes (tasks/runner.py `_pin`), and their runs record no CUDA versions.
NUMPY_STAGES: tuple[str, ...] = ("download", "stats", "preprocess")


def is_params_key(key: str) -> bool:
    """`key` names a key or a section of params.yaml (what `--allow-override` may name)."""
    model: Any = Params
    for part in key.split("."):
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return False
        model = model.model_fields[part].annotation
        # a section may be optional (`applied: AppliedSweep | None`): its model is among the union's
        models = [arg for arg in getattr(model, "__args__", ()) if isinstance(arg, type) and issubclass(arg, BaseModel)]
        model = models[0] if models else model
    return True
