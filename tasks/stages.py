"""The thin wrappers: each stage's file I/O and MLflow logging around its public function.

`run_stage` is what both entry points call — `python -m tasks <stage>` (the command in dvc.yaml)
and the Prefect flow's tasks — so a stage behaves the same whichever ran it.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tasks.core import layout
from tasks.core.atomic import write_text
from tasks.core.config.params import Params
from tasks.core.hashing import data_md5, file_digest
from tasks.determinism.fingerprint import fingerprint
from tasks.determinism.pinning import pin_everything
from tasks.tracking.dashboard import log_dataset
from tasks.tracking.runs import StageRun, lineage_tags, stage_run, store_lock, tracking_uri

if TYPE_CHECKING:
    from tasks.data.checks import Report
    from tasks.ship.export import ExportResult
    from tasks.ship.registry import Promotion
    from tasks.train.stage import TrainResult

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


def track_data_with_dvc() -> None:
    """`dvc add data`: snapshot the raw data in DVC's cache and (re)write data.dvc."""
    from dvc.repo import Repo

    from tasks.core.cli import dvc_logs_once

    dvc_logs_once()
    with Repo(str(layout.ROOT)) as repo:
        repo.add(str(layout.DATA_DIR))


def _download(params: Params, run: StageRun) -> dict[str, float]:
    from tasks.data.checks import read_profile, refuse_if_failed, run_checks
    from tasks.data.download import download
    from tasks.data.formats import RawSnapshot

    checked: list[Report] = []

    def check(snapshot: RawSnapshot) -> None:  # before the new snapshot replaces data/
        trained = read_profile(layout.TRAINED_PROFILE)
        checked.append(run_checks(snapshot, params.data, params.checks, params.split, params.seed, trained))
        refuse_if_failed(checked[-1])

    try:
        result = download(params.data, layout.DATA_DIR, layout.download_cache(), check=check)
    finally:  # a refused snapshot's report is what the person on call reads
        if checked:
            _record_checks(checked[-1], run)
    track_data_with_dvc()
    receipt = {**asdict(result), "data_md5": data_md5()}
    write_text(layout.DOWNLOAD_RECEIPT, json.dumps(receipt, indent=2) + "\n")
    write_text(layout.DATA_PROFILE, json.dumps(asdict(checked[-1].profile), indent=2) + "\n")
    for path in (layout.DOWNLOAD_RECEIPT, layout.DATA_DVC, layout.DATA_PROFILE):
        run.log_artifact(path)
    return {"num_images": result.num_images, "num_classes": result.num_classes}


def _record_checks(report: Report, run: StageRun) -> None:
    write_text(layout.CHECKS_REPORT, json.dumps(report.as_json(), indent=2) + "\n")
    run.log_artifact(layout.CHECKS_REPORT, "checks")
    run.log_metrics(report.metrics())
    verdict = "refused" if report.refused else "passed with warnings" if report.warnings else "passed"
    run.set_tags({"checks.verdict": verdict, "checks.failed": ", ".join(c.name for c in report.refused) or "none"})
    for warning in report.warnings:
        log.warning("data check %s: %s", warning.name, warning.detail)
    for note in report.notes:
        log.info("data checks: %s", note)


def _stats(params: Params, run: StageRun) -> dict[str, float]:
    from tasks.data.stats import compute_stats

    stats = compute_stats(layout.DATA_DIR, params.split, params.seed, params.stats.chunk_size)
    write_text(layout.STATS_FILE, json.dumps(asdict(stats), indent=2) + "\n")
    run.log_artifact(layout.STATS_FILE)
    metrics = {f"mean_{c}": m for c, m in enumerate(stats.mean)}
    return {**metrics, **{f"std_{c}": s for c, s in enumerate(stats.std)}, "num_images": stats.num_images}


