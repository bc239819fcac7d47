"""`python -m tasks.tools.gpu_check --device cpu`: the GPU check's own code, run as a user runs it, so it does
not rot while no GPU is at hand. One real run (module fixture) is read by every test; with a GPU the
`gpu` test runs the real thing."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import torch

from tasks.core.config.train import TrainConfig
from tasks.tools.gpu_check import MODELS
from tests.conftest import ROOT, subprocess_env

# What a bare CUDA machine lacks: the check must never import them, directly or through a tasks module.
NOT_ON_A_BARE_MACHINE = {"mlflow", "prefect", "dvc", "sklearn", "matplotlib"}


def _check(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-X", "importtime", "-m", "tasks.tools.gpu_check", *args]
    return subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


# The tests reading the full run are the full tier's: the run is two minutes of one core alone and five
# under a busy test tier on 2-core AMD EPYCs (bf16 is emulated without AVX-512), the fast tier's longest
# item by far (docs/tests.md). The fast tier keeps the refused-op, no-ONNX-Runtime and no-CUDA runs.
FULL_RUN = pytest.mark.slow


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu-check")
    # Two timed runs per mode, no warm-up: the throughput rows are reports on a CPU, and bf16 without the
    # CPU's bf16 instructions runs emulated (seconds per step of resnet18): the default 1 + 3 runs were
    # half of this module's time. Two runs still take the median of several.
    done = _check("--device", "cpu", "--runs", "2", "--warmup", "0", "--json", str(out / "gpu-check.json"))
    assert done.returncode == 0, f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr[-5000:]}"
    report = json.loads((out / "gpu-check.json").read_text())
    return {"done": done, "report": report, "dir": out}


def _rows(report: dict[str, Any], group: str) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in report["checks"] if row["group"] == group}


def _literal(name: str) -> tuple[str, ...]:
    return typing.get_args(TrainConfig.model_fields[name].annotation)


@FULL_RUN
def test_exits_0_prints_one_table_and_writes_the_report_atomically(cpu_run: dict[str, Any]) -> None:
    report, stdout = cpu_run["report"], cpu_run["done"].stdout
    assert report["passed"] is True and report["counts"]["FAIL"] == 0
    assert stdout.startswith("lockstep gpu-check: cpu (")
    assert "result: ok" in stdout
    for row in report["checks"]:  # every row of the JSON is a line of the table
        assert any(row["name"] in line and row["status"] in line for line in stdout.splitlines()), row["name"]
    assert sorted(p.name for p in cpu_run["dir"].iterdir()) == ["gpu-check.json"]  # no temporary left behind
    assert report["device"]["type"] == "cpu" and report["device"]["cpu"]
    assert report["versions"]["torch"] == torch.__version__
    assert report["determinism"]["deterministic_algorithms"] is True
    assert report["determinism"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


@FULL_RUN
def test_every_model_and_optimiser_of_the_config_steps_in_strict_mode(cpu_run: dict[str, Any]) -> None:
    strict = _rows(cpu_run["report"], "strict")
    expected = {f"{model}/{optimizer}" for model, optimizer in itertools.product(MODELS, _literal("optimizer"))}
    assert set(strict) == expected
    assert {row["status"] for row in strict.values()} == {"pass"}


@FULL_RUN
def test_fp32_and_bf16_training_twice_gives_equal_weight_bytes(cpu_run: dict[str, Any]) -> None:
    rows = _rows(cpu_run["report"], "determinism")
    for name in ("resnet9 fp32", "resnet9 bf16", "resnet9 fp32 recipe", "resnet9 bf16 recipe"):
        row = rows[name]
        first, second = row["numbers"]["sha256"]
        assert row["status"] == "pass", row
        assert first == second and len(first) == 64
        assert row["numbers"]["weights_changed"] is True  # equal because deterministic, not because untouched
    assert rows["resnet9 fp32"]["numbers"]["sha256"] != rows["resnet9 bf16"]["numbers"]["sha256"]
    assert rows["resnet9 fp32"]["numbers"]["sha256"] != rows["resnet9 fp32 recipe"]["numbers"]["sha256"]


@FULL_RUN
def test_fp16_is_not_applicable_on_cpu_rather_than_passed(cpu_run: dict[str, Any]) -> None:
    row = _rows(cpu_run["report"], "determinism")["resnet9 fp16"]
    assert row["status"] == "n/a"
    assert row["detail"].startswith("n/a on cpu")
    assert "sha256" not in row["numbers"]


@FULL_RUN
def test_throughput_measures_pinned_fast_and_plain_and_reports_ratios(cpu_run: dict[str, Any]) -> None:
    rows = _rows(cpu_run["report"], "throughput")
    fp32, bf16, overhead = (
        rows[f"resnet18 {name}"] for name in ("fp32 pinned vs fast", "bf16 pinned vs fast", "project vs plain")
    )
    ips = fp32["numbers"]["images_per_s"]
    assert set(ips) == {"pinned", "fast", "plain"} and min(ips.values()) > 0
    assert set(bf16["numbers"]["images_per_s"]) == {"pinned", "fast"}
    assert (fp32["numbers"]["amp"], bf16["numbers"]["amp"]) == ("none", "bf16")
    for row in (fp32, bf16):
        measured = row["numbers"]["images_per_s"]
        assert row["numbers"]["cost"] == pytest.approx(measured["fast"] / measured["pinned"])
        assert (row["numbers"]["runs"], row["numbers"]["warmup"]) == (2, 0)  # the command line's sizes
    assert overhead["numbers"]["project_over_plain"] == pytest.approx(ips["plain"] / ips["pinned"])
    # the 1.3x target is for CUDA, in bf16: on the CPU every row is a measurement, neither pass nor FAIL
    assert {row["status"] for row in (fp32, bf16, overhead)} == {"report"}
    assert not fp32["numbers"]["judged"] and not bf16["numbers"]["judged"]


@FULL_RUN
def test_compress_and_export_run_from_a_checkpoint_trained_on_the_device(cpu_run: dict[str, Any]) -> None:
    compressed = _rows(cpu_run["report"], "compress")["resnet9"]
    exported = _rows(cpu_run["report"], "export")["static_int8"]
    assert compressed["status"] == "pass", compressed
    assert list(compressed["numbers"]["variants"]) == ["fp32", "static_int8", "pruned_l1"]
    assert compressed["numbers"]["variants"]["static_int8"]["size_ratio"] < 0.5
    assert exported["status"] == "pass", exported
    assert all(gate["passed"] for gate in exported["numbers"]["gates"])
    assert {"model.onnx", "model_fp32.onnx", "torch/model.pt2", "torch/model.torchscript.pt"} <= set(
        exported["numbers"]["sha256"]
    )


@FULL_RUN
def test_never_imports_mlflow_prefect_or_dvc(cpu_run: dict[str, Any]) -> None:
    """-X importtime lists every module the whole run imported, compress and export's lazy imports too."""
    imported = {
        line.split("|")[-1].strip().split(".")[0]
        for line in cpu_run["done"].stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "tasks" in imported and "torch" in imported  # the listing is really there
    assert not imported & NOT_ON_A_BARE_MACHINE


def _patched(prelude: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`main(args)` in a fresh process after `prelude` (a failure that this machine cannot produce)."""
    code = f"import sys\n{prelude}\nfrom tasks.tools.gpu_check import main\nsys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, *args]
    return subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)


# A resnet18 whose forward calls put_, which strict mode refuses on every device (as CUDA refuses some
# backward kernels): its rows fail naming the op, the other model's rows still run and pass.
REFUSED_OP = """
import torch
import tasks.train.loop
real = tasks.train.loop.build_model

class PutNet(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        x = x.clone()
        x.view(-1).put_(torch.tensor([0, 0]), x.new_tensor([1.0, 2.0]))
        return self.inner(x)

def build(name, *args):
    model = real(name, *args)
    if name == "resnet18":
        model.net = PutNet(model.net)
    return model

tasks.train.loop.build_model = build
"""


def test_an_op_refused_in_strict_mode_is_a_failed_row_naming_it_and_exit_1(tmp_path: Path) -> None:
    models = ("resnet9", "resnet18")  # the one refused and one beside it: `--models` checks those alone
    args = ("--device", "cpu", "--only", "strict", "--models", *models, "--json", str(tmp_path / "r.json"))
    done = _patched(REFUSED_OP, *args)
    assert done.returncode == 1, done.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    strict = _rows(report, "strict")
    assert report["passed"] is False
    assert set(strict) == {f"{model}/{optimizer}" for model in models for optimizer in _literal("optimizer")}
    for optimizer in _literal("optimizer"):
        assert strict[f"resnet9/{optimizer}"]["status"] == "pass"
        failed = strict[f"resnet18/{optimizer}"]
        assert failed["status"] == "FAIL"
        assert failed["detail"] == "strict mode refused put_ (no deterministic implementation)"
    assert "result: FAILED" in done.stdout


@pytest.mark.parametrize("module", ["onnxruntime", "torch_pruning"])
def test_a_missing_compress_wheel_skips_compress_and_export_naming_it(module: str, tmp_path: Path) -> None:
    # torch_pruning: an H100 run without its wheel failed as "the check itself failed" (2026-12-05)
    hidden = f"sys.modules[{module!r}] = None  # as on a bare machine: find_spec says not installed"
    done = _patched(hidden, "--device", "cpu", "--only", "compress", "--json", str(tmp_path / "r.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "r.json").read_text())["checks"]
    assert [(row["group"], row["status"], row["detail"]) for row in rows] == [
        ("compress", "skipped", f"skipped: {module} not installed (carry its wheel)"),
        ("export", "skipped", f"skipped: {module} not installed (carry its wheel)"),
    ]


# The third-party packages a module pulls in that the rest of the check has not, in a fresh process.
NEW_PACKAGES = """
import json, sys
def tops():
    return {name.split(".")[0] for name in sys.modules if not name.startswith("_")}
for name in sys.argv[1].split(","):
    __import__(name)
before = tops()
for name in sys.argv[2].split(","):
    __import__(name)
print(json.dumps(sorted(tops() - before - set(sys.stdlib_module_names))))
"""


def _new_packages(first: tuple[str, ...], then: tuple[str, ...]) -> set[str]:
    cmd = [sys.executable, "-c", NEW_PACKAGES, ",".join(first) or "sys", ",".join(then)]
    done = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout))


def test_every_package_compress_and_export_load_is_one_the_check_can_skip_for() -> None:
    """A package that importing the ship stages loads beyond the training checks is named in COMPRESS_NEEDS
    (or loaded by one of those), so a machine without it gets a skipped row to act on. VARIANT_NEEDS is for
    what one variant imports when it is built."""
    from tasks.tools.gpu_check.checks_ship import COMPRESS_NEEDS

    added = _new_packages(("tasks.tools.gpu_check.checks",), ("tasks.ship.compress", "tasks.ship.export"))
    assert "onnxruntime" in added  # the listing is really there
    assert added <= set(COMPRESS_NEEDS) | _new_packages((), COMPRESS_NEEDS)
