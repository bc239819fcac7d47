"""determinism.cpu: portable lets no matrix product or convolution escape to a kernel whose bytes depend on
the CPU, and refuses a model that would reach one as it is built, naming the op.

The escape test trains one SGD step of a model of each family in the zoo in one process started as a
stage is (`start`: portable pinned before torch loads, then the seeds and switches), with two witnesses:
- the libraries themselves: MKL_VERBOSE=1 and ONEDNN_VERBOSE=1 make MKL and oneDNN print a line per
  call; none may appear while the zoo trains, and the same process, its portable kernels uninstalled
  (native mode's kernels), shows that they do print, so silence is not a broken witness;
- every ATen op the steps reach (escapes.OpRecorder): each that multiplies matrices or convolves must be
  one the portable kernels compute or refuse (`dispatch.handles`), and the build-time probe (fake tensors)
  must see the same of them as the real step.
"""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest
import torch
from torch import nn

from tasks.core.config.train import TrainConfig
from tasks.core.errors import ExitCode
from tasks.data.preprocess import Preprocessed
from tasks.determinism import escapes, kernels
from tasks.train import models
from tasks.train.loop import build_training
from tests.support.portable import portable_kernels, run_script

# One model of each family, and the project's own; bf16 (train.amp) for two of them.
ZOO = [
    ("small_cnn", "fp32"),
    ("resnet9", "fp32"),
    ("resnet18", "fp32"),
    ("mobilenet_v3_small", "fp32"),
    ("efficientnet_b0", "fp32"),
    ("regnet_x_400mf", "fp32"),
    ("convnext_tiny", "fp32"),
    ("resnet9", "bf16"),
    ("mobilenet_v3_small", "bf16"),
]
SIZE, BATCH = 16, 3  # RGB images: small, so the step is quick; the ops a model reaches do not change with size
# ATen ops that multiply matrices or convolve, or compute with the libraries portable keeps out, by name.
PRODUCT_LIKE = re.compile(
    r"mm|mv|dot|conv|linear|matmul|einsum|bilinear|attention|gemm|mkldnn|nnpack|linalg|lstsq|cholesky|svd"
    r"|eig|solve|inverse|_fft|rnn|lstm|gru|quantized|pack"
)
LIBRARY_CALL = re.compile(r"^(MKL_VERBOSE|onednn_verbose,.*,exec,)")
STEPS = """
import ctypes, json, sys
from tasks.determinism.bootstrap import start
start(0, 2, strict=True, cpu="portable")
import torch
import torch.nn.functional as F
from tasks.determinism import dispatch
from tasks.determinism.escapes import OpRecorder, training_step_ops
from tasks.train.models import build_model

libc = ctypes.CDLL(None)
def section(name):  # MKL and oneDNN print through C's stdout buffer: flushed, their lines fall in their section
    libc.fflush(None)
    print(f"@@ {name}", flush=True)

size, batch = int(sys.argv[2]), int(sys.argv[3])
generator = torch.Generator().manual_seed(0)
report = {}
for name, amp in json.loads(sys.argv[1]):
    model = build_model(name, 10, [0.5] * 3, [0.25] * 3, [size, size])
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    images = torch.rand(batch, 3, size, size, generator=generator)
    labels = torch.randint(0, 10, (batch,), generator=generator)
    section(f"{name} {amp}")
    recorder = OpRecorder()
    with recorder:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "bf16"):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimiser.step()
    probe = training_step_ops(model, (3, size, size))
    report[f"{name} {amp}"] = {
        "ops": {op.name(): dispatch.handles(op) for op in recorder.ops},
        "refused": recorder.refused,
        "probed": {op.name(): dispatch.handles(op) for op in probe.ops},
        "probe_refused": probe.refused,
        "probe_failure": probe.failure,
    }
section("attention inference")  # nn.MultiheadAttention's fused inference path (vit_* evaluating) calls bmm.out
attention = torch.nn.MultiheadAttention(64, 2, batch_first=True).eval()
tokens = torch.rand(2, 16, 64, generator=generator)
with torch.no_grad():
    attention(tokens, tokens, tokens, need_weights=False)
section("out= and in-place products")  # what other ops' CPU kernels, or user code, may call
a, b, bias = torch.rand(64, 64, generator=generator), torch.rand(64, 64, generator=generator), torch.rand(64)
torch.mm(a, b, out=torch.empty(64, 64))
torch.bmm(a[None], b[None], out=torch.empty(1, 64, 64))
torch.addmm(bias, a, b, out=torch.empty(64, 64))
torch.rand(64, 64).addmm_(a, b)
torch._addmm_activation(bias, a, b, use_gelu=True)
image, kernel = a[None, None], b[None, None, :3, :3]
torch._convolution(image, kernel, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, False, True, True, False)
section("control")
dispatch.uninstall()  # torch's own kernels, as native mode computes: MKL and oneDNN must print now
torch.backends.mkldnn.enabled = True
torch.rand(64, 64) @ torch.rand(64, 64)
F.conv2d(torch.rand(2, 3, 16, 16), torch.rand(8, 3, 3, 3))
section("end")
print("REPORT " + json.dumps(report))
"""


