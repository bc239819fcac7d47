"""Augmentation, seeded so that the bytes stay fixed: `train.augment`, `train.random_shift`, `train.hflip`,
`train.mixup_alpha`, `train.cutmix_alpha`.

Two places, each with its own seed:
- While a batch is fetched (`AugmentedBatches`, in the DataLoader's workers when `num_workers` > 0):
  the random shift, the mirror, then the preset's policy, drawn from (seed, the batch's sample
  indices), so the number of loader workers changes nothing. torchvision.transforms.v2's policies
  (TrivialAugment, RandAugment, RandomResizedCrop) are Python per image (a few hundred microseconds
  each, on any device): in workers they overlap the training step, where on the GPU they would hold the
  step up. `affine` and `elastic` draw as v2 does, image by image, but resample the whole batch at once
  (tasks/train/warps.py).
- On the device, in the training loop (`BatchMixing`): MixUp or CutMix, one draw per batch, cheap,
  seeded from (seed, epoch, step, rank).
v2 draws its choices from torch's global CPU generator, so each draw runs with that generator seeded and
put back afterwards (`_seeded`): nothing else's random stream moves, and an interrupted and resumed run
augments each batch as the unbroken one did. On the CPU in portable mode the policies run on the pinned
ATen kernels, and the loader's workers compute in portable mode as the training process does
(tasks/determinism/pinning.py), so the bytes are the same on every x86-64.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from tasks.core.config.train import AUGMENT_PRESETS, TrainConfig
from tasks.core.registry import Implementations
from tasks.data.formats import NpyRows
from tasks.data.preprocess import Preprocessed, take_rows

# RandomResizedCrop's area range for photos: torchvision's reference recipe uses (0.08, 1) on 224 px
# ImageNet crops; on 32 px images a crop of 8% (9x9 px) upscaled leaves little of the object.
CROP_SCALE = (0.25, 1.0)
# affine: a small rotation, scaling and shear of each image (its shift is random_shift's)
AFFINE_DEGREES, AFFINE_SCALE, AFFINE_SHEAR = 10.0, (0.9, 1.1), 10.0
# elastic: the same affine map and a smooth random displacement of every pixel, Simard et al.'s
# distortion for handwriting (ICDAR 2003: alpha 34, sigma 4 on 29 px digits), as torchvision's
# ElasticTransform draws it: in pixels from 28 px up, smaller in proportion below (an 8 px image cannot
# hold a sigma-4 blur). Not larger in proportion above: the blur's band, and its cost, grow with sigma.
# Below, sigma scales with the side and alpha with its square: the blur averages the noise down by
# sigma, so a displacement in pixels goes as alpha / sigma (alpha scaled alone left it as large in
# pixels on an 8 px image as on a 28 px one).
ELASTIC_ALPHA, ELASTIC_SIGMA, ELASTIC_AT_PX = 34.0, 4.0, 28
Transform = Callable[[torch.Tensor], torch.Tensor]  # a torchvision v2 transform of one uint8 image
Policy = Callable[[torch.Tensor], torch.Tensor]  # a uint8 batch, moved by draws from torch's global generator
# Each preset of AUGMENT_PRESETS (tasks/core/config/train.py: whether it shifts and mirrors) registers here
# what it does after the shift and the mirror: a builder of its batch policy from the image size ([H, W]),
# or of None (nothing more). A policy is a picklable callable (the loader's workers get it pickled).
POLICIES: Implementations[Callable[[tuple[int, ...]], Policy | None]] = Implementations(AUGMENT_PRESETS)


def shift_pixels(cfg: TrainConfig, image_size: tuple[int, ...]) -> int:
    """`train.random_shift` in pixels under a shifting preset: `auto` is an eighth of the shorter side,
    at least 1; 0 under the other presets."""
    if not AUGMENT_PRESETS[cfg.augment].shifts:
        return 0
    return max(1, round(min(image_size) / 8)) if cfg.random_shift == "auto" else int(cfg.random_shift)


class AugmentedBatches(Dataset):
    """A split of uint8 images, fetched a batch at a time, randomly shifted and mirrored if asked.

    A batch's shifts and flips are drawn from a generator seeded by (seed, the batch's sample
    indices), so augmentation does not depend on which worker fetches the batch or on how many
    workers there are: `num_workers` 0 and 2 give the same weights.
    """

    def __init__(
        self, split: Preprocessed, max_shift: int, hflip: bool, seed: int, policy: Policy | None = None
    ) -> None:
        # in memory, or rows of the file read per batch (a split larger than memory: tasks/data/preprocess.py)
        self.rows = split.images if isinstance(split.images, NpyRows) else None
        self.images = None if self.rows is not None else torch.from_numpy(np.ascontiguousarray(split.images))
        self.labels = torch.from_numpy(np.ascontiguousarray(split.labels))
        self.max_shift = max_shift
        self.hflip = hflip
        self.seed = seed
        self.policy = policy  # after the shift and the mirror

    def __len__(self) -> int:
        return len(self.labels)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices)
        images, labels = self._images(indices), self.labels[index]
        if self.max_shift or self.hflip or self.policy is not None:
            state = np.random.SeedSequence([self.seed, *indices]).generate_state(3, dtype=np.uint32)
            if self.max_shift:
                images = _random_shift(images, self.max_shift, torch.Generator().manual_seed(int(state[0])))
            if self.hflip:
                images = _random_hflip(images, torch.Generator().manual_seed(int(state[1])))
            if self.policy is not None:
                with _seeded(int(state[2])):
                    images = self.policy(images)
        return images, labels

    def _images(self, indices: list[int]) -> torch.Tensor:
        if self.rows is None:
            return self.images[torch.as_tensor(indices)]
        return torch.from_numpy(take_rows(self.rows, indices))


def augmented_batches(split: Preprocessed, cfg: TrainConfig, seed: int) -> AugmentedBatches:
    """The training split as `cfg` fetches it: shifted, mirrored and through the policy its preset names."""
    mirror = bool(cfg.hflip) and AUGMENT_PRESETS[cfg.augment].mirrors
    size = split.images.shape[2:]
    policy = POLICIES[cfg.augment](tuple(size))
    return AugmentedBatches(split, shift_pixels(cfg, size), mirror, seed, policy)


# The builders import torchvision and warps.py inside: a run without a policy never loads them.


@POLICIES.register("shift_flip")
@POLICIES.register("none")
def _no_policy(image_size: tuple[int, ...]) -> None:
    return None


@POLICIES.register("affine")
def _affine(image_size: tuple[int, ...]) -> Policy:
    # heavy: tasks.train.warps loads torchvision (~3 s beyond torch), only for the presets that warp
    from tasks.train.warps import AffineWarp

    return AffineWarp(AFFINE_DEGREES, AFFINE_SCALE, AFFINE_SHEAR)


@POLICIES.register("elastic")
def _elastic(image_size: tuple[int, ...]) -> Policy:
    # heavy: tasks.train.warps loads torchvision (~3 s beyond torch), only for the presets that warp
    from tasks.train.warps import ElasticWarp

    scale = min(*image_size, ELASTIC_AT_PX) / ELASTIC_AT_PX
    return ElasticWarp(ELASTIC_ALPHA * scale**2, ELASTIC_SIGMA * scale, AFFINE_DEGREES, AFFINE_SCALE, AFFINE_SHEAR)


@POLICIES.register("trivialaugment")
def _trivialaugment(image_size: tuple[int, ...]) -> Policy:
    # heavy: torchvision (~3 s beyond torch), only when a preset that needs it is built
    from torchvision.transforms import v2

    return PerImage(v2.TrivialAugmentWide())


@POLICIES.register("randaugment")
def _randaugment(image_size: tuple[int, ...]) -> Policy:
    # heavy: torchvision (~3 s beyond torch), only when a preset that needs it is built
    from torchvision.transforms import v2

    return PerImage(v2.RandAugment())


@POLICIES.register("resized_crop")
def _resized_crop(image_size: tuple[int, ...]) -> Policy:
    # heavy: torchvision (~3 s beyond torch), only when a preset that needs it is built
    from torchvision.transforms import v2

    return PerImage(v2.RandomResizedCrop(list(image_size), scale=CROP_SCALE, antialias=True))


class PerImage:
    """A torchvision v2 transform as a batch policy: image by image. A class, not a closure: the
    loader's forkserver workers get it pickled."""

    def __init__(self, transform: Transform) -> None:
        self.transform = transform

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.transform(image) for image in images])


