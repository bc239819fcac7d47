"""Compress and export: the variants, their measurements, the gates, the registry and the model card,
on the project `dvc repro` built (tests/conftest.py `dvc_repo`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import onnx
import pytest
import yaml

from tests.conftest import SHARED_PROJECT, client_for, clone_project, run, sha256

pytestmark = pytest.mark.slow


def _stage_runs(repo: Path, stage: str) -> list[Any]:
    client = client_for(repo)
    experiment = client.get_experiment_by_name("lockstep")
    return client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`lockstep.stage` = '{stage}'",
        order_by=["attributes.start_time ASC"],
    )


def _files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def _ops(path: Path) -> list[str]:
    return [node.op_type for node in onnx.load(str(path)).graph.node]


def _every_variant(repo: Path, train_cfg: Any, checkpoint: Path, out: Path) -> tuple[Any, Any]:
    """(the compress config, its result): all five variants of `checkpoint`, in this process."""
    from tasks.core.config.yaml_io import load_params
    from tasks.ship.compress import compress

    params = load_params(repo / "params.yaml")
    variants = ("dynamic_int8", "static_int8", "qat_int8", "pruned_l1", "pruned_ln")
    cfg = params.compress.model_copy(update={"variants": variants})
    threads = params.determinism.num_threads
    return cfg, compress(cfg, train_cfg, params.seed, threads, checkpoint, repo / "artifacts/preprocessed", out)


def _conv_shapes(path: Path) -> list[tuple[int, ...]]:
    """The weight shape (out, in, kh, kw) of every Conv, in graph order."""
    graph = onnx.load(str(path)).graph
    shapes = {init.name: tuple(init.dims) for init in graph.initializer}
    return [shapes[node.input[1]] for node in graph.node if node.op_type == "Conv"]


def test_compress_measures_every_variant_and_export_ships_what_was_measured(dvc_repo: dict[str, Any]) -> None:
    repo = dvc_repo["repo"]
    compress_dir, export_dir = repo / "artifacts/compress", repo / "artifacts/export"
    table = json.loads((compress_dir / "metrics.json").read_text())
    assert list(table) == ["fp32", *SHARED_PROJECT["compress"]["variants"]]
    for name, row in table.items():
        assert 0.5 < row["accuracy"] <= 1 and row["latency_b1_ms"] > 0 and row["latency_b64_ms"] > 0, name
        assert row["size_bytes"] == (compress_dir / "models" / f"{name}.onnx").stat().st_size
    assert table["static_int8"]["size_ratio"] <= 0.3  # int8 weights: a size, not a timing
    assert table["pruned_l1"]["sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert table["fp32"]["sparsity"] == 0
    # the CSV and Markdown tables hold the same rows
    csv_rows = (compress_dir / "compression.csv").read_text().splitlines()
    assert csv_rows[0].startswith("variant,accuracy,") and [r.split(",")[0] for r in csv_rows[1:]] == list(table)
    markdown = (compress_dir / "compression.md").read_text()
    assert all(f"| {name} |" in markdown for name in table)
    assert "Not built: dynamic_int8, qat_int8, pruned_ln (`compress.variants: all`" in markdown

    # fused conv-bn-relu: no BatchNormalization anywhere; static int8 is QDQ with ReLU absorbed
    assert "BatchNormalization" not in _ops(compress_dir / "models/fp32.onnx")
    static_ops = _ops(compress_dir / "models/static_int8.onnx")
    assert {"QuantizeLinear", "DequantizeLinear", "Conv"} <= set(static_ops) and "Relu" not in static_ops
    # global pooling as the op ORT has an int8 kernel for (tasks/ship/quantize.py global_pools); fp32 as exported
    assert "GlobalAveragePool" in static_ops and "ReduceMean" not in static_ops
    assert "ReduceMean" in _ops(compress_dir / "models/fp32.onnx")
    # digits' pixels quantized in one node, not normalized first (tasks/ship/quantize.py quantized_pixels)
    assert "Sub" not in static_ops and "Div" not in static_ops
    assert {"Sub", "Div"} <= set(_ops(compress_dir / "models/fp32.onnx"))
    # float logits straight from the last Gemm, not rounded to 8 bits (tasks/ship/quantize.py STATIC_INT8)
    assert static_ops[-1] == "Gemm" and _ops(compress_dir / "models/fp32.onnx")[-1] == "Gemm"

    # export ships the measured files, byte for byte, with a dynamic batch axis and weights inside
    assert sha256(export_dir / "model.onnx") == sha256(compress_dir / "models/static_int8.onnx")
    assert sha256(export_dir / "model_fp32.onnx") == sha256(compress_dir / "models/fp32.onnx")
    shipped = onnx.load(str(export_dir / "model.onnx"), load_external_data=False)
    assert shipped.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # symbolic batch
    assert not list(export_dir.glob("*.data"))
    gates = json.loads((export_dir / "gates.json").read_text())
    # fp32 parity of ONNX and .pt2 (no TorchScript by default), then static_int8's two gates
    assert [g["candidate"] for g in gates["gates"]] == ["", "", "static_int8", "static_int8"]
    assert all(g["passed"] for g in gates["gates"]) and gates["variant"] == "static_int8"
    assert not (export_dir / "torch/model.torchscript.pt").exists()

    metrics = run(["dvc", "metrics", "show", "--json"], repo).stdout
    assert "artifacts/compress/metrics.json" in metrics and "artifacts/export/gates.json" in metrics


def test_model_card_and_registry(dvc_repo: dict[str, Any]) -> None:
    repo = dvc_repo["repo"]
    export_dir = repo / "artifacts/export"
    card = (export_dir / "model_card.md").read_text()
    data_md5 = yaml.safe_load((repo / "data.dvc").read_text())["outs"][0]["md5"]
    assert data_md5 in card and '"seed": 42' in card and '"lr": 0.05' in card
    assert "## Training recipe" in card and "- optimizer: `sgd`" in card and "ema_decay `None`" in card
    assert "| static_int8 |" in card and "| pruned_l1 |" in card  # the compression table
    assert "Not built: dynamic_int8, qat_int8, pruned_ln" in card  # what `compress.variants: all` would add
    evaluated = json.loads((repo / "artifacts/evaluate/metrics.json").read_text())
    assert f"| evaluate num_samples | {evaluated['num_samples']} |" in card  # a count, not 271.0000
    for key in ("accuracy", "accuracy_ci95_low", "accuracy_ci95_high"):
        assert f"| evaluate {key} | {evaluated[key]:.4f} |" in card
    assert evaluated["accuracy_ci95_low"] < evaluated["accuracy"] < evaluated["accuracy_ci95_high"]
    (compress_run,) = _stage_runs(repo, "compress")
    assert compress_run.data.params["compress.variants"] == str(("static_int8", "pruned_l1"))  # what was built
    for name in ("model.onnx", "model_fp32.onnx", "torch/model.pt2"):
        assert f"`{name}`: `{sha256(export_dir / name)}`" in card

    (export_run,) = _stage_runs(repo, "export")
    tags, metrics = export_run.data.tags, export_run.data.metrics
    assert tags["sha256.model.onnx"] == sha256(export_dir / "model.onnx")
    assert tags["registry.decision"] == "promoted to champion" and tags["registry.champion_version_before"] == "none"
    assert metrics["registry.challenger_accuracy"] == metrics["test_accuracy"]
    client = client_for(repo)
    aliases = client.get_registered_model("lockstep-classifier").aliases
    assert {alias: str(v) for alias, v in aliases.items()} == {"champion": "1", "challenger": "1"}
    version = client.get_model_version("lockstep-classifier", "1")
    assert float(version.tags["test_accuracy"]) == metrics["test_accuracy"]

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{repo / 'mlflow.db'}")
    info = mlflow.models.get_model_info("models:/lockstep-classifier@champion")
    assert "python_function" in info.flavors  # the served wrapper: image bytes in (tasks/ship/serving.py)
    assert info.signature.inputs.to_dict() == [{"type": "binary", "name": "image", "required": True}]
    assert [c["name"] for c in info.signature.outputs.to_dict()] == ["class", "probability", "top_k"]
    assert info.run_id == export_run.info.run_id
    # serving the ONNX model needs its runtime, pinned, not the training stack
    requirements = Path(mlflow.pyfunc.get_model_dependencies("models:/lockstep-classifier@champion")).read_text()
    names = {line.split("==")[0] for line in requirements.split()}
    assert {"mlflow", "onnx", "onnxruntime", "numpy"} <= names and not names & {"torch", "prefect", "dvc"}, names


# Run as a separate program: nothing of lockstep or torch, only numpy and onnxruntime.
_SCORE = """
import json, sys
import numpy as np, onnxruntime as ort
model, images, labels = sys.argv[1:]
x = np.load(images).astype(np.float32) / 255
options = ort.SessionOptions(); options.intra_op_num_threads = 1
session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
logits = np.concatenate([session.run(None, {"pixels": x[i:i + 256]})[0] for i in range(0, len(x), 256)])
print(json.dumps(float((logits.argmax(1) == np.load(labels)).mean())))
"""


@pytest.mark.parametrize(
    ("file", "metric"), [("model.onnx", "test_accuracy"), ("model_fp32.onnx", "fp32_test_accuracy")]
)
def test_exported_onnx_in_a_fresh_process_scores_the_logged_accuracy(
    dvc_repo: dict[str, Any], file: str, metric: str
) -> None:
    repo = dvc_repo["repo"]
    pre = repo / "artifacts/preprocessed"
    done = run(
        [
            sys.executable,
            "-c",
            _SCORE,
            str(repo / "artifacts/export" / file),
            str(pre / "test_images.npy"),
            str(pre / "test_labels.npy"),
        ],
        repo,
    )
    (export_run,) = _stage_runs(repo, "export")
    assert json.loads(done.stdout) == export_run.data.metrics[metric]


def test_a_failed_gate_fails_the_stage_and_registers_nothing(dvc_repo: dict[str, Any], tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    clone_project(dvc_repo["repo"], repo)
    before = _files(repo / "artifacts/export")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["export"].update(max_abs_diff=1e-12, min_top1_agreement=1.0, candidates=["static_int8", "fp32"])
    strict = tmp_path / "strict.yaml"
    strict.write_text(yaml.safe_dump(params))
    done = run(
        [sys.executable, "-m", "tasks", "export", "--params", str(strict)], repo, check=False, PYTHONPATH=str(repo)
    )
    assert done.returncode == 3, done.stderr
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("error: export: ") and "fp32 ONNX vs eager max |logit diff|" in message
    assert "> allowed 1e-12" in message  # measured and allowed values, both named
    assert "own logits" not in message  # a sound model's logits: nothing said of the model
    assert before == _files(repo / "artifacts/export")  # outputs untouched: parity is not a candidate's fault
    failed = _stage_runs(repo, "export")[-1]
    assert failed.info.status == "FAILED" and "registry.version" not in failed.data.tags
    assert len(client_for(repo).search_model_versions("name='lockstep-classifier'")) == 1


def _export_with(repo: Path, export: dict[str, Any]) -> Any:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["export"].update(export)
    path = repo / "gated.yaml"
    path.write_text(yaml.safe_dump(params))
    return run([sys.executable, "-m", "tasks", "export", "--params", str(path)], repo, check=False)


def test_a_candidate_failing_its_gates_passes_the_turn_to_the_next(dvc_repo: dict[str, Any], tmp_path: Path) -> None:
    """The first candidate that passes ships, saying why the ones before it did not, in the log, the
    card, gates.json and the MLflow run; when none passes the stage fails and nothing changes."""
    repo = clone_project(dvc_repo["repo"], tmp_path / "repo")
    metrics = json.loads((repo / "artifacts/compress/metrics.json").read_text())
    agreement = {v: metrics[v]["top1_agreement"] for v in SHARED_PROJECT["compress"]["variants"]}
    worse, better = sorted(agreement, key=agreement.get)
    assert agreement[worse] < agreement[better], f"the variants agree equally often ({agreement}): pick other gates"
    # confidence 0: every test image counts, so the gate measures what the compress table shows
    gate = {"confidence": 0.0, "min_top1_agreement": (agreement[worse] + agreement[better]) / 2, "max_accuracy_drop": 1}
    export = repo / "artifacts/export"

    done = _export_with(repo, {**gate, "candidates": [worse, better, "fp32"]})
    assert done.returncode == 0, done.stderr
    test_images = json.loads((repo / "artifacts/preprocessed/meta.json").read_text())["split_sizes"]["test"]
    assert (
        f"{worse} failed its gates ({worse} top-1 agreement with fp32 on the {test_images} test images" in done.stderr
    )
    assert f"{better} shipped instead" in done.stderr
    assert sha256(export / "model.onnx") == sha256(repo / f"artifacts/compress/models/{better}.onnx")
    gates = json.loads((export / "gates.json").read_text())
    assert gates["variant"] == better and gates["requested_variant"] == worse
    assert gates["fallback_reason"].startswith(f"{worse} failed its gates")
    assert [g["passed"] for g in gates["gates"] if g["candidate"] == worse] == [False, True]
    assert gates["accuracy"] == metrics[better]["accuracy"]
    card = (export / "model_card.md").read_text()
    assert f"Shipped: `model.onnx` ({better})" in card and f"**Fallback:** {worse} failed its gates" in card
    # the machine's fingerprint is in the card
    assert "## Machine" in card and "determinism.cpu: portable, the same on any x86-64 CPU" in card
    assert "- cpu.mode: `portable`" in card and "- cpu.capability: `AVX2`" in card
    shipped = _stage_runs(repo, "export")[-1]
    assert shipped.info.status == "FINISHED" and shipped.data.tags["export.shipped_variant"] == better
    assert shipped.data.tags["export.fallback_reason"] == gates["fallback_reason"]
    assert shipped.data.tags["registry.version"]  # registered: what shipped passed every gate it must

    # `worse` agrees on fewer than all images (less than `better`), so a gate of 1.0 fails it
    before = _files(export)
    done = _export_with(repo, {**gate, "min_top1_agreement": 1.0, "candidates": [worse]})
    assert done.returncode == 3 and "no export candidate passed its gates" in done.stderr, done.stderr
    assert before == _files(export)
    assert _stage_runs(repo, "export")[-1].info.status == "FAILED"

    done = _export_with(repo, {**gate, "min_top1_agreement": 1.0, "candidates": [worse, "fp32"]})
    assert done.returncode == 0 and "fp32 shipped instead" in done.stderr, done.stderr
    assert sha256(export / "model.onnx") == sha256(export / "model_fp32.onnx")
    assert json.loads((export / "gates.json").read_text())["variant"] == "fp32"


def test_every_variant_is_built_reproducibly(dvc_repo: dict[str, Any], tmp_path: Path) -> None:
    """All five variants in-process, compared with what `dvc repro` built in its own process."""
    from tasks.core.config.yaml_io import load_params
    from tasks.determinism.bootstrap import start

    repo = dvc_repo["repo"]
    params = load_params(repo / "params.yaml")
    start(params.seed, params.determinism.num_threads, strict=params.determinism.strict)
    out = tmp_path / "compress"
    cfg, result = _every_variant(repo, params.train, repo / "artifacts/train/best.safetensors", out)
    rows = {row.variant: row for row in result.rows}
    assert list(rows) == ["fp32", *cfg.variants]
    # the same bytes as the stage process built (fine-tuned pruning included)
    for name in ("fp32", "static_int8", "pruned_l1"):
        assert sha256(out / f"models/{name}.onnx") == sha256(repo / f"artifacts/compress/models/{name}.onnx"), name
    assert "ConvInteger" in _ops(out / "models/dynamic_int8.onnx")
    qat_ops = _ops(out / "models/qat_int8.onnx")
    assert "QuantizeLinear" in qat_ops and "BatchNormalization" not in qat_ops
    assert rows["qat_int8"].size_ratio < 0.35 and rows["qat_int8"].accuracy > 0.5
    assert set(result.history) == {"qat_int8", "pruned_l1", "pruned_ln"}

    # structured: a quarter of every conv's output channels are gone (and the next layers' inputs)
    full, pruned = _conv_shapes(out / "models/fp32.onnx"), _conv_shapes(out / "models/pruned_ln.onnx")
    assert len(full) == len(pruned) == 3
    assert [p[0] for p in pruned] == [f[0] - round(cfg.prune_channels * f[0]) for f in full]
    assert [p[1] for p in pruned] == [full[0][1]] + [p[0] for p in pruned[:-1]]  # input channels follow
    assert rows["pruned_ln"].size_ratio < 0.7 and rows["pruned_ln"].sparsity > cfg.prune_channels


def test_every_variant_is_built_for_resnet9(dvc_repo: dict[str, Any], tmp_path: Path) -> None:
    """The default model for real images: BN folded, int8 QDQ, and channel pruning across its residual adds."""
    from tasks.core.config.yaml_io import load_params
    from tasks.determinism.bootstrap import start
    from tasks.train.stage import train

    repo = dvc_repo["repo"]
    params = load_params(repo / "params.yaml")
    train_cfg = params.train.model_copy(update={"model": "resnet9", "epochs": 2})
    start(params.seed, params.determinism.num_threads, strict=params.determinism.strict)
    train(train_cfg, params.seed, repo / "artifacts/preprocessed", tmp_path / "train")
    out = tmp_path / "compress"
    cfg, result = _every_variant(repo, train_cfg, tmp_path / "train/best.safetensors", out)
    rows = {row.variant: row for row in result.rows}
    assert list(rows) == ["fp32", *cfg.variants]
    for name in ("fp32", "qat_int8", "static_int8"):
        assert "BatchNormalization" not in _ops(out / f"models/{name}.onnx"), name
    assert _ops(out / "models/fp32.onnx").count("Add") == 3  # the three residual pairs
    assert "QuantizeLinear" in _ops(out / "models/static_int8.onnx")
    assert "ReduceMean" not in _ops(out / "models/static_int8.onnx")  # its global pooling stays int8
    assert rows["static_int8"].size_ratio < 0.3 and rows["static_int8"].top1_agreement > 0.9

    full, pruned = _conv_shapes(out / "models/fp32.onnx"), _conv_shapes(out / "models/pruned_ln.onnx")
    assert len(pruned) == len(full) == 10
    # a quarter of every group's channels (a residual pair keeps its input's count, so the adds line
    # up), and every conv reads what the one before it now puts out
    assert [p[0] for p in pruned] == [f[0] - round(cfg.prune_channels * f[0]) for f in full]
    assert all(nxt[1] == prev[0] for prev, nxt in zip(pruned, pruned[1:], strict=False))
    assert rows["pruned_ln"].size_ratio < 0.8 and rows["pruned_ln"].accuracy > 0.3
