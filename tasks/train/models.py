"""The models: the architectures `train.model` can name, and running one on uint8 images.

`resnet9` (the default) and `small_cnn` are ours (the registry tasks/core/config/train.py `MODELS`: a
class registered here under each of its names, `@ARCHITECTURES.register(name)`, built as
`cls(in_channels, num_classes)`); every other name is a torchvision classification
builder (resnet*, regnet_*, mobilenet_*, efficientnet_*, convnext_*, vit_*, ...), adapted to the
data: the first convolution takes its channels, the head puts out its classes, and images under
SMALL_INPUT px get a small-input stem.
Weights start random (torchvision's own need the internet); a verified weights file can be loaded
over them (tasks/train/pretrained.py). `head_name` and `stem_name` say which modules a fine-tune treats apart.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import nn

from tasks.core.config.train import MODELS
from tasks.core.errors import ExpectedFailure
from tasks.core.registry import Implementations
from tasks.data.formats import NpyRows
from tasks.data.preprocess import in_batches
from tasks.determinism import escapes

# Shorter image side (px) below which the ImageNet stem (a stride-2, often 7x7, conv and a max-pool:
# 4x less resolution before the first block) would leave a 28 px image a few pixels wide.
SMALL_INPUT = 64
# Families whose geometry is fixed when they are built from the image size (position embeddings,
# attention partitions): their stem stays as it is and the builder is told the size instead.
_SIZED = {"vit_": "image_size", "maxvit_": "input_size"}
# BatchNorm's running statistics: what each step's batch adds (torch's default). torchvision builds
# mobilenet_v3 with 0.01 and mnasnet with 0.0003, TensorFlow's values for ImageNet runs of 100,000s of
# steps. In a run of a few hundred steps they average the weights of many epochs ago, and evaluation
# (which uses them) sees another network: mobilenet_v3_small on 726 icons, 50 epochs of 12 steps,
# trained to 0.74 but answered one class in evaluation (test 0.13); with 0.1, test 0.64 (2026-12-03).
BN_MOMENTUM = 0.1


class ModelError(ExpectedFailure):
    """`train.model` cannot be built, or cannot take the data's images."""


# Our architectures, by their MODELS name: each takes (in_channels, num_classes) and any data size its
# entry's summary promises (it ends in global pooling, or checks the size itself).
ARCHITECTURES: Implementations[type[nn.Module]] = Implementations(MODELS)


def _conv_bn_relu(c_in: int, c_out: int) -> nn.Sequential:
    # conv -> bn -> relu blocks are what quantization fuses, so keep them as one unit.
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


@ARCHITECTURES.register("small_cnn")
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


