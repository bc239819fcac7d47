"""The shipping sections: `compress`, `export` and `promotion`; and two registries (tasks/core/registry.py):
`COMPRESSION_VARIANTS`, what `compress.variants` names (tasks/ship/compress.py builds them), and
`EXPORT_FORMATS`, what `export.formats` names (tasks/ship/formats.py writes them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from tasks.core.config.base import (
    MAX_BATCH,
    MAX_EPOCHS,
    MAX_LR,
    Section,
)
from tasks.core.registry import Registry


@dataclass(frozen=True)
class CompressionVariant:
    """A `compress.variants` value (tasks/ship/compress.py registers how it is built under the same name):
    a smaller model, written as `artifacts/compress/models/<name>.onnx` and measured beside fp32."""

    summary: str  # how it is made, for the docs' table


COMPRESSION_VARIANTS: Registry[CompressionVariant] = Registry(
    "compress.variants",
    {
        "dynamic_int8": CompressionVariant(
            "ONNX Runtime `quantize_dynamic` (int8 weights, activations quantized at run time)"
        ),
        "static_int8": CompressionVariant(
            "ONNX Runtime `quantize_static`: QDQ, per-channel int8 weights, activations calibrated (MinMax) on "
            "`calibration_size` training images drawn with `seed`"
        ),
        "qat_int8": CompressionVariant(
            "torchao pt2e quantization-aware fine-tuning (`qat_epochs`), converted and exported as QDQ ONNX"
        ),
        "pruned_l1": CompressionVariant(
            "global unstructured L1 pruning of `prune_amount` of the conv/linear weights, fine-tuned with the "
            "mask held, made permanent"
        ),
        "pruned_ln": CompressionVariant(
            "structured: `prune_channels` of each conv's output channels with the smallest L-`prune_norm` norm "
            "removed (torch-pruning), fine-tuned"
        ),
    },
)
VariantName = COMPRESSION_VARIANTS.named()


class CompressConfig(Section):
    """Which smaller models the compress stage builds from the best checkpoint, and how it measures them."""

    # auto: the variants export.candidates may ship, resolved by Params (`for_candidates`): the others
    # fine-tune for epochs only to fill the comparison table. all: every variant, in the registry's
    # order: that table.
    # A CompressConfig made alone keeps `auto` until `for_candidates`; `all` becomes the list here.
    variants: Annotated[tuple[VariantName, ...], Field(strict=False)] | Literal["auto", "all"] = "auto"
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
    def _all_or_unique(cls, value: tuple[str, ...] | str) -> tuple[str, ...] | str:
        if value == "all":
            return COMPRESSION_VARIANTS.names()
        if isinstance(value, tuple) and len(set(value)) != len(value):
            raise ValueError(f"lists a variant twice: {list(value)}")
        return value

    def for_candidates(self, candidates: Sequence[str]) -> CompressConfig:
        """This config with `auto` variants replaced by `candidates` less fp32 (always built, as the reference)."""
        if self.variants != "auto":
            return self
        return self.model_copy(update={"variants": tuple(name for name in candidates if name != "fp32")})


@dataclass(frozen=True)
class ExportFormat:
    """An `export.formats` value: the fp32 model in one more format, beside `model.onnx` (tasks/ship/formats.py
    registers how it is written and read back for its parity gate under the same name)."""

    summary: str  # for the docs' table
    file: str  # where it is written, under artifacts/export/
    label: str  # how its parity gate names it


EXPORT_FORMATS: Registry[ExportFormat] = Registry(
    "export.formats",
    {
        "onnx": ExportFormat(
            "fp32 ONNX (required: what int8 candidates are made from and compared with)", "model_fp32.onnx", "fp32 ONNX"
        ),
        "pt2": ExportFormat("`torch.export` program, the current PyTorch format", "torch/model.pt2", ".pt2"),
        "torchscript": ExportFormat(
            "TorchScript (deprecated in torch; its bytes are not reproducible: the archive carries a random id)",
            "torch/model.torchscript.pt",
            "TorchScript",
        ),
    },
)
FormatName = EXPORT_FORMATS.named()
# the exported model's files (tasks/ship/export.py writes them, tasks/tracking/registry.py logs them)
SHIPPED, FP32 = "model.onnx", EXPORT_FORMATS["onnx"].file
VariantOrFp32 = COMPRESSION_VARIANTS.named("fp32")


class ExportConfig(Section):
    """What ships, and the gates it must pass first (tasks/ship/export.py)."""

    # tried in order; the first that passes its gates ships as model.onnx. fp32, if listed, comes last:
    # it has no gates of its own, so nothing after it could ever be tried.
    candidates: tuple[VariantOrFp32, ...] = Field(("static_int8", "fp32"), min_length=1, strict=False)
    formats: tuple[FormatName, ...] = Field(("onnx", "pt2"), min_length=1, strict=False)
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


class PromotionConfig(Section):
    """How a new model version is judged against the champion (tasks/ship/promotion.py), on the same test
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
