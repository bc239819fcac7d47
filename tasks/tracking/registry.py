"""The MLflow model registry, written by the export stage: the shipped model logged as it is served,
registered as a new version, judged against the champion (tasks/ship/promotion.py), the decision
recorded on the export run, and the version described for people browsing the registry.

Only called after every export gate passed: a failing model is never registered.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

from tasks.core import layout
from tasks.core.config.params import Params
from tasks.core.config.ship import FP32, SHIPPED
from tasks.core.hashing import data_md5, file_digest
from tasks.determinism.threads import resolve
from tasks.tracking.dashboard import describe_version, headline, run_page
from tasks.tracking.store import store_lock, tracking_uri
from tasks.tracking.writers import StageRun

if TYPE_CHECKING:
    from tasks.ship.export import ExportResult
    from tasks.ship.promotion import Promotion

log = logging.getLogger(__name__)

# What tasks/ship/serving.py imports, and the packages around them (docstrings only).
SERVING_MODULES = (
    "tasks/__init__.py",
    "tasks/core/__init__.py",
    "tasks/core/errors.py",
    "tasks/core/atomic.py",
    "tasks/data/__init__.py",
    "tasks/data/images.py",
    "tasks/ship/__init__.py",
    "tasks/ship/onnx_model.py",
    "tasks/ship/serving.py",
)


@dataclass(frozen=True)
class Shipped:
    """What the registry needs of an export (tasks/ship/export.py `ExportResult`): the model that shipped
    as model.onnx, how good it is, and the shape of its input and output."""

    variant: str
    accuracy: float
    fp32_accuracy: float
    input_shape: tuple[int, int, int]
    num_classes: int

    @classmethod
    def of(cls, exported: ExportResult) -> Shipped:
        return cls(
            exported.variant, exported.accuracy, exported.fp32_accuracy, exported.input_shape, exported.num_classes
        )

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> Shipped:
        """From `dataclasses.asdict` of one (tasks/tracking/registrar.py's request), its types checked."""
        channels, height, width = (int(n) for n in fields["input_shape"])
        return cls(
            str(fields["variant"]),
            float(fields["accuracy"]),
            float(fields["fp32_accuracy"]),
            (channels, height, width),
            int(fields["num_classes"]),
        )


def register_shipped(params: Params, run: StageRun, exported: Shipped) -> str:
    """Log the fp32 ONNX model (onnx flavour) and the shipped one behind the image-bytes wrapper
    (tasks/ship/serving.py), register the latter, decide champion/challenger on the same test images
    (tasks/ship/promotion.py), record the decision on the run and describe the version; the verdict."""
    # heavy: numpy and onnxruntime (the champion is scored), only when a model is registered
    from tasks.data.preprocess import load_split
    from tasks.ship.promotion import decide_promotion

    # MLflow draws a "Downloading artifacts" bar for each single file it copies here (the ONNX file into
    # the logged model, the champion out of the registry): console noise for an event the stage reports.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    with requirements_taken_as_given():
        info = _log_models(params, run, exported)
    name = params.tracking.registered_model
    version = _new_version(run.mlflow.MlflowClient(), name, info, run.run_id)
    promotion = decide_promotion(
        run.mlflow.MlflowClient(),
        name,
        version,
        layout.EXPORT_DIR / SHIPPED,
        load_split(layout.PREPROCESSED_DIR, "test", stream=True),
        exported.accuracy,
        params.promotion,
        lock=store_lock(tracking_uri(), "promotion"),  # two exports at once take turns (dvc queue -j 2)
    )
    _record_promotion(run, promotion, params)
    _describe_version(run, params, exported)
    return promotion.verdict


def _describe_version(run: StageRun, params: Params, exported: Shipped) -> None:
    """The registered version's description: what shipped, how good, small and fast it is, the
    promotion verdict, and links to its model card and to the export, pipeline and train runs."""
    client = run.mlflow.MlflowClient()
    export = client.get_run(run.run_id)
    tags, experiment = export.data.tags, export.info.experiment_id

    def link(text: str, run_id: str | None, path: str = "") -> str:
        return f"[{text}]({run_page(experiment, run_id, path)})" if run_id else ""

    weights = file_digest(layout.TRAIN_DIR / "best.safetensors")
    trained = client.search_runs(
        [experiment], filter_string=f"tags.`weights.best_sha256` = '{weights}'", max_results=1
    )  # the newest train run of these weights: another execution's when DVC skipped train
    numbers = headline().metrics
    size = f", {numbers['shipped_size_bytes'] / 1024:.0f} KiB" if "shipped_size_bytes" in numbers else ""
    speed = f", {numbers['shipped_latency_b1_ms']:.2f} ms per image" if "shipped_latency_b1_ms" in numbers else ""
    runs = [
        link("model card", run.run_id, "/artifacts/model_card.md"),
        link("export run", run.run_id),
        link("pipeline run", tags.get("mlflow.parentRunId")),
        link("train run", trained[0].info.run_id if trained else None),
    ]
    describe_version(
        client,
        params.tracking.registered_model,
        tags["registry.version"],
        [
            f"**{exported.variant}** (ONNX), test accuracy {exported.accuracy:.4f} "
            f"(fp32 {exported.fp32_accuracy:.4f}){size}{speed}; data md5 {data_md5()}.",
            tags.get("registry.verdict", ""),
            " · ".join(r for r in runs if r),
        ],
    )


@contextmanager
def requirements_taken_as_given() -> Iterator[None]:
    """MLflow's check of a logged model's requirements against this environment, skipped for the block.

    To warn of a mismatch, MLflow first maps every installed distribution to its modules (importlib.metadata
    over ~290 of them: 0.8-0.9 s of an export on 2 cores, 2026-12-07), when it saves each model and when it
    loads the served one to try its input example. `_log_models` pins the requirements to the versions
    installed here, so they cannot mismatch; MLflow has no setting to skip the check, so its function is
    replaced, in the two modules that call it, for the block only."""
    # heavy: MLflow (~2 s), already loaded by the export run that logs the models
    import mlflow.pyfunc
    import mlflow.utils.environment

    with ExitStack() as patches:
        for module in (mlflow.utils.environment, mlflow.pyfunc):
            patches.enter_context(mock.patch.object(module, "warn_dependency_requirement_mismatches", _as_given))
        yield


def _as_given(model_requirements: list[str]) -> None:
    """MLflow's `warn_dependency_requirement_mismatches`, for requirements read off this environment."""


def _log_models(params: Params, run: StageRun, exported: Shipped) -> Any:
    """The fp32 model as it is (a tensor in, logits out) and the shipped one as served; the latter's info."""
    # heavy: numpy, onnx, onnxruntime and mlflow: only when a model is registered
    import numpy as np
    import onnx
    import onnxruntime as ort
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, Schema, TensorSpec

    from tasks.ship.onnx_model import INPUT, OUTPUT

    # What serving needs, pinned to what was measured here (MLflow adds itself). Left to infer them,
    # MLflow would record the whole project lock (`uv export`: torch, Prefect, DVC...), slowly.
    requirements = [f"onnxruntime=={ort.__version__}", f"onnx=={onnx.__version__}", f"numpy=={np.__version__}"]
    run.mlflow.onnx.log_model(
        onnx.load(str(layout.EXPORT_DIR / FP32)),
        name="model_fp32",
        save_as_external_data=False,
        signature=ModelSignature(
            inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, *exported.input_shape), INPUT)]),
            outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, exported.num_classes), OUTPUT)]),
        ),
        pip_requirements=requirements,
        # the CPU provider, which every onnxruntime build has (MLflow's default lists CUDA first, and
        # warns on every load where this build lacks it)
        onnx_execution_providers=["CPUExecutionProvider"],
    )
    served = [(DataType.string, "class"), (DataType.double, "probability"), (DataType.string, "top_k")]
    with tempfile.TemporaryDirectory() as code:
        return run.mlflow.pyfunc.log_model(
            name="model",
            python_model=str(layout.ROOT / "tasks/ship/serving.py"),  # models from code: no pickle
            artifacts={"onnx": str(layout.EXPORT_DIR / SHIPPED)},
            code_paths=[str(_serving_code(Path(code)))],
            model_config={
                "threads": resolve(params.determinism.num_threads),
                "max_pixels": params.data.max_image_pixels,
            },
            signature=ModelSignature(
                inputs=Schema([ColSpec(DataType.binary, "image")]), outputs=Schema([ColSpec(t, c) for t, c in served])
            ),
            pip_requirements=[*requirements, "pandas", "pillow"],
            input_example=_black_image(exported.input_shape),  # MLflow serves it once, here: a smoke test
        )