def _preprocess(params: Params, run: StageRun) -> dict[str, float]:
    from tasks.data.preprocess import preprocess
    from tasks.data.stats import ChannelStats

    stats = ChannelStats(**json.loads(layout.STATS_FILE.read_text()))
    result = preprocess(layout.DATA_DIR, stats, params.split, params.seed, layout.PREPROCESSED_DIR)
    run.log_artifact(layout.PREPROCESSED_DIR / "meta.json", "preprocessed")
    return {f"num_{name}": size for name, size in result.split_sizes.items()}


def _train(params: Params, run: StageRun) -> dict[str, float]:
    if params.train.strategy == "ddp":
        from tasks.train.launcher import launch

        result = launch(params)
        run.log_history(json.loads((layout.TRAIN_DIR / "history.json").read_text()))  # rank 0 wrote it
    else:
        from tasks.train.stage import train

        result = train(
            params.train,
            params.train_seed,
            layout.PREPROCESSED_DIR,
            layout.TRAIN_DIR,
            resume_dir=layout.TRAIN_RESUME_DIR,
            on_epoch=lambda row: run.log_history([row]),
        )
    _record_training(params, run, result, layout.TRAIN_DIR)
    _keep_trained_profile()
    return {"best_epoch": result.best_epoch, "best_val_accuracy": result.best_val_accuracy}


def _record_training(params: Params, run: StageRun, result: TrainResult, out_dir: Path) -> None:
    """The train run's tags, checkpoints and what `python -m tasks.tools.reproduce` rebuilds it from."""
    run.set_tags(
        {
            "device": result.device,
            "train.world_size": result.world_size,
            "train.backend": result.backend,
            "train.amp": result.amp,
            "train.resumed_from_epoch": result.resumed_from_epoch,
            **(result.pretrained or {}),  # pretrained.sha256 / .source (redacted) / .reinitialised
        }
    )
    for name in ("best.safetensors", "last.safetensors", "history.json", "train.json"):
        run.log_artifact(out_dir / name, "checkpoints" if name.endswith(".safetensors") else None)
    # how the registered version that ships these weights finds this run (`_describe_version`)
    run.set_tags({"weights.best_sha256": file_digest(out_dir / "best.safetensors")})
    # What `python -m tasks.tools.reproduce <run id>` rebuilds this run from: the resolved params, the data
    # version and the upstream stages' output hashes. This run must carry them itself: DVC may have
    # skipped preprocess, whose run (with the split params) then belongs to an earlier execution.
    # Staged in a temp dir, not artifacts/train (a DVC output: a stray file would change its hash).
    if run.enabled:
        with tempfile.TemporaryDirectory(prefix="lockstep-train-") as tmp:
            resolved = Path(tmp) / "params.yaml"
            resolved.write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
            for path in (resolved, layout.DATA_DVC, Path("dvc.lock")):  # dvc.lock: absent before the first run
                if path.exists():
                    run.log_artifact(path, "reproduce")
        log_dataset(run.mlflow.MlflowClient(), run.run_id, params)


def train_trial(
    params: Params, out_dir: Path, on_epoch: Callable[[dict[str, float]], None], tags: dict[str, Any]
) -> tuple[TrainResult | None, str | None]:
    """One sweep trial: the train stage with the trial's params (train.seed its own), writing to
    `out_dir` rather than artifacts/train, as a train run nested in the sweep's MLflow run (tracking's
    PARENT_ENV). (result, run id); result None when `on_epoch` pruned it (raised tasks.tools.sweep.Pruned).

    Its run carries what reproduce needs, as the train stage's does: `make reproduce ARGS=<its id>`.
    A failure raises, its run marked FAILED.
    """
    from tasks.tools.sweep import Pruned
    from tasks.train.stage import train

    determinism = pin_everything(
        params.train_seed, params.determinism.num_threads, params.determinism.strict, params.determinism.cpu
    )
    with stage_run("train", params.tracking, {"seed": params.seed, **params.sections("train")}) as run:
        run.set_tags({**{f"determinism.{k}": v for k, v in determinism.items()}, **fingerprint(), **tags})

        def epoch_done(row: dict[str, float]) -> None:
            run.log_history([row])
            on_epoch(row)

        try:
            result = train(params.train, params.train_seed, layout.PREPROCESSED_DIR, out_dir, out_dir, epoch_done)
        except Pruned:
            from tasks.train.resume import RESUME_FILE

            (out_dir / RESUME_FILE).unlink(missing_ok=True)  # a pruned trial is never continued
            run.set_tags({"sweep.state": "pruned"})
            return None, run.run_id
        except BaseException:
            run.set_tags({"sweep.state": "failed"})  # the run is FAILED; the sweep retries or records it
            raise
        _record_training(params, run, result, out_dir)
        run.set_tags({"sweep.state": "complete"})
        run.log_metrics({"best_epoch": result.best_epoch, "best_val_accuracy": result.best_val_accuracy})
        return result, run.run_id


