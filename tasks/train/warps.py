"""The `affine` and `elastic` presets: torchvision's RandomAffine, and RandomAffine then ElasticTransform
(Simard et al.'s distortion for handwriting), drawn image by image as torchvision draws them and applied
a batch at a time.

As v2 transforms they are Python calls per image: on the small images these presets are for, their fixed
cost was up to a third of a CPU training epoch. Here each image's parameters are drawn in v2's order from
torch's global generator (which tasks/train/augment.py seeds per batch): the affine map's angle, scale
and shear, then (elastic) the field's noise, dx then dy. The batch then goes through each of
torchvision's own resampling kernels once, with a grid per image: the affine map (nearest, fill 0), then
the field (bilinear, fill 0). So the images are torchvision's, byte for byte, but for `elastic`'s blur:
the field's Gaussian runs as a row pass and a column pass (it is separable), each one matrix product by
a banded matrix holding the kernel for every field of the batch, where torchvision convolves each field
in 2-D; the field is the same to float rounding (tests/train/test_recipe.py). Two private torchvision
helpers are used, so that the arithmetic is theirs: the inverse affine matrix and the grid resampler
behind v2.functional.affine and elastic, which take one map per call. Imported only when a preset needs
it, and picklable for the loader's forkserver workers.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn
from torchvision.transforms.functional import _get_inverse_affine_matrix
from torchvision.transforms.v2.functional._geometry import _apply_grid_transform, _create_identity_grid

FILL = 0  # v2.RandomAffine's and v2.ElasticTransform's default: black outside the image
CHUNK_PIXELS = 64 * 32 * 32  # pixels per resampling call: a batch of small images at once, a large one alone


class AffineWarp:
    """v2.RandomAffine(degrees, scale=scale, shear=shear) for a batch of uint8 images (N x C x H x W),
    drawing from torch's global generator."""

    def __init__(self, degrees: float, scale: tuple[float, float], shear: float) -> None:
        self.degrees, self.scale, self.shear = degrees, scale, shear

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return self.affine(images, [self.draw_affine() for _ in images])

    def draw_affine(self) -> list[float]:
        """One image's inverse affine matrix (2 x 3, pixels about the centre, as v2.functional.affine
        computes it), drawn as v2.RandomAffine draws it."""
        angle = torch.empty(1).uniform_(-self.degrees, self.degrees).item()
        scale = torch.empty(1).uniform_(*self.scale).item()
        shear = float(torch.empty(1).uniform_(-self.shear, self.shear).item())
        return _get_inverse_affine_matrix([0.0, 0.0], angle, [0.0, 0.0], scale, [shear, 0.0])

    @staticmethod
    def affine(images: torch.Tensor, matrices: list[list[float]]) -> torch.Tensor:
        """Each image through its matrix, as v2.functional.affine resamples it (nearest, fill 0)."""
        theta = torch.tensor(matrices, dtype=torch.float32).reshape(-1, 2, 3)
        return _resample(images, _affine_grids(theta, *images.shape[-2:]), "nearest")


class ElasticWarp(AffineWarp):
    """v2.Compose([v2.RandomAffine(degrees, scale=scale, shear=shear), v2.ElasticTransform(alpha, sigma)])
    for a batch of uint8 images (N x C x H x W), drawing from torch's global generator."""

    def __init__(self, alpha: float, sigma: float, degrees: float, scale: tuple[float, float], shear: float) -> None:
        super().__init__(degrees, scale, shear)
        self.alpha, self.sigma = alpha, sigma

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        height, width = images.shape[-2:]
        matrices, noise = [], []
        for _ in images:  # v2.Compose draws an image's affine map, then its field, then the next image's
            matrices.append(self.draw_affine())
            noise.append(torch.rand(2, height, width) * 2 - 1)  # the numbers of v2's two draws of 1 x 1 x H x W
        grid = _create_identity_grid((height, width), device=images.device, dtype=torch.float32)
        grid = grid + self.displacement(torch.stack(noise))
        return _resample(self.affine(images, matrices), grid, "bilinear")

    def displacement(self, noise: torch.Tensor) -> torch.Tensor:
        """N fields of noise (N x 2 x H x W) blurred and scaled as v2.ElasticTransform does: N x H x W x 2,
        in grid_sample's [-1, 1] units."""
        height, width = noise.shape[-2:]
        dx, dy = blurred_noise(noise, self.sigma).unbind(1)
        return torch.stack([dx * self.alpha / width, dy * self.alpha / height], dim=-1)


def _resample(images: torch.Tensor, grids: torch.Tensor, mode: str) -> torch.Tensor:
    """Each image sampled at its grid (N x H x W x 2) by torchvision's kernel (fill 0, rounded back to
    uint8), a few images per call: the kernel's float copies of a whole batch of large images would
    outgrow the CPU's caches and make each image slower than alone (docs/design-history.md has the figures)."""
    per_call = max(1, CHUNK_PIXELS // (images.shape[-2] * images.shape[-1]))
    parts = zip(images.split(per_call), grids.split(per_call), strict=True)
    return torch.cat([_apply_grid_transform(part, grid, mode, fill=FILL) for part, grid in parts])


def _affine_grids(matrices: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision's `_affine_grid` (the sampling grid of v2.functional.affine, output size = input size)
    for N matrices at once: N x H x W x 2."""
    base = torch.empty(1, height, width, 3)
    base[..., 0].copy_(torch.linspace((1.0 - width) * 0.5, (width - 1.0) * 0.5, steps=width))
    base[..., 1].copy_(torch.linspace((1.0 - height) * 0.5, (height - 1.0) * 0.5, steps=height).unsqueeze_(-1))
    base[..., 2].fill_(1)
    rescaled = matrices.transpose(1, 2).div(torch.tensor([0.5 * width, 0.5 * height]))
    points = base.view(1, height * width, 3).expand(len(matrices), -1, -1)
    return points.bmm(rescaled).view(-1, height, width, 2)


def blurred_noise(noise: torch.Tensor, sigma: float) -> torch.Tensor:
    """Fields (... x H x W) blurred as torchvision's gaussian_blur blurs one (an odd kernel of
    int(8 sigma + 1) taps, edges reflected), one axis at a time."""
    if sigma <= 0:
        return noise
    *lead, height, width = noise.shape
    half, along_rows, along_columns = _blur_matrices(height, width, sigma)
    flat = noise.reshape(-1, 1, height, width)
    padded = nn.functional.pad(flat, [half] * 4, mode="reflect").squeeze(1)  # F x H' x W'
    rows = (padded.reshape(-1, width + 2 * half) @ along_rows).reshape(-1, height + 2 * half, width)
    side_by_side = rows.permute(1, 0, 2).reshape(height + 2 * half, -1)  # H' x (F W)
    blurred = (along_columns @ side_by_side).reshape(height, -1, width).permute(1, 0, 2)
    return blurred.reshape(*lead, height, width)


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
