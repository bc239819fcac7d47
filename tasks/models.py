"""The models: the architectures `train.model` can name, and running one on uint8 images.

Both accept any input size and channel count; weights start random (pretrained weights would need
the internet, and their download is not reproducible offline).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn


def _conv_bn_relu(c_in: int, c_out: int) -> nn.Sequential:
    # conv -> bn -> relu blocks are what quantization fuses, so keep them as one unit.
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class SmallCNN(nn.Module):
    """Three conv blocks and global pooling: ~0.1M parameters, enough for 8x8..32x32 images."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 32, dropout: float = 0.2) -> None:
        super().__init__()
        self.features = nn.Sequential(
            _conv_bn_relu(in_channels, width),
            _conv_bn_relu(width, 2 * width),
            nn.MaxPool2d(2),
            _conv_bn_relu(2 * width, 4 * width),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(4 * width, num_classes))

    def forward(self, x):  # noqa: D102 - standard nn.Module forward
        return self.classifier(self.features(x))


def _small_input_resnet18(in_channels: int, num_classes: int) -> nn.Module:
    # The ImageNet stem (7x7 stride-2 conv + max-pool) shrinks an 8x8 or 32x32 image to almost
    # nothing; the usual CIFAR adaptation is a 3x3 stride-1 stem and no max-pool.
    # Imported here: torchvision pulls in torch._dynamo, ~3.5 s per process for the small CNN.
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


class Classifier(nn.Module):
    """Normalisation + network: takes float pixels in [0, 1], shape (N, C, H, W); returns logits.

    The stats stage's mean/std travel inside the weights (as buffers), so a checkpoint or an
    exported model needs nothing else to be used.
    """

    def __init__(self, net: nn.Module, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.net((x - self.mean) / self.std)


def build_model(name: str, num_classes: int, mean: Sequence[float], std: Sequence[float]) -> Classifier:
    """The model `train.model` names, initialised from torch's (already seeded) RNG."""
    in_channels = len(mean)
    if name == "small_cnn":
        net = SmallCNN(in_channels, num_classes)
    elif name == "resnet18":
        net = _small_input_resnet18(in_channels, num_classes)
    else:
        raise ValueError(f"train.model: unknown model {name!r}; expected small_cnn or resnet18")
    return Classifier(net, mean, std)


def to_float(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """uint8 pixels -> float32 in [0, 1] on `device` (the model normalises from there)."""
    return images.to(device, non_blocking=True).float().div_(255.0)


@torch.no_grad()
def predict(model: nn.Module, images: np.ndarray, device: torch.device, batch_size: int) -> torch.Tensor:
    """Logits for uint8 (N, C, H, W) `images`, in order, on the CPU."""
    model.eval()
    outputs = [
        model(to_float(torch.from_numpy(images[i : i + batch_size]), device)).cpu()
        for i in range(0, len(images), batch_size)
    ]
    return torch.cat(outputs) if outputs else torch.empty(0)
