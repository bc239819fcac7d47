"""Who may change which keys: runs started through the API (an allow-list, and remote keys) and sweeps."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tasks.core.config.base import OverrideRefused

# Keys whose values reach the network, other machines or files outside the project. A run started
# through the Prefect API (a deployment's `overrides`) may not change them unless whoever started the
# server allowed it (`python -m flows.deployments serve --allow-override KEY`): else a web page or
# anyone who can reach the API could point the data at their server or the train stage at their
# rendezvous, and the flow would write it into params.yaml for good. Sweeps refuse them in trial
# params read back from the study's storage too (tasks/tools/sweep/space.py).
REMOTE_KEYS = (
    "data.url",
    "data.mirror",
    "data.path",
    "data.sha256",
    "train.rdzv_endpoint",
    "train.nnodes",
    "train.pretrained",
    "train.pretrained_mirror",
    "train.pretrained_url",
    "train.pretrained_path",
    "train.pretrained_sha256",
    "sweep.address",
    "sweep.storage",
)

# The keys a run started through the API may override (with no --allow-override): what a scheduled
# retrain legitimately varies, the optimisation recipe and the seeds. Each is bounded by its
# validation, and none of them decides whether a model ships. Not on it, on purpose:
# - gates and what ships: checks.* (the data checks), export.* (parity and accuracy thresholds,
#   candidates), compress.*: an API caller could switch off the safeguards that stop a bad model;
# - promotion.*: who becomes champion (`min_margin: -1` promotes a worse model);
# - orchestration.* (notification routing: silence or redirect the on-call), tracking.* (where the
#   records go), sweep.*;
# - data.* (data.source too: another dataset is another model, and another download), split.*,
#   determinism.*, and the train keys that choose the model, its device, its processes or what it
#   starts from (REMOTE_KEYS among them).
# `serve --allow-override KEY` adds a key (or a whole section) for that server's runs; a person at
# the prompt (`python -m flows.pipeline --set`) may change any key.
API_OVERRIDABLE = frozenset(
    {
        "seed",
        "train.seed",
        "train.epochs",
        "train.lr",
        "train.batch_size",
        "train.weight_decay",
        "train.momentum",
        "train.label_smoothing",
    }
)


def remote_keys_in(keys: Iterable[str]) -> list[str]:
    """The keys among `keys` that are REMOTE_KEYS or a section holding one (`data`), sorted."""
    return sorted(key for key in keys if any(key == remote or remote.startswith(f"{key}.") for remote in REMOTE_KEYS))


def _covered(key: str, allowed: Iterable[str]) -> bool:
    """`key` is in `allowed`, or in a section `allowed` names (`checks` covers `checks.enabled`)."""
    return any(key == name or key.startswith(f"{name}.") for name in allowed)


def refuse_remote_overrides(overrides: Mapping[str, Any], allowed: frozenset[str] | set[str]) -> None:
    """Raise OverrideRefused if `overrides` sets a REMOTE_KEYS key (or its whole section) not in `allowed`."""
    refused = [key for key in remote_keys_in(overrides) if key not in allowed]
    if refused:
        raise OverrideRefused(
            f"overrides: {', '.join(refused)} reach the network or other machines and cannot be overridden "
            "through a deployment run unless the server was started with --allow-override for them"
        )


def refuse_api_overrides(keys: Iterable[str], allowed: frozenset[str] | set[str], source: str = "overrides") -> None:
    """Raise OverrideRefused, in one line, unless every key a run started through the API changes is on
    API_OVERRIDABLE or in `allowed` (the server's --allow-override). `source` names where the keys came
    from (`overrides`, or a `params_file`'s differences from params.yaml)."""
    keys = sorted(set(keys))
    remote = [key for key in remote_keys_in(keys) if key not in allowed]
    others = [key for key in keys if key not in remote and not _covered(key, API_OVERRIDABLE | set(allowed))]
    parts = []
    if remote:
        parts.append(f"{', '.join(remote)} reach the network or other machines")
    if others:
        verb = "is" if len(others) == 1 else "are"
        parts.append(f"{', '.join(others)} {verb} not among the keys a run started through the API may change")
    if parts:
        raise OverrideRefused(
            f"{source}: {'; '.join(parts)} (allowed: {', '.join(sorted(API_OVERRIDABLE))}; the server's "
            "--allow-override KEY adds one): nothing written, nothing run"
        )


def changed_keys(base: Mapping[str, Any], other: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two params trees (dumps of validated Params)."""
    changed: list[str] = []
    for key in sorted(set(base) | set(other)):
        a, b, dotted = base.get(key), other.get(key), f"{prefix}{key}"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            changed += changed_keys(a, b, f"{dotted}.")
        elif a != b or key not in base or key not in other:
            changed.append(dotted)
    return changed


# Train keys a sweep may search. Not: where and how it runs (launch keys, device: the trials are the
# parallelism), what it starts from (pretrained_*: a file verified by digest) or the seed (each
# trial's is derived from sweep.seed and its number).
SWEEP_FORBIDDEN = frozenset(
    {"strategy", "nproc_per_node", "nnodes", "rdzv_endpoint", "max_restarts", "checkpoint_every", "num_workers"}
    | {"device", "seed", "pretrained", "pretrained_mirror", "pretrained_path", "pretrained_url", "pretrained_sha256"}
    | {"pretrained_max_bytes"}
)