def _keep_trained_profile() -> None:
    """What the next data checks compare a new snapshot with: the data this model was trained on.

    DVC runs train only with the profile in place (a dep); a workspace laid out by hand may lack it.
    """
    if layout.DATA_PROFILE.exists():
        write_text(layout.TRAINED_PROFILE, layout.DATA_PROFILE.read_text())
    else:
        log.warning("%s is missing: the next data checks have no trained snapshot to compare with", layout.DATA_PROFILE)


def _evaluate(params: Params, run: StageRun) -> dict[str, float]:
    from tasks.train.evaluate import evaluate

    result = evaluate(
        params.evaluate, layout.TRAIN_DIR / "best.safetensors", layout.PREPROCESSED_DIR, layout.EVALUATE_DIR
    )
    for name in ("metrics.json", "per_class.json", "predictions.csv", "confusion_matrix.png"):
        run.log_artifact(layout.EVALUATE_DIR / name)
    return {f"test_{k}": v for k, v in result.metrics.items()}


def _compress(params: Params, run: StageRun) -> dict[str, float]:
    from tasks.ship.compress import compress

    result = compress(
        params.compress,
        params.train,
        params.seed,
        params.determinism.num_threads,
        layout.TRAIN_DIR / "best.safetensors",
        layout.PREPROCESSED_DIR,
        layout.COMPRESS_DIR,
    )
    run.set_tags({"compress.runtime": "onnxruntime", "compress.threads": result.threads})
    for name, curve in result.history.items():  # fine-tuning curves, one metric series per variant
        run.log_history(curve, prefix=f"{name}.")
    for name in ("metrics.json", "compression.csv", "compression.md", "finetune.json"):
        run.log_artifact(layout.COMPRESS_DIR / name)
    return {
        f"{row.variant}.{key}": value for row in result.rows for key, value in asdict(row).items() if key != "variant"
    }


def _export(params: Params, run: StageRun) -> dict[str, Any]:
    from tasks.ship.export import CARD, GATES, TORCH_DIR, CardContext, export
    from tasks.train.checkpoints import read_safetensors

    lineage = {k: v for k, v in lineage_tags().items() if k.startswith(("git.", "version."))}
    # the weights fine-tuned from, as the train stage recorded them in the checkpoint
    lineage.update(read_safetensors(layout.TRAIN_DIR / "best.safetensors", tensors=False)[0].get("pretrained") or {})
    # This process's machine: the fingerprint stays out of DVC outputs (train.json), whose hashes must
    # not depend on the machine; the train run's own is on its MLflow run (hw.* tags).
    card = CardContext(
        data_md5=data_md5(), params=params.model_dump(mode="json"), lineage=lineage, machine=fingerprint()
    )
    result = export(
        params.export,
        params.determinism.num_threads,
        layout.TRAIN_DIR / "best.safetensors",
        layout.PREPROCESSED_DIR,
        layout.COMPRESS_DIR,
        layout.EVALUATE_DIR / "metrics.json",
        layout.EXPORT_DIR,
        card,
    )
    for name in (CARD, GATES, *(name for name in result.sha256 if name.startswith(f"{TORCH_DIR}/"))):
        run.log_artifact(layout.EXPORT_DIR / name)
    run.set_tags({f"sha256.{name}": digest for name, digest in result.sha256.items()})
    run.set_tags({"export.shipped_variant": result.variant, "export.fallback_reason": result.fallback_reason or "none"})
    if result.fallback_reason:
        log.warning("export: %s", result.fallback_reason)
    metrics: dict[str, Any] = {"fp32_test_accuracy": result.fp32_accuracy, "test_accuracy": result.accuracy}
    if run.enabled:  # only after every gate passed: a failing model is never registered
        metrics["promotion"] = _register(params, run, result)  # the verdict line, for the flow's notification
        _describe_version(run, params, result)
    return metrics


