"""Pretrained weights for the train stage: fetched or read, verified, then fitted to the model.

`train.pretrained_path` (a local file) or `train.pretrained_url` (downloaded with tasks/core/fetch.py:
retries, a size limit, credentials from the environment, cached by digest) must have
`train.pretrained_sha256`. `train.pretrained` names torchvision's published weights of `train.model`
(IMAGENET1K_V1, DEFAULT, ...): torchvision gives their URL and the sha256 prefix in its file name, the
same check torch.hub makes; they are fetched by the same downloader into the same cache (from
`train.pretrained_mirror` when set), or read from `train.pretrained_path` on a machine offline. That
prefix is 32 bits: from a mirror or a path the full `train.pretrained_sha256` is required (config) and
is what the download and the cached copy are checked against; from torchvision's host, over https and
with no credentials, the prefix is checked as torch.hub does, and the lineage records the full digest.
The bytes are read once from a regular file, bounded by `train.pretrained_max_bytes`, hashed,
and only then parsed, so what is loaded is what was verified. Two formats, neither runs code:
safetensors, or a torch state dict that `torch.load(weights_only=True)` accepts (a pickle of other
objects is refused, never unpickled).

Fitting is strict but for the two places a fine-tune changes the architecture: the head (another
number of classes) and the first conv (another kernel, stride or channel count). A head or first conv
whose shape differs keeps its fresh init, except that 3-channel first-conv weights are summed over
RGB for 1-channel data (as timm does: a grey image is R = G = B, so the sum is the same filter). Any
other missing, unexpected or misshapen tensor means weights of another architecture: refused, naming
a few. The data's mean/std stay the model's (the stats stage's), whatever the file carries.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from tasks.core.config.train import TrainConfig
from tasks.core.credentials import NO_CREDENTIALS, Auth
from tasks.core.errors import ExpectedFailure
from tasks.core.fetch import Checksum, Retry, fetch
from tasks.core.redact import redact
from tasks.train.models import Classifier, head_name, stem_name

SHOWN = 5  # keys named in an error, of each kind


class PretrainedError(ExpectedFailure):
    """Pretrained weights that cannot be used: unreadable, unverified, too large, or of another model."""


@dataclass(frozen=True)
class Pretrained:
    """What was loaded, for the lineage (checkpoint metadata, train.json, MLflow tags, model card)."""

    sha256: str
    source: str  # the path, or the URL with any credentials masked
    reinitialised: tuple[str, ...]  # tensors left at their fresh init (a new head, an adapted first conv)

    def lineage(self) -> dict[str, str]:
        return {
            "pretrained.sha256": self.sha256,
            "pretrained.source": self.source,
            "pretrained.reinitialised": ", ".join(self.reinitialised) or "none",
        }


def load_pretrained(cfg: TrainConfig, model: Classifier, cache: Path) -> Pretrained | None:
    """Load `cfg`'s pretrained weights into `model.net` in place; None when `cfg` names none.

    A URL is downloaded into `cache` (once: a verified copy is reused). Raises PretrainedError (or
    tasks.core.fetch.DownloadError) before changing `model` when the file is not the one configured.
    """
    if cfg.pretrained is not None:
        path, source, expected = _published_file(cfg, Path(cache))
    elif cfg.pretrained_url is not None:
        assert cfg.pretrained_sha256 is not None  # TrainConfig insists
        source, expected = redact(cfg.pretrained_url), Checksum("sha256", cfg.pretrained_sha256)
        auth = Auth.from_environment([cfg.pretrained_url])
        dest = Path(cache) / "weights" / cfg.pretrained_sha256
        path = fetch([cfg.pretrained_url], dest, expected, Retry(), cfg.pretrained_max_bytes, auth)
    elif cfg.pretrained_path is not None:
        assert cfg.pretrained_sha256 is not None  # TrainConfig insists
        source, path = redact(cfg.pretrained_path), Path(cfg.pretrained_path)
        expected = Checksum("sha256", cfg.pretrained_sha256)
    else:
        return None
    data, sha256 = _verified_bytes(path, source, expected, cfg.pretrained_max_bytes)
    if cfg.pretrained_sha256 is not None and sha256 != cfg.pretrained_sha256:
        raise PretrainedError(f"{source}: sha256 {sha256}, but train.pretrained_sha256 is {cfg.pretrained_sha256}")
    reinitialised = _fit(model, _tensors(data, source), source, cfg.model)
    return Pretrained(sha256, source, tuple(reinitialised))


def published_weights(model: str, name: str) -> tuple[str, str]:
    """torchvision's published weights `name` of `model`: (URL, the sha256 prefix in its file name)."""
    # heavy: torchvision (~3 s beyond torch), only for published weights
    from torchvision.models import get_model_weights

    try:
        weights = get_model_weights(model)
    except (ValueError, KeyError):
        raise PretrainedError(f"train.pretrained: train.model {model} has no torchvision weights") from None
    try:
        url = weights[name].url
    except KeyError:
        names = ", ".join(["DEFAULT", *(w.name for w in weights)])
        raise PretrainedError(f"train.pretrained: {name} is not a weights name of {model} ({names})") from None
    found = re.search(r"-([0-9a-f]{8,64})\.[A-Za-z0-9]+$", url)  # torch.hub's HASH_REGEX, anchored
    if found is None:
        raise PretrainedError(
            f"train.pretrained: {model} {name}: {url} carries no hash to check; download it yourself and give "
            "pretrained_path with pretrained_sha256"
        )
    return url, found.group(1)


