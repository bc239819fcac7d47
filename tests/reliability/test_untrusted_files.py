"""Checkpoints and data files carrying a pickle payload are refused; the payload never runs.

Each payload is a live one (a `__reduce__` that creates a file when unpickled: checked first, in a
process of its own), planted where a stage reads, and the real stage is run on it.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ROOT
from tests.reliability.conftest import Trained, clone, stage
from tests.support.cli_errors import one_line_error

pytestmark = pytest.mark.slow


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204 - what an attacker's pickle does: run a command when loaded
        return os.system, (f"touch {self.marker}",)


def _torch_pickle(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"state_dict": {"weight": torch.zeros(2)}, "extra": Payload(marker)}, buffer)
    return buffer.getvalue()


def _npy_pickle(marker: Path) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.array([Payload(marker)], dtype=object), allow_pickle=True)
    return buffer.getvalue()


def _assert_live(payload: bytes, loader: str, tmp_path: Path) -> None:
    """The payload does run when loaded the unsafe way (so refusing it below means something)."""
    probe = tmp_path / "probe.bin"
    probe.write_bytes(payload)
    code = {
        "torch": f"import torch; torch.load({str(probe)!r}, weights_only=False)",
        "numpy": f"import numpy; numpy.load({str(probe)!r}, allow_pickle=True)",
    }[loader]
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.parametrize(
    ("planted", "loader", "name", "shown"),
    [
        ("artifacts/train/best.safetensors", "torch", "evaluate", "not a readable safetensors file"),
        ("artifacts/train/best.safetensors", "torch", "export", "not a readable safetensors file"),
        ("artifacts/train-resume/resume.safetensors", "torch", "train", "not a readable safetensors file"),
        ("data/labels.npy", "numpy", "stats", "Object arrays cannot be loaded when allow_pickle=False"),
    ],
)
def test_a_pickle_payload_is_refused_and_never_runs(
    trained: Trained, tmp_path: Path, planted: str, loader: str, name: str, shown: str
) -> None:
    repo = clone(trained, tmp_path / "repo")
    marker = tmp_path / "payload-ran"
    payload = (_torch_pickle if loader == "torch" else _npy_pickle)(marker)
    _assert_live(payload, loader, tmp_path)
    assert marker.exists()
    marker.unlink()
    (repo / planted).parent.mkdir(parents=True, exist_ok=True)
    (repo / planted).write_bytes(payload)
    error = one_line_error(stage(repo, name))
    assert f"{planted}: " in error and shown in error, error
    assert not marker.exists(), "the payload ran"


def test_a_payload_in_preprocessed_data_is_refused_even_with_a_matching_checksum(
    trained: Trained, tmp_path: Path
) -> None:
    """The checksum in meta.json is a guard against corruption, not against an attacker who rewrites it
    too: the array is still loaded without unpickling."""
    repo = clone(trained, tmp_path / "repo")
    marker = tmp_path / "payload-ran"
    planted = repo / "artifacts/preprocessed/train_labels.npy"
    planted.write_bytes(_npy_pickle(marker))
    meta_path = repo / "artifacts/preprocessed/meta.json"
    meta = json.loads(meta_path.read_text())
    meta["sha256"]["train_labels.npy"] = hashlib.sha256(planted.read_bytes()).hexdigest()
    meta_path.write_text(json.dumps(meta))
    error = one_line_error(stage(repo, "train"))
    assert "artifacts/preprocessed/train_labels.npy: not a readable array" in error, error
    assert "allow_pickle=False" in error and not marker.exists()


# Calls that unpickle (run code from) a file. None may appear in the pipeline's code: every file it
# reads is safetensors, .npy without pickle, JSON/YAML (safe_load) or ONNX (protobuf).
UNPICKLING = {
    "pickle.load",
    "pickle.loads",
    "torch.load",
    "joblib.load",
    "dill.load",
    "cloudpickle.load",
    "pd.read_pickle",
    "pandas.read_pickle",
    "yaml.load",
    "yaml.unsafe_load",
    "np.lib.format.read_array",
}
# torch.distributed's object collectives unpickle what the other ranks send: ranks exchange tensors
# only (tasks/train/devices.py's gather sends JSON as bytes). torch's own rendezvous (the torchrun
# agent) unpickles the state in its store: a file in a private directory for a one-node job
# (tasks/train/launcher.py); a multi-node job trusts the machines that can reach train.rdzv_endpoint.
UNPICKLING_COLLECTIVES = (
    ".all_gather_object",
    ".gather_object",
    ".broadcast_object_list",
    ".scatter_object_list",
    ".recv_object_list",
)
# torch.export.load / torch.jit.load read the files export has just written into its own staging
# directory (the parity check, tasks/ship/export.py, through each format's writer in formats.py);
# they never read a file from elsewhere.
# tasks/core/config/yaml_io.py's yaml.load uses a yaml.SafeLoader subclass (no Python objects).
ALLOWED = {
    ("tasks/ship/formats.py", "torch.export.load"),
    ("tasks/ship/formats.py", "torch.jit.load"),
    ("tasks/core/config/yaml_io.py", "yaml.load"),
}


def _calls(path: Path) -> set[tuple[str, str, bool]]:
    """Each call (name, whether it allows pickles), and each loader named without a call: handed on as
    a value (`Writer(save, torch.jit.load)`) it is called elsewhere, and counts as a call here."""
    found = set()
    tree = ast.parse(path.read_text())
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in called:
            found.add((str(path.relative_to(ROOT)), ast.unparse(node), False))
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            allow_pickle = any(k.arg == "allow_pickle" and ast.unparse(k.value) != "False" for k in node.keywords)
            # torch.load(weights_only=True) unpickles tensors and plain containers only (torch's
            # restricted unpickler), never arbitrary objects: pretrained weights are read that way
            if name == "torch.load" and any(
                k.arg == "weights_only" and ast.unparse(k.value) == "True" for k in node.keywords
            ):
                name = "torch.load(weights_only=True)"
            found.add((str(path.relative_to(ROOT)), name, allow_pickle))
    return found


def test_no_code_path_unpickles_a_file() -> None:
    calls = {
        call for folder in ("tasks", "flows") for path in sorted((ROOT / folder).rglob("*.py")) for call in _calls(path)
    }
    unpickling = {
        (where, name)
        for where, name, _ in calls
        if name in UNPICKLING or name.endswith((".jit.load", ".export.load", *UNPICKLING_COLLECTIVES))
    } - ALLOWED
    assert not unpickling, unpickling
    stale = ALLOWED - {(where, name) for where, name, _ in calls}
    assert not stale, f"ALLOWED names loaders no longer there: {stale}"
    assert ("tasks/train/pretrained.py", "torch.load(weights_only=True)") in {
        (w, n) for w, n, _ in calls
    }  # the scan sees it
    np_loads = [call for call in calls if call[1] in ("np.load", "numpy.load")]
    assert np_loads, "the scan sees the np.load calls"
    assert not [call for call in np_loads if call[2]], "np.load with allow_pickle other than False"
