"""A pipeline run's params once it holds the pipeline lock (flows/run_params.py `recheck`): a file written
while the run waited (a sweep's `--apply`, another run's overrides) is read and checked again, so that the
run neither trains on values other than the ones DVC then records nor writes its overrides over another
writer's. The real flow waiting on a real lock, with a swapped file: tests/flows/test_api_overrides.py.
And what the API may hand `check_run_params` that no params file holds (a NUL in a file's name, a value
nested hundreds of levels deep) is refused in one line, as bad params are (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows import run_params
from tasks.core.config.base import ConfigError, OverrideRefused
from tasks.core.config.yaml_io import set_params
from tests.conftest import write_params

ALLOWED = {"train.epochs"}  # as `--set train.epochs=3` at the prompt allows its own key


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(run_params, "ROOT", tmp_path)
    write_params(tmp_path / "params.yaml", {"determinism": {"cpu": "portable"}})
    return tmp_path


def test_an_unchanged_file_is_what_was_checked(project: Path) -> None:
    checked = run_params.check_run_params("params.yaml", {"train.epochs": 3}, ALLOWED)
    assert run_params.recheck(checked, ALLOWED) is checked


def test_a_file_written_meanwhile_is_used_with_the_runs_own_overrides_on_top(project: Path) -> None:
    checked = run_params.check_run_params("params.yaml", {"train.epochs": 3}, ALLOWED)
    set_params(project / "params.yaml", {"train.lr": 0.0123})  # a sweep's --apply, while the run waited
    again = run_params.recheck(checked, ALLOWED)
    assert (again.params.train.lr, again.params.train.epochs) == (0.0123, 3)
    assert "lr: 0.0123" in again.text and again.read == (project / "params.yaml").read_text()


def test_a_swapped_file_the_check_refuses_is_refused_under_the_lock_too(project: Path) -> None:
    incoming = write_params(project / "incoming.yaml", {"determinism": {"cpu": "portable"}})  # params.yaml's copy
    checked = run_params.check_run_params(incoming.name, None, set())  # a run through the API: passes
    write_params(incoming, {"determinism": {"cpu": "portable"}, "checks": {"enabled": False}})
    with pytest.raises(OverrideRefused, match="params_file incoming.yaml: checks.enabled is not among"):
        run_params.recheck(checked, set())


def test_the_cpu_mode_cannot_change_under_a_waiting_run(project: Path) -> None:
    checked = run_params.check_run_params("params.yaml", None, set())
    set_params(project / "params.yaml", {"determinism.cpu": "native"})
    with pytest.raises(run_params.ParamsChanged, match="determinism.cpu was changed to 'native'"):
        run_params.recheck(checked, set())


def test_a_deeply_nested_override_is_refused_naming_the_key(project: Path) -> None:
    """An override from the API is JSON of any depth: 326 nested lists made the YAML written from it
    run PyYAML out of stack (a RecursionError, 3,000 lines); 900 ran ruamel's writer out of it too."""
    for depth in (326, 900):
        deep = json.loads("[" * depth + "]" * depth)
        with pytest.raises(ConfigError, match=r"params.yaml: train.lr: a value nested more than 30 levels deep"):
            run_params.check_run_params("params.yaml", {"train.lr": deep}, ALLOWED | {"train.lr"})
    # as deep as the loader reads: an ordinary bad value, named as such
    with pytest.raises(ConfigError, match="train.lr: Input should be a valid number"):
        run_params.check_run_params("params.yaml", {"train.lr": json.loads("[" * 30 + "]" * 30)}, {"train.lr"})


@pytest.mark.parametrize(
    ("params_file", "message"),
    [
        ("params\0.yaml", r"params_file: 'params\\x00.yaml' holds a NUL character"),  # JSON "\u0000", through the API
        ("p" * 5000, "params_file: 5000 characters; a file's name is at most 4096"),
    ],
)
def test_a_params_file_name_no_file_has_is_refused(project: Path, params_file: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        run_params.check_run_params(params_file, None, set())
