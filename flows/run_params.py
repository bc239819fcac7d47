"""The params one pipeline flow run uses: its params file read once, checked, and handed on.

A run started through the API may change only the keys it is allowed (tasks/core/config/policy.py),
with `overrides` or with a `params_file` that differs from params.yaml. The check and the run must
see the same bytes: a file swapped after the check (while the run waits up to `lock_wait_s` for the
pipeline lock) could otherwise switch the data checks off or name a rendezvous elsewhere (torch
unpickles what a rendezvous sends). So the file is read once, here; the text with the overrides
applied and its validated `Params` are what the run writes back (overrides) and hands to every stage
(they run in the flow's own process, on the `Params` object), and what its notification hooks use.
Once the run holds the lock, a file written meanwhile is read and checked again (`recheck`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.core.config.base import ConfigError, shown
from tasks.core.config.params import Params
from tasks.core.config.policy import changed_keys, refuse_api_overrides
from tasks.core.config.yaml_io import PARAMS_FILE, load_params, parse_params, read_params_text, text_with_overrides
from tasks.core.errors import Refused
from tasks.core.layout import ROOT

MAX_PATH_CHARS = 4096  # Linux's PATH_MAX


@dataclass(frozen=True)
class CheckedParams:
    """What a run checked: `text` (its params file as read, with the overrides applied) and `params`."""

    params_file: str  # as the run was given it, relative to the project
    text: str
    params: Params
    overrides: dict[str, Any] = field(default_factory=dict)
    read: str = ""  # the file as it was read, before the overrides

    @property
    def path(self) -> Path:
        return ROOT / self.params_file


def check_run_params(
    params_file: str, overrides: dict[str, Any] | None, allowed: frozenset[str] | set[str]
) -> CheckedParams:
    """`params_file` read once, with `overrides` applied, validated, and refused (OverrideRefused, one
    line) unless every key they change from params.yaml is on the API allow-list or in `allowed`."""
    path = (ROOT / inside_project(params_file)).resolve()
    if overrides:
        refuse_api_overrides(overrides, allowed)
    read = read_params_text(path)  # the one read of this run's params file (again only in `recheck`)
    given = parse_params(read, path)
    refuse_api_overrides(_changes(path, given), allowed, f"params_file {params_file}")
    text, params = text_with_overrides(read, overrides, path)
    return CheckedParams(params_file, text, params, dict(overrides or {}), read)


class ParamsChanged(Refused):
    """The run's params file was rewritten, in a way the run cannot follow, while it waited for the lock."""


def recheck(checked: CheckedParams, allowed: frozenset[str] | set[str]) -> CheckedParams:
    """Under the pipeline lock: `checked` if the params file is still as the run read it, else the file
    as it is now, checked again (the same overrides and allow-list).

    Whatever wrote it meanwhile (a sweep's `--apply`, another run's overrides, an edit) would otherwise
    be lost under this run's overrides, or be recorded in dvc.lock (DVC reads the file when it commits a
    stage) for stages this run trained on the values it read before. Only the CPU mode cannot follow:
    the flow's process was prepared for it before it waited."""
    if read_params_text(checked.path) == checked.read:
        return checked
    again = check_run_params(checked.params_file, checked.overrides or None, allowed)
    if again.params.determinism.cpu != checked.params.determinism.cpu:
        raise ParamsChanged(
            f"{checked.params_file}: determinism.cpu was changed to {again.params.determinism.cpu!r} while this "
            "run waited for the pipeline lock: nothing ran; start the run again"
        )
    return again


def inside_project(params_file: str) -> str:
    """`params_file` if it names a file inside the project (it comes from the API, and overrides are
    written into it); ConfigError otherwise."""
    # Refused before any path function sees it: a NUL (JSON "\u0000") made them raise a bare
    # ValueError, and no file has a name longer than Linux's PATH_MAX.
    if "\0" in params_file:
        raise ConfigError(f"params_file: {shown(params_file)} holds a NUL character; expected a file's name")
    if len(params_file) > MAX_PATH_CHARS:
        raise ConfigError(f"params_file: {len(params_file)} characters; a file's name is at most {MAX_PATH_CHARS}")
    if not (ROOT / params_file).resolve().is_relative_to(ROOT.resolve()):
        raise ConfigError(f"params_file: {params_file!r} is outside the project {ROOT}")
    return params_file


def params_file_changes(params_file: str) -> list[str]:
    """The keys whose values `params_file` changes from params.yaml's ([] for params.yaml itself).

    A params_file is a set of overrides by another name: anyone who can write a YAML file inside the
    checkout (an MLflow artifact folder, a data folder) could otherwise hand a run a rendezvous, a
    data URL or switched-off gates that `overrides` may not carry."""
    path = (ROOT / inside_project(params_file)).resolve()
    return _changes(path, load_params(path))


def _changes(path: Path, given: Params) -> list[str]:
    base = (ROOT / PARAMS_FILE).resolve()
    if path == base:
        return []
    return changed_keys(load_params(base).model_dump(mode="json"), given.model_dump(mode="json"))
