"""dvc.yaml and the code agree: each stage lists exactly the params sections it reads."""

from __future__ import annotations

import yaml

from tasks import layout
from tasks.config import STAGE_PARAMS, STAGES
from tests.conftest import ROOT


def _stages() -> dict:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def test_stages_in_pipeline_order() -> None:
    assert tuple(_stages()) == STAGES == ("download", "stats", "preprocess", "train", "evaluate", "compress", "export")


def test_each_stage_lists_exactly_the_params_it_reads() -> None:
    for name, stage in _stages().items():
        assert tuple(stage["params"]) == STAGE_PARAMS[name], name
        assert stage["cmd"] == f"python -m tasks {name}"


def test_outputs_never_overlap_the_dvc_tracked_data_dir() -> None:
    for name, stage in _stages().items():
        for entry in stage.get("outs", []) + stage.get("metrics", []):
            path = entry if isinstance(entry, str) else next(iter(entry))
            assert path.startswith(f"{layout.ARTIFACTS}/"), (name, path)