def _describe_version(run: StageRun, params: Params, exported: ExportResult) -> None:
    """The registered version's description: what shipped, how good, small and fast it is, the
    promotion verdict, and links to its model card and to the export, pipeline and train runs."""
    from tasks.tracking.dashboard import describe_version, headline, run_page

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


def _register(params: Params, run: StageRun, exported: ExportResult) -> str:
    """Log the fp32 ONNX model (onnx flavour) and the shipped one behind the image-bytes wrapper
    (tasks/ship/serving.py), register the latter and decide champion/challenger on the same test images
    (tasks/ship/registry.py); return the verdict."""
    import os

    from tasks.data.preprocess import load_split
    from tasks.ship.export import SHIPPED
    from tasks.ship.registry import decide_promotion

    # MLflow draws a "Downloading artifacts" bar for each single file it copies here (the ONNX file into
    # the logged model, the champion out of the registry): console noise for an event the stage reports.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    info = _log_models(params, run, exported)
    name = params.tracking.registered_model
    version = _new_version(run.mlflow.MlflowClient(), name, info, run.run_id)
    promotion = decide_promotion(
        run.mlflow.MlflowClient(),
        name,
        version,
        layout.EXPORT_DIR / SHIPPED,
        load_split(layout.PREPROCESSED_DIR, "test"),
        exported.accuracy,
        params.promotion,
        lock=store_lock(tracking_uri(), "promotion"),  # two exports at once take turns (dvc queue -j 2)
    )
    _record_promotion(run, promotion, params)
    return promotion.verdict


def _log_models(params: Params, run: StageRun, exported: ExportResult) -> Any:
    """The fp32 model as it is (a tensor in, logits out) and the shipped one as served; the latter's info."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, Schema, TensorSpec

    from tasks.ship.export import FP32, SHIPPED
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
            model_config={"threads": params.determinism.num_threads, "max_pixels": params.data.max_image_pixels},
            signature=ModelSignature(
                inputs=Schema([ColSpec(DataType.binary, "image")]), outputs=Schema([ColSpec(t, c) for t, c in served])
            ),
            pip_requirements=[*requirements, "pandas", "pillow"],
            input_example=_black_image(exported.input_shape),  # MLflow serves it once, here: a smoke test
        )


def _black_image(shape: tuple[int, int, int]) -> Any:
    """One black PNG of the model's size, as the served model's request column holds it."""
    import io

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


_WRAPPERS: dict[str, Callable[[Params, StageRun], dict[str, Any]]] = {
    "download": _download,
    "stats": _stats,
    "preprocess": _preprocess,
    "train": _train,
    "evaluate": _evaluate,
    "compress": _compress,
    "export": _export,
}


def run_stage(name: str, params: Params) -> dict[str, Any]:
    """Pin determinism, open the stage's MLflow run, do the stage; return its summary metrics (and, for
    export, the promotion verdict under "promotion")."""
    seed = params.train_seed if name == "train" else params.seed  # train.seed: a sweep trial's, applied
    determinism = pin_everything(
        seed, params.determinism.num_threads, params.determinism.strict, params.determinism.cpu
    )
    logged = {"seed": params.seed, **params.sections(name)}
    with stage_run(name, params.tracking, logged, pipeline=params) as run:
        run.set_tags({f"determinism.{k}": v for k, v in determinism.items()})
        run.set_tags(fingerprint())
        results = _WRAPPERS[name](params, run)
        run.log_metrics({key: value for key, value in results.items() if isinstance(value, int | float)})
    return results