def _run_zoo() -> tuple[dict, dict[str, list[str]]]:
    """The step report, and the library lines printed in each section of the process's output."""
    stdout = run_script(STEPS, json.dumps(ZOO), str(SIZE), str(BATCH), MKL_VERBOSE="1", ONEDNN_VERBOSE="1")
    calls: dict[str, list[str]] = {}
    section = "start"
    report = {}
    for line in stdout.splitlines():
        if line.startswith("@@ "):
            section = line[3:]
        elif line.startswith("REPORT "):
            report = json.loads(line[len("REPORT ") :])
        elif LIBRARY_CALL.match(line):
            calls.setdefault(section, []).append(line[:160])
    return report, calls


@pytest.mark.slow
def test_no_product_or_convolution_of_the_zoo_escapes_theportable_kernels() -> None:
    report, calls = _run_zoo()
    # the witnesses work: without the portable kernels, the same process's products print
    control = calls.get("control", [])
    assert any(line.startswith("MKL_VERBOSE SGEMM") for line in control), "MKL_VERBOSE printed nothing: vacuous"
    assert any(",exec," in line and "convolution" in line for line in control), "ONEDNN_VERBOSE printed nothing"
    assert sorted(report) == sorted(f"{name} {amp}" for name, amp in ZOO)
    problems = []
    for step in [*report, "attention inference", "out= and in-place products"]:
        if calls.get(step):
            problems.append(f"{step}: MKL or oneDNN computed in portable mode: {calls[step][:3]}")
    for step, seen in report.items():
        if not {"aten::convolution", "aten::convolution_backward"} <= set(seen["ops"]):
            problems.append(f"{step}: the recorder saw no convolution")
        escaped = [op for op, handled in seen["ops"].items() if PRODUCT_LIKE.search(op) and not handled]
        if escaped:
            problems.append(f"{step}: products or convolutions the portable kernels do not decide: {escaped}")
        if seen["refused"] or seen["probe_refused"] or seen["probe_failure"]:
            problems.append(f"{step}: refused {seen['refused']}, probe {seen['probe_refused']} {seen['probe_failure']}")
        # the build-time probe (fake tensors) sees the products and convolutions the real step runs
        real = {op for op in seen["ops"] if PRODUCT_LIKE.search(op)}
        probed = {op for op in seen["probed"] if PRODUCT_LIKE.search(op)}
        if real != probed:
            problems.append(f"{step}: the step ran {sorted(real)}, the probe saw {sorted(probed)}")
    assert problems == [], "\n".join(problems)


# --- the kernels' routes and refusals, in this (portable) process -------------------------------------------


