"""The portable kernels on arm64: Debian's arm64 Python with the locked arm64 wheels, emulated
(tests/support/arm64.py), computes each op the portable layer computes itself with the bytes x86-64 computes.

blas_pool.cpp's NEON build (128-bit vectors, cross-compiled by Debian's aarch64 g++) against x86's AVX2 or
AVX-512 one: products and convolutions (each element one fused multiply-add chain), the depthwise
kernels, the activations' own formulas, layer norm's and softmax's backward sums. Each op gets the same
inputs on both machines (torch's CPU generator is the same Mersenne Twister on both) and their outputs'
sha256 must agree. What still differs on arm64 is ATen's: tasks/determinism/cpu_mode.py ARCHITECTURES
says which, and `auto` stays native there until it does not (docs/reproducibility.md, arm64).

The emulator runs NEON and FMA instructions exactly, not a real chip's timing. The machine is built by
`make arm64-env` (.ci/run runs it); the emulated process takes ~1 min to import torch.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.support import arm64
from tests.support.portable import run_script

OPS = """
import hashlib, json
from tasks.determinism.bootstrap import start
start(0, 2, strict=True, cpu="portable")
import torch
import torch.nn.functional as F
from tasks.determinism.fingerprint import fingerprint

generator = torch.Generator().manual_seed(7)


def rand(*shape, dtype=torch.float32):
    return (torch.rand(*shape, generator=generator, dtype=torch.float64) * 4 - 2).to(dtype).requires_grad_()


def digest(*tensors):
    return hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes() for t in tensors)).hexdigest()


def gradients(out, *inputs):
    upstream = torch.rand(out.shape, generator=generator, dtype=out.dtype)
    return torch.autograd.grad(out, inputs, upstream)


report = {}
a, b = rand(37, 53), rand(53, 29)
report["mm float32"] = digest(a @ b, *gradients(a @ b, a, b))
a64, b64 = rand(19, 41, dtype=torch.float64), rand(41, 23, dtype=torch.float64)
report["mm float64"] = digest(a64 @ b64)
x, w, bias = rand(11, 67), rand(31, 67), rand(31)
report["linear (addmm)"] = digest(F.linear(x, w, bias), *gradients(F.linear(x, w, bias), x, w))
p, q = rand(3, 9, 14), rand(3, 14, 6)
report["bmm"] = digest(torch.bmm(p, q))
image, kernel = rand(2, 5, 13, 11), rand(7, 5, 3, 3)
conv = F.conv2d(image, kernel, stride=(2, 1), padding=1)
report["conv2d"] = digest(conv, *gradients(conv, image, kernel))
image, kernel = rand(2, 8, 12, 12), rand(8, 1, 3, 3)
depthwise = F.conv2d(image, kernel, padding=1, groups=8)
report["depthwise conv2d"] = digest(depthwise, *gradients(depthwise, image, kernel))
image = image.detach().to(memory_format=torch.channels_last).requires_grad_()
depthwise = F.conv2d(image, kernel, stride=2, padding=1, groups=8)
report["depthwise conv2d, channels-last"] = digest(depthwise, *gradients(depthwise, image, kernel))
z = rand(3, 1000)
for name, f in [("sigmoid", torch.sigmoid), ("silu", F.silu), ("gelu", F.gelu),
                ("gelu tanh", lambda t: F.gelu(t, approximate="tanh"))]:
    report[name] = digest(f(z), *gradients(f(z), z))
rows = rand(6, 45)
grad = torch.rand(6, 45, generator=generator)
mean, rstd = torch.rand(6, 1, generator=generator), torch.rand(6, 1, generator=generator) + 0.5
weight, shift = torch.rand(45, generator=generator), torch.rand(45, generator=generator)
report["layer norm backward"] = digest(*torch.ops.aten.native_layer_norm_backward(
    grad, rows.detach(), [45], mean, rstd, weight, shift, [True, True, True]))
probabilities = torch.rand(6, 45, generator=generator)
report["softmax backward"] = digest(torch.ops.aten._softmax_backward_data(grad, probabilities, 1, torch.float32))
print(json.dumps({"ops": report, "machine": fingerprint()}))
"""


@pytest.fixture(scope="module")
def arm64_ready() -> None:
    """The emulated machine, built by `make arm64-env`; missing: a failure in CI, a skip elsewhere."""
    try:
        if not (arm64.home() / "ready").exists():
            raise arm64.Arm64Unavailable(f"no arm64 machine at {arm64.home()}: run `make arm64-env` first")
    except arm64.Arm64Unavailable as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_portable_kernels_give_x86_bytes_on_arm64(arm64_ready: None) -> None:
    x86 = json.loads(run_script(OPS).strip().splitlines()[-1])
    done = arm64.run_python(["-c", OPS])
    assert done.returncode == 0, done.stderr[-3000:]
    arm = json.loads(done.stdout.strip().splitlines()[-1])
    assert arm["machine"]["hw.cpu.capability"] == "DEFAULT"  # ATen's NEON kernels, pinned
    assert "128-bit vectors" in arm["machine"]["hw.cpu.products"], arm["machine"]  # blas_pool.cpp's NEON build
    assert sorted(arm["ops"]) == sorted(x86["ops"])
    differ = sorted(name for name in x86["ops"] if x86["ops"][name] != arm["ops"][name])
    assert differ == [], f"ops whose bytes differ on arm64: {differ}"
