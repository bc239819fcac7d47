"""`train.augment: elastic`'s distortion: torchvision's ElasticTransform, its field blurred in two 1-D passes.

torchvision blurs the displacement field with the 2-D Gaussian, (8 sigma + 1)^2 multiply-adds per pixel:
at sigma 4 most of the transform's time, the more so the larger the image (a tenth of a second per 224 px
image). A Gaussian is separable: the same kernel as a row pass, then a column pass, gives the same field
to float rounding at 2 (8 sigma + 1). The noise is drawn as torchvision draws it (dx, then dy,
from torch's global generator, which tasks/train/augment.py seeds per batch). A module of its own, imported
only when the preset is used (torchvision then loads), and picklable for the loader's forkserver workers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchvision.transforms import v2


class SeparableElasticTransform(v2.ElasticTransform):
    """v2.ElasticTransform with the same alpha and sigma, drawing the same noise, blurred separably."""

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        height, width = v2.functional.get_size(flat_inputs[0])
        dx = blurred_noise(height, width, float(self.sigma[0])) * self.alpha[0] / width
        dy = blurred_noise(height, width, float(self.sigma[1])) * self.alpha[1] / height
        return {"displacement": torch.concat([dx, dy], 1).permute([0, 2, 3, 1])}  # 1 x H x W x 2


def blurred_noise(height: int, width: int, sigma: float) -> torch.Tensor:
    """Uniform noise in [-1, 1), 1 x 1 x H x W, blurred as torchvision's gaussian_blur blurs it (an odd
    kernel of int(8 sigma + 1) taps, edges reflected), one axis at a time."""
    noise = torch.rand(1, 1, height, width) * 2 - 1
    if sigma <= 0:
        return noise
    size = int(8 * sigma + 1) | 1
    half = size // 2
    taps = torch.exp(-0.5 * (torch.linspace(-half, half, size) / sigma) ** 2)
    taps = taps / taps.sum()
    padded = nn.functional.pad(noise, [half, half, half, half], mode="reflect")
    rows = nn.functional.conv2d(padded, taps.view(1, 1, 1, size))
    return nn.functional.conv2d(rows, taps.view(1, 1, size, 1))
