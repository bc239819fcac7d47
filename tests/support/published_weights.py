"""torchvision's weights registry with one stand-in entry: mobilenet_v3_small weights made here.

torchvision names its published weights by URL, with the first 8 hex digits of their sha256 in the
file name; no test may download them. `publish` makes real weights of ImageNet's shapes (a torch
state dict as torchvision saves them), and lists them under such a name at `base_url`, for
`train.pretrained: IMAGENET1K_V1` (or `DEFAULT`) of mobilenet_v3_small. Every other model is
torchvision's own.
"""

from __future__ import annotations

import hashlib
import io

import pytest
import torch

from tasks.determinism.bootstrap import start


def publish(monkeypatch: pytest.MonkeyPatch, base_url: str) -> tuple[bytes, str]:
    """(the weights' bytes, their published file name), listed at `base_url`/<name> for this test."""
    import torchvision
    from torchvision.models._api import Weights, WeightsEnum

    start(1, torch.get_num_threads())  # the same weights every run (the thread count left as it is)
    buffer = io.BytesIO()
    torch.save(torchvision.models.mobilenet_v3_small(weights=None).state_dict(), buffer)
    data = buffer.getvalue()
    name = f"mobilenet_v3_small-{hashlib.sha256(data).hexdigest()[:8]}.pth"

    class Published(WeightsEnum):
        IMAGENET1K_V1 = Weights(url=f"{base_url}/{name}", transforms=None, meta={})
        DEFAULT = IMAGENET1K_V1

    real = torchvision.models.get_model_weights
    monkeypatch.setattr(
        torchvision.models,
        "get_model_weights",
        lambda model: Published if model == "mobilenet_v3_small" else real(model),
    )
    return data, name
