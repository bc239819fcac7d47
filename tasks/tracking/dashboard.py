"""What the MLflow UI shows at a glance: MLflow as the training dashboard.

- The experiment is marked as model training (its `mlflow.experimentKind` tag) and carries the
  pipeline's view of its runs table (columns, order); `make ui` opens on that table (tasks/tracking/ui.py).
- Each pipeline (parent) run is named for what it did ("prefect: train→export · data 0c18b2fd"),
  carries the key params and the headline numbers of the pipeline as it stands after the run (test
  accuracy, the shipped variant with its accuracy, size and latency, the registry's decision) and the
  training curves, so that two pipelines compare in the runs table and its charts without opening
  their nested stage runs. The numbers are read from the stages' outputs (`headline`): a run that
  found everything up to date still shows the model it leaves in place.
- The training data is an MLflow dataset input (name, DVC md5 as digest, source) of the pipeline run
  and of the train run: the runs table's Dataset column and the lineage views.
- A registered version's description names what shipped and links the model card and the runs.

`headline` is plain file reading, also used for the console's closing summary (flows/pipeline.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.core import layout
from tasks.core.config.params import STAGES, Params
from tasks.core.hashing import data_md5
from tasks.core.redact import redact

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_VIEW = "custom_model_development"  # the experiment's kind: classic model training, not GenAI
# MLflow 3.17's UI picks its GenAI or its model-training pages with a switch of its own (remembered in
# the browser, `workflowType` in the URL), whatever the experiment's kind (set all the same: MLflow's
# later UI code syncs the switch to it); and its runs table shows no metric or param column until a
# person picks them. So the experiment carries a shared view (MLflow's "share view" state, an
# experiment tag) with the pipeline's columns: `runs_page` links it, and `make ui` gives it to a
# browser that opens the UI at its root (tasks/tracking/ui.py).
VIEW_KEY = "lockstep"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
CURVES = ("train_loss", "val_loss", "train_accuracy", "val_accuracy", "lr")  # history.json's per-epoch series
# What a person compares two pipelines by; every stage run still carries all of its section's params.
KEY_PARAMS = (
    "seed",
    "data.source",
    "train.model",
    "train.epochs",
    "train.batch_size",
    "train.optimizer",
    "train.lr",
    "train.weight_decay",
    "train.strategy",
    "train.amp",
    "determinism.cpu",
    "export.candidates",
)


@dataclass(frozen=True)
class Headline:
    """The pipeline's results as its outputs on disk stand (missing outputs: missing entries)."""

    metrics: dict[str, float] = field(default_factory=dict)
    shipped_variant: str | None = None
    curves: list[dict[str, float]] = field(default_factory=list)
    # what the train stage chose for the keys params.yaml left `auto` (train.json's `recipe`), by key
    recipe: dict[str, Any] = field(default_factory=dict)


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def headline(root: Path = Path(".")) -> Headline:
    """Test accuracy (fp32, evaluate), the shipped variant's accuracy, size and latency (export's
    `shipped` section) and the best validation accuracy (train), from the stages' outputs under `root`."""
    metrics: dict[str, float] = {}
    evaluate = _json(root / layout.EVALUATE_DIR / "metrics.json") or {}
    metrics.update({f"test_{k}": evaluate[k] for k in ("accuracy", "macro_f1") if k in evaluate})
    train = _json(root / layout.TRAIN_DIR / "train.json") or {}
    metrics.update({k: train[k] for k in ("best_val_accuracy", "best_epoch") if k in train})
    gates = _json(root / layout.EXPORT_DIR / "gates.json") or {}
    shipped = gates.get("shipped", {})
    metrics.update({f"shipped_{'test_' if k == 'accuracy' else ''}{k}": v for k, v in shipped.items()})
    variant = gates.get("variant")
    curves = _json(root / layout.TRAIN_DIR / "history.json") or []
    recipe = {key: choice["value"] for key, choice in train.get("recipe", {}).items()}
    return Headline({k: float(v) for k, v in metrics.items()}, variant, curves, recipe)


def run_name(entry_point: str, stages_run: list[str], data_md5: str) -> str:
    """e.g. "prefect: all stages · data 0c18b2fd", "dvc: train→export · data 0c18b2fd"."""
    ran = [s for s in STAGES if s in stages_run]
    if not ran:
        what = "nothing stale"
    elif ran == list(STAGES):
        what = "all stages"
    elif ran == list(STAGES[STAGES.index(ran[0]) : STAGES.index(ran[-1]) + 1]) and len(ran) > 1:
        what = f"{ran[0]}→{ran[-1]}"
    else:
        what = ", ".join(ran)
    return f"{entry_point}: {what} · data {data_md5[:8]}"


