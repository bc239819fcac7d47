"""`train.augment: elastic`'s distortion: torchvision's ElasticTransform, its field blurred in two 1-D passes.

torchvision blurs each displacement field with the 2-D Gaussian, (8 sigma + 1)^2 multiply-adds per pixel:
at sigma 4 most of the transform's time, the more so the larger the image (a tenth of a second per 224 px
image). A Gaussian is separable: the same kernel as a row pass, then a column pass, gives the same field
to float rounding at 2 (8 sigma + 1). Each pass is one matrix product for both fields (dx and dy), by a
banded matrix holding the kernel: on the small images this preset is for, a call's fixed cost (the more in
portable mode) outweighs its arithmetic, and four convolutions cost about three times two products. The
noise is drawn as torchvision draws it (dx, then dy, from torch's global generator, which
tasks/train/augment.py seeds per batch). A module of its own, imported only when the preset is used
(torchvision then loads), and picklable for the loader's forkserver workers.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
from torch import nn
from torchvision.transforms import v2


class SeparableElasticTransform(v2.ElasticTransform):
    """v2.ElasticTransform with one sigma for both axes, drawing the same noise, blurred separably."""

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        if self.sigma[0] != self.sigma[1]:
            raise ValueError(f"one sigma for both axes, got {self.sigma}")
        height, width = v2.functional.get_size(flat_inputs[0])
        dx, dy = blurred_noise(height, width, float(self.sigma[0]))
        displacement = torch.stack([dx * self.alpha[0] / width, dy * self.alpha[1] / height], dim=-1)
        return {"displacement": displacement.unsqueeze(0)}  # 1 x H x W x 2


def blurred_noise(height: int, width: int, sigma: float) -> torch.Tensor:
    """Two fields (2 x H x W) of uniform noise in [-1, 1), each blurred as torchvision's gaussian_blur
    blurs it (an odd kernel of int(8 sigma + 1) taps, edges reflected), one axis at a time."""
    noise = torch.rand(2, height, width) * 2 - 1  # what two draws of 1 x 1 x H x W give
    if sigma <= 0:
        return noise
    half, along_rows, along_columns = _blur_matrices(height, width, sigma)
    padded = nn.functional.pad(noise.unsqueeze(1), [half] * 4, mode="reflect").squeeze(1)  # 2 x H' x W'
    rows = (padded.reshape(-1, width + 2 * half) @ along_rows).reshape(2, height + 2 * half, width)
    side_by_side = rows.permute(1, 0, 2).reshape(height + 2 * half, 2 * width)
    return (along_columns @ side_by_side).reshape(height, 2, width).permute(1, 0, 2)


@lru_cache(maxsize=8)
def _blur_matrices(height: int, width: int, sigma: float) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(half the kernel, W' x W, H x H'): a padded field times the first blurs its rows; the second
    times a field blurs its columns."""
    size = int(8 * sigma + 1) | 1
    half = size // 2
    taps = torch.exp(-0.5 * (torch.linspace(-half, half, size) / sigma) ** 2)
    taps = taps / taps.sum()
    return half, _banded(width, taps), _banded(height, taps).T.contiguous()


def _banded(n: int, taps: torch.Tensor) -> torch.Tensor:
    """(n + len(taps) - 1) x n: column j holds `taps` from row j on."""
    matrix = torch.zeros(n + len(taps) - 1, n)
    rows = torch.arange(len(taps))[:, None] + torch.arange(n)[None, :]
    matrix[rows, torch.arange(n).expand_as(rows)] = taps[:, None].expand_as(rows)
    return matrix
