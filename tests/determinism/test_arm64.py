"""The portable kernels on arm64: Debian's arm64 Python with the locked arm64 wheels, emulated
(tests/support/arm64.py), computes what x86-64 computes, op by op and after training steps of every zoo family.

blas_pool.cpp's NEON build (128-bit vectors, cross-compiled by Debian's aarch64 g++) against x86's AVX2 or
AVX-512 one: products and convolutions (each element one fused multiply-add chain), the depthwise
kernels, the activations' own formulas (mish, softplus and the ELUs' too: exp_activations.py), layer
norm's and softmax's backward sums; and what portable computes in place of ATen's reductions
(reductions.py, normalization.py: batch norm, layer norm, sum, mean, softmax, log-softmax and
cross-entropy). Each op gets the same inputs on both machines (torch's CPU
generator is the same Mersenne Twister on both) and their outputs' sha256 must agree; so must the weights
after each family's initialisation and two SGD steps, for every family of the zoo test, bfloat16
autocast included.

The emulator runs NEON and FMA instructions exactly, not a real chip's timing. It is a Neoverse N1 (Graviton 2:
no SVE); `LOCKSTEP_ARM64_CPU=a64fx` runs the same tests on a Fujitsu A64FX (SVE, 512-bit) by hand.
The machine is built by `make arm64-env` (.ci/run runs it). Alone on a 2-core AMD EPYC (Zen 3) the emulated
process took 131 s: 19 s to import torch, 49 s for convnext_tiny and 21 s for resnet18, the largest models
(2026-12-06); beside the rest of the full tier, several minutes.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.determinism.test_portable_escapes import ZOO
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
                ("gelu tanh", lambda t: F.gelu(t, approximate="tanh")), ("mish", F.mish), ("softplus", F.softplus),
                ("softplus, beta 2 threshold 5", lambda t: F.softplus(t, 2.0, 5.0)), ("elu", F.elu), ("selu", F.selu),
                ("celu", lambda t: F.celu(t, 0.7)), ("elu in place", lambda t: F.elu(t * 1, inplace=True))]:
    report[name] = digest(f(z), *gradients(f(z), z))
rows = rand(6, 45)
grad = torch.rand(6, 45, generator=generator)
mean, rstd = torch.rand(6, 1, generator=generator), torch.rand(6, 1, generator=generator) + 0.5
weight, shift = torch.rand(45, generator=generator), torch.rand(45, generator=generator)
report["layer norm backward"] = digest(*torch.ops.aten.native_layer_norm_backward(
    grad, rows.detach(), [45], mean, rstd, weight, shift, [True, True, True]))
probabilities = torch.rand(6, 45, generator=generator)
report["softmax backward"] = digest(torch.ops.aten._softmax_backward_data(grad, probabilities, 1, torch.float32))
# ATen's reductions, which portable computes itself (reductions.py, normalization.py): odd sizes included
for layout in (torch.contiguous_format, torch.channels_last):
    image = rand(6, 12, 7, 9).detach().to(memory_format=layout).requires_grad_()
    weight, shift = rand(12), rand(12)
    running = [torch.zeros(12), torch.ones(12)]
    normed = F.batch_norm(image, *running, weight, shift, training=True, momentum=0.3)
    report[f"batch norm, {layout}"] = digest(normed, *gradients(normed, image, weight, shift), *running)
    normed = F.batch_norm(image, *running, weight, shift, training=False)
    report[f"batch norm, eval, {layout}"] = digest(normed, *gradients(normed, image, weight))
rows, weight, shift = rand(5, 7, 45), rand(45), rand(45)
normed = F.layer_norm(rows, [45], weight, shift)
report["layer norm"] = digest(normed, *gradients(normed, rows, weight, shift))
logits, labels = rand(37, 10) * 4, torch.randint(0, 10, (37,), generator=generator)
loss = F.cross_entropy(logits, labels, label_smoothing=0.1)
report["cross entropy (log-softmax, sums)"] = digest(loss, *gradients(loss, logits))
report["softmax"] = digest(F.softmax(logits, 0), F.softmax(logits, 1))
report["sum, mean"] = digest(rows.sum(), rows.sum((0, 2)), rows.mean(1), rows.mean((0, 1), keepdim=True))
"""

# Two training steps of each zoo family (tests/determinism/test_portable_escapes.py ZOO) from its own
# initialisation (torchvision's kaiming and truncated normal draws: sampling.py's on both machines).
STEPS = """
import sys
from tasks.train.models import build_model

steps = {}
for family in sys.argv[1:]:
    name, precision = family.split(":")
    torch.manual_seed(0)
    model = build_model(name, 10, [0.5] * 3, [0.25] * 3, [16, 16])
    generator = torch.Generator().manual_seed(1)
    images, labels = torch.rand(2, 3, 3, 16, 16, generator=generator), torch.randint(0, 10, (2, 3), generator=generator)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    for x, y in zip(images, labels):
        optimiser.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        loss.backward()
        optimiser.step()
    tensors = model.state_dict().values()
    state = b"".join(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors)
    steps[family] = hashlib.sha256(state).hexdigest()
print(json.dumps({"ops": report, "steps": steps, "machine": fingerprint()}))
"""
FAMILIES = [f"{name}:{precision}" for name, precision in ZOO]


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