class _Residual(nn.Module):
    """x + two conv blocks: the identity path lets gradients past the blocks (and ONNX Runtime's int8
    quantizer and torch-pruning both follow an Add)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(_conv_bn_relu(channels, channels), _conv_bn_relu(channels, channels))

    def forward(self, x):  # noqa: D102
        return x + self.body(x)


@ARCHITECTURES.register("resnet9")
class ResNet9(nn.Module):
    """The fast CIFAR-10 baseline's ResNet-9 (Myrtle.ai, D. Page 2018) at a quarter of its width.

    A stem, then three stages of conv block, 2x2 max-pool and residual pair: 32 px -> 16 -> 8 -> 4,
    so the last stage sees a whole 28-32 px object (small_cnn's one pool sees strokes, not shapes).
    ~0.5M parameters; per image it costs less than small_cnn, whose 64 channels run at full resolution.
    On 8x8 digits the stages end at 1x1, which the global pooling takes as it is.
    """

    def __init__(self, in_channels: int, num_classes: int, width: int = 16) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            _conv_bn_relu(in_channels, w),
            *(_conv_bn_relu(w, 2 * w), nn.MaxPool2d(2), _Residual(2 * w)),
            *(_conv_bn_relu(2 * w, 4 * w), nn.MaxPool2d(2), _Residual(4 * w)),
            *(_conv_bn_relu(4 * w, 8 * w), nn.MaxPool2d(2, ceil_mode=True), _Residual(8 * w)),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(8 * w, num_classes)

    def forward(self, x):  # noqa: D102
        return self.classifier(self.features(x))


def torchvision_models() -> list[str]:
    """The classification builders of the installed torchvision (imports it: seconds)."""
    # heavy: torchvision (~3 s beyond torch), only for a torchvision architecture
    import torchvision.models

    return torchvision.models.list_models(module=torchvision.models)


def _torchvision_net(name: str, in_channels: int, num_classes: int, image_size: Sequence[int] | None) -> nn.Module:
    # Imported here: torchvision pulls in torch._dynamo, ~3.5 s per process for the small CNN.
    import torchvision.models

    known = torchvision_models()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3)
        raise ModelError(
            f"train.model: {name!r} is not a classification model of torchvision {_version()}"
            + (f"; did you mean {' or '.join(close)}?" if close else "")
        )
    options: dict[str, object] = {"weights": None, "num_classes": num_classes}
    if name in ("googlenet", "inception_v3"):  # their auxiliary heads make the training forward return a tuple
        options.update(aux_logits=False, init_weights=True)
    sized = next((key for prefix, key in _SIZED.items() if name.startswith(prefix)), None)
    if sized and image_size is not None:
        options[sized] = _square(name, image_size) if sized == "image_size" else tuple(image_size)
    try:
        net = torchvision.models.get_model(name, **options)
    except (ValueError, AssertionError) as exc:  # a size it cannot split into patches or partitions (vit, maxvit)
        raise ModelError(f"train.model: {name} cannot be built for {_shown(image_size)} images: {exc}") from None
    small = not sized and (image_size is None or min(image_size) < SMALL_INPUT)
    _adapt_stem(net, in_channels, small)
    for module in net.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.momentum = BN_MOMENTUM
    return net


def _version() -> str:
    # heavy: torchvision (~3 s beyond torch), only for a torchvision architecture
    import torchvision

    return torchvision.__version__


def _square(name: str, image_size: Sequence[int]) -> int:
    # A ViT's position embeddings are made for one square size; torchvision checks the rest.
    height, width = image_size
    if height != width:
        raise ModelError(f"train.model: {name} takes square images only; the data's are {height}x{width}")
    return height


def _shown(image_size: Sequence[int] | None) -> str:
    return "x".join(map(str, image_size)) if image_size is not None else "224x224"


def _adapt_stem(net: nn.Module, in_channels: int, small: bool) -> None:
    """The first conv takes `in_channels`; for `small` images it keeps full resolution.

    Small input, the CIFAR adaptation generalised: the first conv gets stride 1 and at most a 3x3
    kernel (a 7x7 or 4x4 window at stride 1 covers much of a 28 px image at ~5x the cost), and a
    max-pool right after it (resnet, densenet, googlenet, shufflenet, squeezenet, alexnet) is dropped.
    A conv that changes shape starts from torch's default init (what resnet18's small stem always
    did); one that keeps its shape keeps the family's own init.
    """
    path = stem_name(net)
    conv = net.get_submodule(path)
    kernel, stride, padding = conv.kernel_size, conv.stride, conv.padding
    if small:
        kernel = tuple(min(k, 3) for k in kernel)
        stride, padding = (1, 1), tuple((k - 1) // 2 for k in kernel)
        if (pool := _stem_pool(net, path)) is not None:
            net.set_submodule(pool, nn.Identity())
    if (in_channels, kernel, stride, padding) == (conv.in_channels, conv.kernel_size, conv.stride, conv.padding):
        return
    new = nn.Conv2d(
        in_channels, conv.out_channels, kernel, stride, padding, conv.dilation, conv.groups, bias=conv.bias is not None
    )
    if (in_channels, kernel) == (conv.in_channels, conv.kernel_size):
        new.load_state_dict(conv.state_dict())
    net.set_submodule(path, new)


def _stem_pool(net: nn.Module, stem: str) -> str | None:
    """The max-pool between the first conv and the second, if there is one."""
    after = False
    for name, module in net.named_modules():
        if name == stem:
            after = True
        elif after and isinstance(module, nn.Conv2d):
            return None
        elif after and isinstance(module, nn.MaxPool2d):
            return name
    return None


def stem_name(net: nn.Module) -> str:
    """The path of `net`'s first convolution (torchvision registers modules in the order they run)."""
    return next(name for name, module in net.named_modules() if isinstance(module, nn.Conv2d))


def head_name(net: nn.Module) -> str:
    """The path of `net`'s classifier head: its last Linear (or, squeezenet's, 1x1 Conv2d)."""
    return [name for name, module in net.named_modules() if isinstance(module, (nn.Linear, nn.Conv2d))][-1]


def _check_input(net: nn.Module, name: str, shape: tuple[int, ...], num_classes: int) -> None:
    """Run `net` on meta tensors of the data's shape: a size it cannot take is a one-line error now,
    not a shape error deep in the first step (no memory, no compute, no random numbers drawn)."""
    tensors = (*net.named_parameters(), *net.named_buffers())
    meta = {key: torch.empty_like(value, device="meta") for key, value in tensors}
    training = net.training
    net.eval()
    try:
        out = torch.func.functional_call(net, meta, (torch.empty((2, *shape), device="meta"),))
    except (RuntimeError, ValueError, AssertionError) as exc:
        raise ModelError(
            f"train.model: {name} cannot take {'x'.join(map(str, shape))} images: {str(exc).splitlines()[0]}"
        ) from None
    finally:
        net.train(training)
    if tuple(out.shape) != (2, num_classes):
        raise ModelError(f"train.model: {name} gave logits of shape {tuple(out.shape)}, expected (N, {num_classes})")