# The query that opens any page of the UI in its model-training pages (without it a run page opens
# in the GenAI ones, whatever the runs table was in).
TRAINING_PAGES = "workflowType=machine_learning"


def runs_page(base_url: str, experiment_id: str) -> str:
    """The experiment's runs table in the model-training pages, with the pipeline's columns."""
    return f"{base_url}/#/experiments/{experiment_id}/runs?viewStateShareKey={VIEW_KEY}&{TRAINING_PAGES}"


def run_page(experiment_id: str, run_id: str, path: str = "") -> str:
    """A run's page (`path`: one of its tabs or artifacts) in the model-training pages, relative to the UI."""
    return f"#/experiments/{experiment_id}/runs/{run_id}{path}?{TRAINING_PAGES}"


def _view_state() -> str:
    """The shared view: the Dataset column, headline metrics, the main params and what shipped, newest
    first (few enough columns to read on one screen; "Columns" adds the others)."""
    metrics = ("test_accuracy", "shipped_test_accuracy", "shipped_size_bytes", "shipped_latency_b1_ms")
    columns = [
        "attributes.`Dataset`",
        *(f"metrics.`{key}`" for key in metrics),
        *(
            f"params.`{key}`"
            for key in ("data.source", "train.model", "train.epochs", "auto.train.epochs", "train.lr", "auto.train.lr")
        ),
        "tags.`export.shipped_variant`",
        "tags.`registry.version`",
    ]
    return json.dumps({"selectedColumns": columns, "orderByKey": "attributes.start_time", "orderByAsc": False})


def key_params(params: Params) -> dict[str, Any]:
    flat = {**params.sections("train"), **params.sections("export"), "data.source": params.data.source}
    return {key: flat[key] for key in KEY_PARAMS if key in flat}


# --------------------------------------------------------------------------- MLflow (the edge)


def ensure_training_view(client: Any, experiment: Any) -> None:
    """Mark `experiment` as model training (unless someone chose another kind for it) and give it the
    pipeline's shared view of its runs table (`runs_page`)."""
    if EXPERIMENT_KIND_TAG not in experiment.tags:
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_VIEW)
    if experiment.tags.get(VIEW_TAG) != _view_state():
        client.set_experiment_tag(experiment.experiment_id, VIEW_TAG, _view_state())


@dataclass(frozen=True)
class PipelineRecord:
    """What a pipeline run gets when a stage or the pipeline ends (`pipeline_record`)."""

    name: str
    metrics: list[tuple[str, float, int, int]] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)


def pipeline_record(
    entry_point: str,
    by_stage: dict[str | None, dict[str, str]],
    logged: tuple[dict[str, float], dict[str, str]],
    finished: bool,
) -> PipelineRecord:
    """The pipeline run's name for what it did (its stage runs' tags `by_stage`); when it finished, its
    headline numbers and curves that differ from the metrics and params `logged` so far, what shipped,
    the registry decision of the export it ran and what `auto` became (`recipe_params`; the others are
    logged when it starts)."""
    name = run_name(entry_point, [stage for stage in by_stage if stage], data_md5())
    if not finished:
        return PipelineRecord(name)
    result = headline()
    metrics = headline_metrics(result, logged[0], int(time.time() * 1000))
    tags = {"export.shipped_variant": result.shipped_variant or "none"}
    export = by_stage.get("export")
    if export is not None:  # this run registered a version: which, and what was decided
        tags |= {k: v for k, v in export.items() if k in ("registry.version", "registry.decision")}
    # A param is logged once, so only the recipe this run trained with, or (nothing ran) the one on disk:
    # an earlier stage of a DVC session would log the previous run's, which its own train cannot replace.
    params = {}
    if "train" in by_stage or not by_stage:
        params = {k: v for k, v in recipe_params(result).items() if k not in logged[1]}
    return PipelineRecord(name, metrics, {k: redact(str(v)) for k, v in tags.items()}, params)


def record_pipeline(client: Any, run_id: str, entry_point: str, params: Params, finished: bool) -> None:
    """`pipeline_record`, written with MLflow's client, and the data the pipeline trained on."""
    run = client.get_run(run_id)
    children = client.search_runs(
        [run.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'", max_results=100
    )
    by_stage = {c.data.tags.get("lockstep.stage"): c.data.tags for c in children}
    record = pipeline_record(entry_point, by_stage, (run.data.metrics, run.data.params), finished)
    client.update_run(run_id, name=record.name)
    if not finished:
        return
    # heavy: mlflow (~4 s), only when a run is logged; the no-op path never loads it
    from mlflow.entities import Metric, Param, RunTag

    metrics = [Metric(*m) for m in record.metrics]
    for start in range(0, len(metrics), 1000):  # MLflow's limit per batch
        client.log_batch(run_id, metrics=metrics[start : start + 1000])
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in record.tags.items()])
    if record.params:
        client.log_batch(run_id, params=[Param(k, v) for k, v in record.params.items()])
    log_dataset(client, run_id, params)


