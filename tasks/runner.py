"""The thin wrappers: each stage's file I/O and MLflow logging around its public function.

`run_stage` is what both entry points call — `python -m tasks <stage>` (the command in dvc.yaml)
and the Prefect flow's tasks — so a stage behaves the same whichever ran it.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tasks.core import layout
from tasks.core.atomic import write_text
from tasks.core.cli import dvc_logs_once
from tasks.core.config.params import NUMPY_STAGES, Params
from tasks.core.hashing import data_md5, file_digest
from tasks.determinism.bootstrap import start
from tasks.determinism.fingerprint import fingerprint
from tasks.determinism.threads import resolve
from tasks.tools.sweep.trials import Pruned
from tasks.tracking import registrar
from tasks.tracking.lineage import lineage_tags
from tasks.tracking.registry import Shipped
from tasks.tracking.runs import stage_run
from tasks.tracking.writers import StageRun
from tasks.train.launcher import launch

if TYPE_CHECKING:
    from tasks.data.checks import Report
    from tasks.train.stage import TrainResult

log = logging.getLogger(__name__)


def track_data_with_dvc() -> None:
    """`dvc add data`: snapshot the raw data in DVC's cache and (re)write data.dvc."""
    # heavy: dvc (~0.7 s), only when the data is snapshotted
    from dvc.repo import Repo

    dvc_logs_once()
    with Repo(str(layout.ROOT)) as repo:
        repo.add(str(layout.DATA_DIR))


def _download(params: Params, run: StageRun) -> dict[str, float]:
    # per stage: each stage loads only its own libraries (numpy here, ~0.3 s; torch for train, ~4 s)
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
    # per stage: each stage loads only its own libraries (numpy here; torch for train)
    from tasks.data.stats import compute_stats

    stats = compute_stats(layout.DATA_DIR, params.split, params.seed, params.stats.chunk_size)
    write_text(layout.STATS_FILE, json.dumps(asdict(stats), indent=2) + "\n")
    run.log_artifact(layout.STATS_FILE)
    metrics = {f"mean_{c}": m for c, m in enumerate(stats.mean)}
    return {**metrics, **{f"std_{c}": s for c, s in enumerate(stats.std)}, "num_images": stats.num_images}


def _preprocess(params: Params, run: StageRun) -> dict[str, float]:
    # per stage: each stage loads only its own libraries (numpy here; torch for train)
    from tasks.data.preprocess import preprocess
    from tasks.data.stats import ChannelStats

    stats = ChannelStats(**json.loads(layout.STATS_FILE.read_text()))
    result = preprocess(layout.DATA_DIR, stats, params.split, params.seed, layout.PREPROCESSED_DIR)
    run.log_artifact(layout.PREPROCESSED_DIR / "meta.json", "preprocessed")
    return {f"num_{name}": size for name, size in result.split_sizes.items()}


def _train(params: Params, run: StageRun) -> dict[str, float]:
    if params.train.strategy == "ddp":
        result = launch(params)
        run.log_history(json.loads((layout.TRAIN_DIR / "history.json").read_text()))  # rank 0 wrote it
    else:
        # per stage: tasks.train.stage loads torch (~4 s), only when train runs in this process
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
    # What `auto` chose from the data, beside the `train.*` params that say auto (a logged param is never
    # changed): the value and why, as train.json has them.
    chosen: dict[str, Any] = {}
    for key, choice in result.recipe.items():
        chosen |= {f"auto.train.{key}": choice["value"], f"auto.train.{key}.reason": choice["reason"]}
    tags = {
        "device": result.device,
        "train.world_size": result.world_size,
        "train.backend": result.backend,
        "train.amp": result.amp,
        "train.resumed_from_epoch": result.resumed_from_epoch,
        **(result.pretrained or {}),  # pretrained.sha256 / .source (redacted) / .reinitialised
        # how the registered version that ships these weights finds this run (`_describe_version`)
        "weights.best_sha256": file_digest(out_dir / "best.safetensors"),
    }
    run.record(chosen, tags)
    for name in ("best.safetensors", "last.safetensors", "history.json", "train.json"):
        run.log_artifact(out_dir / name, "checkpoints" if name.endswith(".safetensors") else None)
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
        run.log_dataset(params)