def _published_file(cfg: TrainConfig, cache: Path) -> tuple[Path, str, Checksum]:
    """(path, source, checksum) of `cfg.pretrained`: the file given, or fetched into the cache."""
    assert cfg.pretrained is not None
    url, prefix = published_weights(cfg.model, cfg.pretrained)
    name = url.rsplit("/", 1)[-1]
    checksum = Checksum("sha256", prefix, prefix=True)
    if cfg.pretrained_sha256 is not None:  # the whole digest: what the download and the cached copy must have
        if not cfg.pretrained_sha256.startswith(prefix):
            raise PretrainedError(
                f"train.pretrained: {cfg.model} {cfg.pretrained}: train.pretrained_sha256 is {cfg.pretrained_sha256}, "
                f"but torchvision publishes {name} as sha256 {prefix}...: not that file"
            )
        checksum = Checksum("sha256", cfg.pretrained_sha256)
    if cfg.pretrained_path is not None:  # an offline machine, given the published file
        return Path(cfg.pretrained_path), f"{redact(cfg.pretrained_path)} ({cfg.model} {cfg.pretrained})", checksum
    mirror = cfg.pretrained_mirror
    urls = [f"{mirror.rstrip('/')}/{name}"] if mirror else [url]
    # credentials go to a mirror the user named, never to torchvision's host (not even a netrc entry)
    auth = Auth.from_environment([mirror]) if mirror else NO_CREDENTIALS
    path = fetch(urls, cache / "weights" / name, checksum, Retry(), cfg.pretrained_max_bytes, auth)
    return path, f"{redact(urls[0])} ({cfg.model} {cfg.pretrained})", checksum


def _verified_bytes(path: Path, source: str, expected: Checksum, max_bytes: int) -> tuple[bytes, str]:
    """The file's bytes, read once, and their sha256: the digest is of exactly what is parsed next."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below, unread
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise PretrainedError(f"{source}: cannot be read: {exc.strerror} (the weights of train.pretrained_*)") from None
    with open(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):  # /dev/zero, /dev/urandom, a FIFO: endless, or not a file at all
            raise PretrainedError(f"{source}: not a regular file (the weights of train.pretrained_*): not read")
        if info.st_size > max_bytes:
            raise PretrainedError(f"{source}: more than train.pretrained_max_bytes ({max_bytes}) bytes")
        data = handle.read(max_bytes + 1)  # bounded again: the file may grow after fstat
    if len(data) > max_bytes:
        raise PretrainedError(f"{source}: more than train.pretrained_max_bytes ({max_bytes}) bytes")
    got = hashlib.sha256(data).hexdigest()
    if not expected.matches(got):
        wanted = (
            f"torchvision publishes {expected.expected()}"
            if expected.prefix
            else f"train.pretrained_sha256 is {expected.hexdigest}"
        )
        raise PretrainedError(f"{source}: sha256 {got}, but {wanted}; not loaded (another or a changed file)")
    return data, got


def _tensors(data: bytes, source: str) -> dict[str, torch.Tensor]:
    """safetensors, else a weights-only torch file; a flat name -> tensor mapping either way."""
    try:
        return load_safetensors(data)
    except (SafetensorError, ValueError, OSError):
        pass
    try:
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        raise PretrainedError(
            f"{source}: neither safetensors nor a torch state dict that loads with weights_only=True "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}); a pickle of other "
            "objects is never unpickled: save the state_dict, or convert it to safetensors"
        ) from None
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]  # the common {"state_dict": ..., "epoch": ...} wrapper
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        raise PretrainedError(f"{source}: a torch file, but not a state dict (a mapping of names to tensors)")
    return loaded


def _fit(model: Classifier, incoming: dict[str, torch.Tensor], source: str, name: str) -> list[str]:
    """Copy `incoming` into `model.net`; the names left at their fresh init."""
    incoming = _bare(incoming)
    target = model.net.state_dict()
    head, stem = head_name(model.net), stem_name(model.net)
    adaptable = {key for key in target if key.rpartition(".")[0] in (head, stem)}
    missing = sorted(set(target) - set(incoming) - adaptable)
    unexpected = sorted(set(incoming) - set(target))
    misshapen = sorted(
        key for key in (set(target) & set(incoming)) - adaptable if incoming[key].shape != target[key].shape
    )
    if missing or unexpected or misshapen:
        problems = [
            f"{label} {len(keys)}: {', '.join(keys[:SHOWN])}{', ...' if len(keys) > SHOWN else ''}"
            for label, keys in (("missing", missing), ("unexpected", unexpected), ("other shapes", misshapen))
            if keys
        ]
        raise PretrainedError(
            f"{source}: not weights of train.model {name} as adapted to this data ({'; '.join(problems)})"
        )
    state, fresh = {}, []
    for key, value in target.items():
        loaded = incoming.get(key)
        if loaded is not None and key.startswith(f"{stem}.") and loaded.dim() == 4 and value.shape[1] == 1:
            loaded = loaded.sum(dim=1, keepdim=True) if loaded.shape[1] == 3 else loaded
        if loaded is None or loaded.shape != value.shape:
            state[key] = value
            fresh.append(key)
        else:
            state[key] = loaded.to(value.dtype)
    model.net.load_state_dict(state)
    return fresh


def _bare(incoming: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names as the network has them: a lockstep checkpoint's `net.` prefix (and its data's mean/std)
    and DDP's `module.` prefix are dropped, so torchvision's own and our checkpoints both fit."""
    if {"mean", "std"} <= set(incoming) and all(k.startswith("net.") for k in set(incoming) - {"mean", "std"}):
        incoming = {k.removeprefix("net."): v for k, v in incoming.items() if k not in ("mean", "std")}
    if incoming and all(k.startswith("module.") for k in incoming):
        incoming = {k.removeprefix("module."): v for k, v in incoming.items()}
    return incoming