def headline_metrics(result: Headline, logged: dict[str, float], now: int) -> list[tuple[str, float, int, int]]:
    """(key, value, timestamp, step) of `result`'s numbers and curves that differ from those `logged`.
    A DVC session's run is recorded after each of its stages: only what changed is logged again."""
    metrics = [(k, v, now, 0) for k, v in result.metrics.items() if logged.get(k) != v]
    last = result.curves[-1] if result.curves else {}
    if any(logged.get(k) != float(last[k]) for k in CURVES if k in last):
        metrics += [(k, float(row[k]), now, int(row["epoch"])) for row in result.curves for k in CURVES if k in row]
    return metrics


def recipe_params(result: Headline) -> dict[str, str]:
    """What the train stage chose for the keys params.yaml left `auto`, as the pipeline run's params
    (`train.epochs` was logged as written, `auto`, and a logged param never changes); the train stage's
    run has each reason too."""
    return {f"auto.train.{key}": str(value) for key, value in result.recipe.items()}


def shown_params(params: Params) -> dict[str, str]:
    """The pipeline run's key params as logged (lists as JSON), secrets masked."""
    shown = {k: json.dumps(list(v)) if isinstance(v, list | tuple) else str(v) for k, v in key_params(params).items()}
    return {k: redact(v) for k, v in shown.items()}


def start_pipeline(client: Any, run_id: str, params: Params) -> None:
    """The pipeline run's key params (its data is known once download has run: `record_pipeline`)."""
    # heavy: mlflow (~4 s), only when a run is logged; the no-op path never loads it
    from mlflow.entities import Param

    client.log_batch(run_id, params=[Param(k, v) for k, v in shown_params(params).items()])


def log_dataset(client: Any, run_id: str, params: Params) -> None:
    """data/ as the MLflow dataset the run trained on: DVC's md5 is its digest (one per snapshot)."""
    # heavy: numpy and mlflow (~4 s), only when a dataset is logged; the no-op path never loads them
    import numpy as np
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.types import Schema, TensorSpec

    md5 = data_md5()
    if md5 == "none":  # before the first download: nothing to name yet
        return
    receipt = _json(layout.DOWNLOAD_RECEIPT) or {}
    shape = receipt.get("image_shape")
    schema = None
    if shape:
        schema = Schema(
            [TensorSpec(np.dtype(np.uint8), (-1, *shape), "image"), TensorSpec(np.dtype(np.int64), (-1,), "label")]
        )
    dataset = MetaDataset(_source(params), name=dataset_name(params), digest=md5.removesuffix(".dir"), schema=schema)
    context = InputTag("mlflow.data.context", "training")
    client.log_inputs(run_id, datasets=[DatasetInput(dataset._to_mlflow_entity(), tags=[context])])


def dataset_name(params: Params) -> str:
    data = params.data
    if data.source != "imagefolder":
        return data.source
    origin = data.url or str(data.path or "")
    return f"imagefolder:{Path(origin.split('?')[0].rstrip('/')).name or 'images'}"


def _source(params: Params) -> Any:
    """Where the snapshot came from: the archive URL or folder of an image folder, the mirror, else
    the project's data/ (a built-in source read from a package or its published files)."""
    # heavy: mlflow (~4 s), only when a dataset is logged; the no-op path never loads it
    from mlflow.data import get_registered_sources
    from mlflow.data.http_dataset_source import HTTPDatasetSource

    data = params.data
    url = data.url or data.mirror
    if url:
        return HTTPDatasetSource(redact(url))
    # MLflow makes its local-file source class at import time; it is found by its type
    local = next(source for source in get_registered_sources() if source._get_source_type() == "local")
    if data.source == "imagefolder" and data.path:
        return local(str(Path(data.path).resolve()))
    return local(str((Path.cwd() / layout.DATA_DIR).resolve()))


def describe_version(client: Any, name: str, version: str, lines: list[str]) -> None:
    """The registered version's description (Markdown, shown on its page in the UI)."""
    client.update_model_version(name, version, description=redact("\n\n".join(lines)))