def _random_hflip(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Mirror each image left-right with probability 1/2."""
    flip = torch.rand(len(images), generator=generator) < 0.5
    return torch.where(flip[:, None, None, None], images.flip(-1), images)


def _random_shift(images: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Translate each image by up to `max_shift` pixels in x and y, filling with zeros."""
    n, c, h, w = images.shape
    padded = nn.functional.pad(images, (max_shift,) * 4)
    dy, dx = torch.randint(0, 2 * max_shift + 1, (2, n, 1), generator=generator)
    rows = (dy + torch.arange(h))[:, None, :, None]
    cols = (dx + torch.arange(w))[:, None, None, :]
    return padded[torch.arange(n)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]


class BatchMixing:
    """MixUp or CutMix (`train.mixup_alpha`, `train.cutmix_alpha`) of whole batches on the training device."""

    def __init__(self, cfg: TrainConfig, num_classes: int, seed: int, rank: int) -> None:
        mixers = []
        if cfg.mixup_alpha > 0 or cfg.cutmix_alpha > 0:
            # heavy: torchvision (~3 s beyond torch), only when a preset that needs it is built
            from torchvision.transforms import v2

            if cfg.mixup_alpha > 0:
                mixers.append(v2.MixUp(alpha=cfg.mixup_alpha, num_classes=num_classes))
            if cfg.cutmix_alpha > 0:
                mixers.append(v2.CutMix(alpha=cfg.cutmix_alpha, num_classes=num_classes))
        # both: one of the two per batch, at even odds (torchvision's reference recipe)
        self.mixer = v2.RandomChoice(mixers) if len(mixers) > 1 else (mixers[0] if mixers else None)
        self.seed, self.rank = seed, rank

    def __call__(self, x: torch.Tensor, y: torch.Tensor, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A float batch and its labels, mixed: the images and the targets (class probabilities) the loss
        is taken against; unmixed, the labels themselves."""
        if self.mixer is None:
            return x, y
        seed = np.random.SeedSequence([self.seed, epoch, step, self.rank]).generate_state(1)[0]
        with _seeded(int(seed)):
            return self.mixer(x, y)


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """torch's CPU generator seeded for a block, and put back as it was after it (v2 draws from it).
    CUDA generators are left alone: v2 draws its choices on the CPU."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # not torch.manual_seed: that seeds CUDA's too
        yield