@pytest.fixture(scope="module")
def reports(arm64_ready: None) -> dict[str, dict]:
    """What OPS and STEPS compute here and on the emulated arm64 machine: one process each (an emulated
    `import torch` alone takes about 20 s)."""
    x86 = json.loads(run_script(OPS + STEPS, *FAMILIES).strip().splitlines()[-1])
    done = arm64.run_python(["-c", OPS + STEPS, *FAMILIES], timeout_s=3000)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"x86_64": x86, "arm64": json.loads(done.stdout.strip().splitlines()[-1])}


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_portable_kernels_give_x86_bytes_on_arm64(reports: dict[str, dict]) -> None:
    x86, arm = reports["x86_64"], reports["arm64"]
    # the CPU it was (arm64.CPU; an SVE one by hand: LOCKSTEP_ARM64_CPU=a64fx), named by its MIDR
    assert arm["machine"]["hw.cpu.model"] == {"neoverse-n1": "Neoverse N1", "a64fx": "A64FX"}[arm64.CPU]
    assert ("sve" in arm["machine"]["hw.cpu.flags"].split()) == (arm64.CPU == "a64fx"), arm["machine"]
    assert arm["machine"]["hw.cpu.capability"] == "DEFAULT"  # ATen's NEON kernels, pinned (not SVE256 on SVE)
    assert "128-bit vectors" in arm["machine"]["hw.cpu.products"], arm["machine"]  # blas_pool.cpp's NEON build
    assert sorted(arm["ops"]) == sorted(x86["ops"])
    differ = sorted(name for name in x86["ops"] if x86["ops"][name] != arm["ops"][name])
    assert differ == [], f"ops whose bytes differ on arm64: {differ}"


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_training_step_of_each_zoo_family_gives_x86_weights_on_arm64(reports: dict[str, dict]) -> None:
    """Each family's own initialisation, then two SGD steps (momentum, weight decay, label smoothing),
    bfloat16 autocast included: the weights' bytes after them, on x86-64 here and on the emulated arm64
    machine."""
    x86, arm = reports["x86_64"]["steps"], reports["arm64"]["steps"]
    assert len(set(x86.values())) == len(FAMILIES)  # (each family's own weights: the hashes say something)
    differ = sorted(family for family in FAMILIES if x86[family] != arm[family])
    assert differ == [], f"families whose weights differ on arm64 after two steps: {differ}"


# Debian 12's python3.11 (the emulated machine's, and many arm64 servers') is 3.11.2, older than tarfile's
# extraction filters (3.11.4): tasks/core/tar.py then takes backports.tarfile's. A dataset archive with a
# setuid file and a world-writable one goes through tasks/data/archive.py; the `data` filter strips those
# bits (our own member checks do not look at modes), and refuses a member that leaves the folder.
TAR_FILTERS = """
import io, json, sys, tarfile as stdlib, tempfile
from pathlib import Path
from tasks.core.tar import tarfile
from tasks.data.archive import ArchiveLimits, extract

def archive(path, members):
    with stdlib.open(path, "w") as tar:
        for name, mode in members:
            info = stdlib.TarInfo(name)
            info.size, info.mode = 4, mode
            tar.addfile(info, io.BytesIO(b"data"))

with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    archive(tmp / "set.tar", [("cat/a.png", 0o4755), ("dog/b.png", 0o666)])
    out = extract(tmp / "set.tar", tmp / "out", ArchiveLimits(10**6, 100, 10))
    modes = {name: oct((out / name).stat().st_mode & 0o7777) for name in ("cat/a.png", "dog/b.png")}
    archive(tmp / "out.tar", [("../escaped.png", 0o644)])
    with tarfile.open(tmp / "out.tar") as tar:
        try:
            tar.extractall(tmp / "direct", filter="data")
            refused = None
        except tarfile.FilterError as exc:
            refused = type(exc).__name__
print(json.dumps({"python": sys.version.split()[0], "module": tarfile.__name__, "modes": modes, "refused": refused}))
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_archives_are_extracted_through_tarfiles_filters_on_debians_python_3_11_2(arm64_ready: None) -> None:
    done = arm64.run_python(["-c", TAR_FILTERS], timeout_s=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["python"] == "3.11.2" and seen["module"] == "backports.tarfile", seen
    assert seen["modes"] == {"cat/a.png": "0o755", "dog/b.png": "0o644"}, seen  # setuid and o+w stripped
    assert seen["refused"] == "OutsideDestinationError", seen