def train_trial(
    params: Params, out_dir: Path, on_epoch: Callable[[dict[str, float]], None], tags: dict[str, Any]
) -> tuple[TrainResult | None, str | None]:
    """One sweep trial: the train stage with the trial's params (train.seed its own), writing to
    `out_dir` rather than artifacts/train, as a train run nested in the sweep's MLflow run (tracking's
    PARENT_ENV). (result, run id); result None when `on_epoch` pruned it (raised tasks.tools.sweep.trials.Pruned).

    Its run carries what reproduce needs, as the train stage's does: `make reproduce ARGS=<its id>`.
    A failure raises, its run marked FAILED.
    """
    # per stage: tasks.train.stage loads torch (~4 s), only when a trial trains
    from tasks.train.stage import train

    pinned = _pin("train", params)
    logged = {"seed": params.seed, **params.sections("train")}
    with stage_run("train", params.tracking, logged, tags={**pinned, **tags}) as run:

        def epoch_done(row: dict[str, float]) -> None:
            run.log_history([row])
            on_epoch(row)

        try:
            result = train(params.train, params.train_seed, layout.PREPROCESSED_DIR, out_dir, out_dir, epoch_done)
        except Pruned:
            # per stage: tasks.train.resume loads torch, loaded by now; at the top it would load for every stage
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
    # per stage: tasks.train.evaluate loads torch (~4 s), only when evaluate runs
    from tasks.train.evaluate import evaluate

    result = evaluate(
        params.evaluate, layout.TRAIN_DIR / "best.safetensors", layout.PREPROCESSED_DIR, layout.EVALUATE_DIR
    )
    for name in ("metrics.json", "per_class.json", "predictions.csv", "confusion_matrix.png"):
        run.log_artifact(layout.EVALUATE_DIR / name)
    return {f"test_{k}": v for k, v in result.metrics.items()}


def _compress(params: Params, run: StageRun) -> dict[str, float]:
    # per stage: tasks.ship.compress loads torch and onnx (~4 s), only when compress runs
    from tasks.ship.compress import compress

    result = compress(
        params.compress,
        params.train,
        params.seed,
        resolve(params.determinism.num_threads),
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
    # per stage: tasks.ship.export loads torch and onnx (~4 s), only when export runs
    from tasks.ship.export import CARD, GATES, TORCH_DIR, CardContext, export
    from tasks.train.checkpoints import read_safetensors

    lineage = {k: v for k, v in lineage_tags(torch=True).items() if k.startswith(("git.", "version."))}
    # the weights fine-tuned from, as the train stage recorded them in the checkpoint
    lineage.update(read_safetensors(layout.TRAIN_DIR / "best.safetensors", tensors=False)[0].get("pretrained") or {})
    # This process's machine: the fingerprint stays out of DVC outputs (train.json), whose hashes must
    # not depend on the machine; the train run's own is on its MLflow run (hw.* tags).
    trained = json.loads((layout.TRAIN_DIR / "train.json").read_text())
    card = CardContext(
        data_md5=data_md5(),
        params=params.model_dump(mode="json"),
        lineage=lineage,
        machine=fingerprint(),
        auto=trained.get("recipe", {}),  # absent from a train.json of an earlier release
    )
    result = export(
        params.export,
        resolve(params.determinism.num_threads),
        layout.TRAIN_DIR / "best.safetensors",
        layout.PREPROCESSED_DIR,
        layout.COMPRESS_DIR,
        layout.EVALUATE_DIR / "metrics.json",
        layout.EXPORT_DIR,
        card,
    )
    for name in (CARD, GATES, *(name for name in result.sha256 if name.startswith(f"{TORCH_DIR}/"))):
        run.log_artifact(layout.EXPORT_DIR / name)
    run.set_tags(
        {
            **{f"sha256.{name}": digest for name, digest in result.sha256.items()},
            "export.shipped_variant": result.variant,
            "export.fallback_reason": result.fallback_reason or "none",
        }
    )
    if result.fallback_reason:
        log.warning("export: %s", result.fallback_reason)
    metrics: dict[str, Any] = {"fp32_test_accuracy": result.fp32_accuracy, "test_accuracy": result.accuracy}
    if run.enabled:  # only after every gate passed: a failing model is never registered
        # the verdict, for the flow's notification; through the flow's helper where it started one
        metrics["promotion"] = registrar.register(params, run, Shipped.of(result))
    return metrics


_WRAPPERS: dict[str, Callable[[Params, StageRun], dict[str, Any]]] = {
    "download": _download,
    "stats": _stats,
    "preprocess": _preprocess,
    "train": _train,
    "evaluate": _evaluate,
    "compress": _compress,
    "export": _export,
}


def _pin(stage: str, params: Params) -> dict[str, Any]:
    """Pin every source of randomness `stage` computes with; the tags that record it (`determinism.*`,
    and the machine's `hw.*` fingerprint)."""
    if stage in NUMPY_STAGES:
        # (the mode numpy's OpenBLAS was started in: the data stages make no BLAS call, so not a dep)
        pinned = start(params.seed, params.determinism.num_threads, cpu=params.determinism.cpu, torch=False)
        machine = fingerprint(with_torch=False)
    else:
        seed = params.train_seed if stage == "train" else params.seed  # train.seed: a sweep trial's, applied
        d = params.determinism
        pinned, machine = start(seed, d.num_threads, strict=d.strict, cpu=d.cpu), fingerprint()  # loads torch
    return {**{f"determinism.{k}": v for k, v in pinned.items()}, **machine}


def run_stage(name: str, params: Params) -> dict[str, Any]:
    """Pin determinism, open the stage's MLflow run, do the stage; return its summary metrics (and, for
    export, the promotion verdict under "promotion")."""
    pinned = _pin(name, params)
    logged = {"seed": params.seed, **params.sections(name)}
    with stage_run(name, params.tracking, logged, pipeline=params, tags=pinned) as run:
        results = _WRAPPERS[name](params, run)
        run.log_metrics({key: value for key, value in results.items() if isinstance(value, int | float)})
    return results
