"""Who may change which keys: runs started through the API (remote keys) and sweeps."""

from __future__ import annotations

from typing import Any

from tasks.core.config.base import OverrideRefused

# Keys whose values reach the network, other machines or files outside the project. A run started
# through the Prefect API (a deployment's `overrides`) may not change them unless whoever started the
# server allowed it (`python -m flows.deployments serve --allow-override KEY`): else a web page or
# anyone who can reach the API could point the data at their server or the train stage at their
# rendezvous, and the flow would write it into params.yaml for good.
REMOTE_KEYS = (
    "data.url",
    "data.mirror",
    "data.path",
    "data.sha256",
    "train.rdzv_endpoint",
    "train.nnodes",
    "train.pretrained_url",
    "train.pretrained_path",
    "train.pretrained_sha256",
    "sweep.address",
    "sweep.storage",
)


def refuse_remote_overrides(overrides: dict[str, Any], allowed: frozenset[str] | set[str]) -> None:
    """Raise ConfigError if `overrides` sets a REMOTE_KEYS key (or its whole section) not in `allowed`."""
    refused = sorted(
        key
        for key in overrides
        if key not in allowed and any(key == remote or remote.startswith(f"{key}.") for remote in REMOTE_KEYS)
    )
    if refused:
        raise OverrideRefused(
            f"overrides: {', '.join(refused)} reach the network or other machines and cannot be overridden "
            "through a deployment run unless the server was started with --allow-override for them"
        )


# Train keys a sweep may search. Not: where and how it runs (launch keys, device: the trials are the
# parallelism), what it starts from (pretrained_*: a file verified by digest) or the seed (each
# trial's is derived from sweep.seed and its number).
SWEEP_FORBIDDEN = frozenset(
    {"strategy", "nproc_per_node", "nnodes", "rdzv_endpoint", "max_restarts", "checkpoint_every", "num_workers"}
    | {"device", "seed", "pretrained_path", "pretrained_url", "pretrained_sha256", "pretrained_max_bytes"}
)