def _black_image(shape: tuple[int, int, int]) -> Any:
    """One black PNG of the model's size, as the served model's request column holds it."""
    # heavy: numpy, pandas (~1 s) and PIL, only when the input example is written
    import numpy as np
    import pandas as pd
    from PIL import Image

    channels, height, width = shape
    pixels = np.zeros((height, width, channels), np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels[:, :, 0] if channels == 1 else pixels).save(buffer, format="PNG")
    return pd.DataFrame({"image": [buffer.getvalue()]})


def _serving_code(folder: Path) -> Path:
    """The `tasks` modules the served model imports, as a package of their own to log with it (not
    the whole project: a model's code is what it runs)."""
    for module in SERVING_MODULES:
        target = folder / module
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(layout.ROOT / module, target)
    return folder / "tasks"


def _new_version(client: Any, name: str, info: Any, run_id: str) -> str:
    """Register the logged model as a new version of `name` (created on first use) through the client,
    which, unlike `mlflow.register_model`, does not print to the console what the pipeline reports."""
    # heavy: mlflow (~4 s), only when a model is registered
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":  # (the usual case: an earlier export made it)
            raise
    created = client.create_model_version(name, info.model_uri, run_id=run_id, model_id=info.model_id)
    return str(created.version)


def _record_promotion(run: StageRun, promotion: Promotion, params: Params) -> None:
    """The decision and its numbers on the export run (the version's own tags are the registry's)."""
    log.info("registry: %s", promotion.verdict)
    run.set_tags(
        {
            "registry.model": promotion.name,
            "registry.version": promotion.version,
            "registry.decision": "promoted to champion" if promotion.promoted else "kept current champion",
            "registry.champion_version_before": promotion.champion_version or "none",
            "registry.verdict": promotion.verdict,
            "registry.test_split_sha256": promotion.test_split_sha256,
            **{f"promotion.{key}": value for key, value in params.promotion.model_dump().items()},
        }
    )
    run.log_metrics({"registry.challenger_accuracy": promotion.accuracy})
    if promotion.paired is not None:
        paired = promotion.paired
        run.log_metrics(
            {
                "registry.paired_challenger_accuracy": paired.challenger_accuracy,
                "registry.champion_accuracy": paired.champion_accuracy,
                "registry.margin": paired.margin,
                "registry.mcnemar_p": paired.p_value,
            }
        )
