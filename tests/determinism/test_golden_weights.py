"""The default run's weights, pinned: a change to the code that changes them on the same machine is a
change in results, and must be meant (tests/determinism/golden/default_weights.json says which bytes to expect).

In portable mode (what the default determinism.cpu: auto computes in on x86-64 with AVX2) the bytes
are the same on every x86-64 CPU with AVX2, so one record per torch version holds on every machine CI
gets: a cross-machine check over time, whose failure names the fingerprint differences
(tasks/determinism/fingerprint.py). Native records are keyed by machine, and a machine with no
record yet is skipped. Record (after checking that the change in results is
intended) with:

    LOCKSTEP_RECORD_GOLDEN=1 .venv/bin/python -m pytest tests/determinism/test_golden_weights.py
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import pytest
import torch

from tasks.core.config.yaml_io import load_params
from tasks.data.download import download
from tasks.data.preprocess import preprocess
from tasks.data.stats import compute_stats
from tasks.determinism import cpu_mode
from tasks.determinism.bootstrap import start
from tasks.determinism.fingerprint import explain, fingerprint
from tasks.train.stage import train
from tests.conftest import ROOT, sha256

GOLDEN = Path(__file__).parent / "golden" / "default_weights.json"
pytestmark = pytest.mark.slow


def machine() -> str:
    """What decides the bytes besides the code: CPU model, the kernels torch picked, torch itself."""
    cpuinfo = Path("/proc/cpuinfo")
    names = (
        [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        if cpuinfo.exists()
        else []
    )
    cpu = names[0] if names else platform.processor() or platform.machine()
    return f"{cpu} | {torch.backends.cpu.get_cpu_capability()} | torch {torch.__version__}"


def test_default_run_weights_are_unchanged(tmp_path: Path) -> None:
    params = load_params(ROOT / "params.yaml")
    shaping = params.model_dump(mode="json", include={"seed", "data", "split", "determinism", "train"})
    # the mode that computes, not the word asked for: `auto` resolved to portable makes portable's bytes
    shaping["determinism"]["cpu"] = cpu = cpu_mode.resolve(params.determinism.cpu)
    params_digest = hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()
    download(params.data, tmp_path / "data", tmp_path / "cache")
    stats = compute_stats(tmp_path / "data", params.split, params.seed, params.stats.chunk_size)
    preprocess(tmp_path / "data", stats, params.split, params.seed, tmp_path / "preprocessed")
    start(params.seed, params.determinism.num_threads, strict=params.determinism.strict, cpu=params.determinism.cpu)
    train(params.train, params.seed, tmp_path / "preprocessed", tmp_path / "train")
    made = {name: sha256(tmp_path / "train" / name) for name in ("best.safetensors", "last.safetensors")}

    records = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    portable = cpu == "portable"
    key = f"portable | torch {torch.__version__}" if portable else machine()
    if os.environ.get("LOCKSTEP_RECORD_GOLDEN") == "1":
        records[key] = {"params_sha256": params_digest, **made, "recorded_on": fingerprint()}
        GOLDEN.write_text(json.dumps(records, indent=2, sort_keys=True) + "\n")
    if key not in records:
        pytest.skip(f"no default-run weights recorded for this machine ({key}); see {GOLDEN.name}'s test docstring")
    expected = records[key]
    assert expected["params_sha256"] == params_digest, (
        "params.yaml's defaults changed since the weights were recorded: record them again (module docstring)"
    )
    differences, _ = explain(expected.get("recorded_on", {}), fingerprint())
    assert made == {name: expected[name] for name in made}, (
        f"the default run's weights changed ({key}); byte-relevant differences from the machine they were "
        f"recorded on: {differences or 'none (a code change, or a portability bug)'}"
    )