def test_out_and_in_place_products_compute_what_torch_does() -> None:
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.float64, generator=generator)

    a, b, bias, a3, b3 = rand(5, 7), rand(7, 3), rand(3), rand(2, 5, 7), rand(2, 7, 3)
    nan_bias = torch.full((5, 3), float("nan"), dtype=torch.float64)

    def products() -> list[torch.Tensor]:
        out_mm, out_bmm, out_addmm = (
            torch.empty(0, dtype=torch.float64),
            torch.empty(0, dtype=torch.float64),
            rand(5, 3),
        )
        torch.mm(a, b, out=out_mm)
        torch.bmm(a3, b3, out=out_bmm)
        torch.addmm(bias, a, b, beta=0.5, alpha=2, out=out_addmm)
        return [
            out_mm,
            out_bmm,
            out_addmm,
            nan_bias.clone().addmm_(a, b, beta=0),  # beta 0: the bias is not read, NaN or not
            bias.expand(5, 3).clone().addmm_(a, b, alpha=3),
            torch._addmm_activation(bias, a, b),
            torch._addmm_activation(bias, a, b, use_gelu=True),
        ]

    with portable_kernels(False):
        expected = products()
    with portable_kernels(True):
        made = products()
    for got, want in zip(made, expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("call", "op"),
    [
        (lambda: torch.linalg.inv(torch.eye(3)), "aten::linalg_inv_ex"),
        (lambda: torch.fft.rfft(torch.rand(8)), "aten::_fft_r2c"),
        (lambda: torch.rand(2, 3, 3).baddbmm_(torch.rand(2, 3, 3), torch.rand(2, 3, 3)), "aten::baddbmm_"),
        (lambda: torch.mv(torch.rand(3, 3), torch.rand(3), out=torch.empty(3)), "aten::mv.out"),
        (lambda: torch.dot(torch.rand(3), torch.rand(3)), "aten::dot"),
        (lambda: nn.functional.conv_transpose2d(torch.rand(1, 2, 4, 4), torch.rand(2, 2, 3, 3)), "transposed"),
        (lambda: torch.mm(torch.ones(2, 2, dtype=torch.long), torch.ones(2, 2, dtype=torch.long)), "int64"),
    ],
)
def test_ops_that_would_compute_with_cpu_dependent_libraries_are_refused_naming_them(call, op) -> None:  # noqa: ANN001
    with portable_kernels(True), pytest.raises(kernels.PortableOpError, match=re.escape(op)) as refused:
        call()
    assert refused.value.exit_code == ExitCode.REFUSED and "\n" not in str(refused.value)


# --- refused when built: the probe ------------------------------------------------------------------------


class _MatrixVector(nn.Module):
    """A head made of torch.mv calls: a product portable has no CPU-independent kernel for."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Parameter(torch.randn(5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.mv(self.head, row) for row in self.conv(x).mean((2, 3))])


class _Upsampling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(3, 5, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x).mean((2, 3))


class _DataDependent(nn.Module):
    """Reads a value back (fake tensors have none): the probe cannot finish its step."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).mean((2, 3)) * float(x.max() > 0)


def _classifier(net: nn.Module, arch: str) -> models.Classifier:
    return models.Classifier(net, [0.5] * 3, [0.25] * 3, arch=arch, image_size=(8, 8))


@pytest.mark.parametrize(("net", "op"), [(_MatrixVector, "aten::mv"), (_Upsampling, "aten::convolution (transposed)")])
def test_a_model_that_reaches_a_refused_op_is_refused_when_built_naming_it(net, op) -> None:  # noqa: ANN001
    """build_training refuses it as it sets CPU training up in portable mode, before any step."""
    images = np.zeros((4, 3, 8, 8), dtype=np.uint8)
    split = Preprocessed(images, np.arange(4) % 5, [str(c) for c in range(5)], [0.5] * 3, [0.25] * 3)
    cfg = TrainConfig(model="small_cnn", num_workers=0, device="cpu")
    with portable_kernels(True), pytest.raises(kernels.PortableOpError) as refused:
        build_training(cfg, 0, split, torch.device("cpu"), model=_classifier(net(), "tiny_net"))
    message = str(refused.value)
    assert message.startswith(f"train.model: tiny_net reaches {op} in a training step on the CPU")
    assert "set determinism.cpu: native" in message and "\n" not in message
    assert refused.value.exit_code == ExitCode.REFUSED


def test_the_probe_computes_nothing_and_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model = models.build_model("small_cnn", 10, [0.5] * 3, [0.25] * 3, [8, 8]).eval()
    state = {name: t.clone() for name, t in model.state_dict().items()}
    rng = torch.get_rng_state()
    recorder = escapes.training_step_ops(model, (3, 8, 8))  # ours are not probed in training: asked directly
    assert {"aten::convolution", "aten::convolution_backward", "aten::addmm"} <= {op.name() for op in recorder.ops}
    assert recorder.refused == [] and recorder.failure is None
    assert not model.training and torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(state[name], t) for name, t in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    models.refuse_unportable(model)  # ours: trusted (the escape test trains them)


def test_a_model_the_probe_cannot_step_is_left_to_the_kernels(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=escapes.__name__):
        models.refuse_unportable(_classifier(_DataDependent(), "tiny_net"))  # no refusal: left to the kernels
    assert "could not probe the model" in caplog.text