class Classifier(nn.Module):
    """Normalisation + network: takes float pixels in [0, 1], shape (N, C, H, W); returns logits.

    The stats stage's mean/std travel inside the weights (as buffers), so a checkpoint or an
    exported model needs nothing else to be used.
    """

    def __init__(
        self,
        net: nn.Module,
        mean: Sequence[float],
        std: Sequence[float],
        *,
        arch: str | None = None,
        image_size: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))
        self.net = net
        # What it was built as (`build_model`): the portable probe's input is made from them.
        self.arch = arch
        self.image_size = tuple(image_size) if image_size is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.net((x - self.mean) / self.std)


def build_model(
    name: str,
    num_classes: int,
    mean: Sequence[float],
    std: Sequence[float],
    image_size: Sequence[int] | None = None,
) -> Classifier:
    """The model `train.model` names, initialised from torch's (already seeded) RNG.

    `image_size` ([H, W] of the data) decides the stem of torchvision models and is checked against
    the architecture; None (checkpoints written before it was recorded) means a small-input stem.
    """
    in_channels = len(mean)
    if name in ARCHITECTURES:
        net = ARCHITECTURES[name](in_channels, num_classes)
    else:
        checked = image_size is None or _checked_without_weights(name, in_channels, num_classes, image_size)
        net = _torchvision_net(name, in_channels, num_classes, image_size)
        if not checked:
            _check_input(net, name, (in_channels, *image_size), num_classes)
    return Classifier(net, mean, std, arch=name, image_size=image_size)


def _checked_without_weights(name: str, in_channels: int, num_classes: int, image_size: Sequence[int]) -> bool:
    """Check the images' size on the network built on the meta device (shapes, no values) before the real
    build: a size it cannot take is refused in a fraction of a second, not after its initialisation drew
    every weight (vgg16's 138M: 15 s here in portable mode). False where the family cannot be built without
    values (regnet computes its widths with tensors): the real one is checked then. Torch's generator is
    left as it was, so the real build draws the same weights."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        try:
            net = _torchvision_net(name, in_channels, num_classes, image_size)
        except NotImplementedError:  # "Cannot copy out of meta tensor": it reads a value while it builds
            return False
    _check_input(net, name, (in_channels, *image_size), num_classes)
    return True


def refuse_unportable(model: nn.Module) -> None:
    """Refuse a model determinism.cpu: portable cannot train on the CPU before its first step, naming it and
    the op (PortableOpError: one line, exit 3); called where CPU training in portable mode is set up.

    A torchvision model `build_model` made is probed through one training step on fake tensors
    (tasks/determinism/escapes.py: no arithmetic, a fraction of a second). Ours are not: their ops are
    fixed, and tests/determinism/test_portable_escapes.py trains them. A model from elsewhere (a pt2e
    graph being fine-tuned) has no recorded input size: the kernels refuse what it reaches as it runs.
    """
    arch, size = getattr(model, "arch", None), getattr(model, "image_size", None)
    if arch is None or arch in ARCHITECTURES or size is None:
        return
    escapes.refuse_unportable(model, arch, (model.mean.shape[1], *size))


def to_float(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """uint8 pixels -> float32 in [0, 1] on `device` (the model normalises from there)."""
    return images.to(device, non_blocking=True).float().div_(255.0)


@torch.no_grad()
def predict(model: nn.Module, images: np.ndarray | NpyRows, device: torch.device, batch_size: int) -> torch.Tensor:
    """Logits for uint8 (N, C, H, W) `images` (in memory, or streamed from their file), in order, on the CPU."""
    model.eval()
    return gather(
        (model(to_float(torch.from_numpy(batch), device)).cpu() for batch in in_batches(images, batch_size)),
        images.shape[0],
    )


def gather(parts: Iterable[torch.Tensor], total: int) -> torch.Tensor:
    """`parts` (rows, in order; `total` in all) in one tensor, made at the first part and filled as they come.

    Not a list joined at the end: its small blocks, outliving each batch's large float copy, fragment the C
    heap, which then keeps the freed copies: scoring a split streamed from its file took memory in
    proportion to the split, several times its size (B12 holds the bound).
    """
    joined, done = torch.empty(0), 0
    for part in parts:
        if done == 0:
            joined = torch.empty((total, *part.shape[1:]), dtype=part.dtype)
        joined[done : done + len(part)] = part
        done += len(part)
    if done != total:  # never hand back rows that were not filled
        raise ValueError(f"expected {total} rows, got {done}")
    return joined
