"""determinism.cpu: portable kernels compute what torch's do, and the same bytes whatever the CPU says.

The cross-machine check: a small fixed training in portable mode must give the sha256 committed in
tests/determinism/golden/portable_training.json on every machine CI gets (Intel and AMD, AVX2 and AVX-512 have
all been seen). On one machine, the three variables that changed native weights (ATen's capability,
oneDNN's ISA, MKL's branch) are set in every combination, on 1, 2 and 3 threads: portable bytes
must not move, native ones do; nor may they move with MKL and oneDNN left to pick their own kernels,
since portable computes with neither. The same holds for a bf16 training (train.amp: bf16, the one
other precision the CPU trains in: fp16 needs CUDA), whose hash is recorded beside, for a small net of
depthwise convolutions (tasks/determinism/depthwise.py's kernels; float32 steps, then bf16), and for one
of sigmoid, SiLU and both GELUs (tasks/determinism/activations.py's; float32, then bf16).
Record new hashes (after checking the change is meant; it starts a new record, without `seen_on`) with:

    LOCKSTEP_RECORD_GOLDEN=1 .venv/bin/python -m pytest tests/determinism/test_cpu_mode.py
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tasks.determinism import cpu_mode, kernels
from tasks.determinism.fingerprint import explain, fingerprint
from tests.conftest import ROOT
from tests.support.portable import computes_what_torch_does, portable_kernels

GOLDEN = Path(__file__).parent / "golden" / "portable_training.json"
# small_cnn in float32, in bf16; depthwise layers; sigmoid, SiLU and GELU
HASHES = ("sha256", "bf16_sha256", "depthwise_sha256", "activations_sha256")
# The variables measured to change native weights, each unset or set to what another CPU would use.
VARIABLES = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "AVX2"}
# A process already pinned portable keeps what it finds (cpu_mode.pin_env): here, MKL and oneDNN free to
# pick their kernels for this CPU, as in native mode.
LIBRARIES_FREE = {
    **cpu_mode.PORTABLE_ENV,
    cpu_mode.MODE_ENV: "portable",
    "MKL_CBWR": "AUTO",
    "MKL_DYNAMIC": "TRUE",
    "ONEDNN_MAX_CPU_ISA": "ALL",
}
TRAINING = """
import hashlib, json, sys
from tasks.determinism.bootstrap import start
start(0, int(sys.argv[2]), strict=True, cpu=sys.argv[1])
import torch
from tasks.determinism.fingerprint import fingerprint
from tasks.train.models import build_model
if sys.argv[3] != "0":  # the op's vectors this narrow (bits): an AVX2 CPU's, on an AVX-512 one
    import functools
    from tasks.determinism import blas
    width = int(sys.argv[3])
    blas.gemm = functools.partial(blas.gemm, width=width)
    blas.field_gemm = functools.partial(blas.field_gemm, width=width)
    real = blas.op
    def narrow(name):  # the ops whose callers leave the width at 0 (the widest)
        built = real(name)
        return functools.partial(built, width=width) if name in ("input_gradient", "depthwise", "activation") else built
    blas.op = narrow
generator = torch.Generator().manual_seed(1)
images = torch.rand(4, 32, 1, 12, 12, generator=generator)
labels = torch.randint(0, 10, (4, 32), generator=generator)
nn = torch.nn


def trained(model, bf16_from, weight_decay=0.0):
    # the weights' bytes after a step on each batch, in bf16 (as tasks/train/loop.py's autocast) from step
    # `bf16_from` on
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=weight_decay)
    for step, (x, y) in enumerate(zip(images, labels)):
        optimiser.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=step >= bf16_from):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimiser.step()
    return b"".join(t.numpy().tobytes() for t in model.state_dict().values())


# conv, batch norm, pooling, dropout, linear, cross-entropy, SGD
state = trained(build_model("small_cnn", 10, [0.5], [0.25]), len(images), 5e-4)
torch.manual_seed(0)  # the same again in bf16
bf16 = trained(build_model("small_cnn", 10, [0.5], [0.25]), 0, 5e-4)
torch.manual_seed(0)  # depthwise convolutions (tasks/determinism/depthwise.py), in float32 and then bf16
depthwise = trained(nn.Sequential(
    nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
    nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8), nn.BatchNorm2d(8), nn.ReLU(),
    nn.Conv2d(8, 8, 7, padding=3, groups=8, bias=False), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
), 2)
torch.manual_seed(0)  # activations of a transcendental function (tasks/determinism/activations.py), the same
class Gate(nn.Module):  # squeeze-and-excitation's sigmoid gate, as efficientnet's
    def forward(self, x):
        return x * torch.sigmoid(x.mean((2, 3), keepdim=True))
class Scaled(nn.Module):  # values of a few units, where the activations curve (near 0 their bytes barely show)
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
    def forward(self, x):
        return self.inner(x) * 6
activations = trained(nn.Sequential(
    Scaled(nn.Conv2d(1, 13, 3, padding=2)), nn.SiLU(inplace=True), Scaled(nn.Conv2d(13, 13, 3, padding=1)), Gate(),
    nn.GELU(), Scaled(nn.Conv2d(13, 13, 1)), nn.GELU(approximate="tanh"), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    nn.Linear(13, 10),
), 2)
print(json.dumps({
    "sha256": hashlib.sha256(state).hexdigest(),
    "bf16_sha256": hashlib.sha256(bf16).hexdigest(),
    "depthwise_sha256": hashlib.sha256(depthwise).hexdigest(),
    "activations_sha256": hashlib.sha256(activations).hexdigest(),
    "machine": fingerprint(),
}))
"""


def _train(mode: str, env_vars: dict[str, str], threads: int = 2, width: int = 0) -> dict:
    # no thread settings inherited (how threads wait, conftest's, is not one: it changes no result)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in VARIABLES and (not k.startswith(("OPENBLAS", "OMP_")) or k == "OMP_WAIT_POLICY")
    }
    env = cpu_mode.clean_env(env)
    done = subprocess.run(
        [sys.executable, "-c", TRAINING, mode, str(threads), str(width)],
        cwd=ROOT,
        env={**env, **env_vars},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_portable_weights_match_the_committed_hash_under_every_cpu_variable_and_thread_count() -> None:
    """Portable bytes move with none of the variables, nor with the thread count, nor with the products'
    vector width: each element of a product is one chain of fused multiply-adds, wherever and however wide
    it is computed (tasks/determinism/blas.py), so a machine with more or fewer cores, or with AVX2 only,
    trains the same bytes. The runs take 1, 2 and 3 threads in turn (each is a process importing torch:
    one run per combination, not three); one more computes its products, depthwise loops and activations
    with AVX2's 256-bit vectors."""
    combos = [
        {name: value for name, value, on in zip(VARIABLES, VARIABLES.values(), flags, strict=True) if on}
        for flags in itertools.product((False, True), repeat=len(VARIABLES))
    ] + [LIBRARIES_FREE]
    runs = [(combo, (2, 1, 3)[i % 3], 0) for i, combo in enumerate(combos)]  # the first: no variable, 2 threads
    runs.append(({}, 2, 256))
    with ThreadPoolExecutor(2) as pool:
        portable = list(pool.map(lambda run: _train("portable", *run), runs))
        native = list(pool.map(lambda combo: _train("native", combo), [{}, {"ATEN_CPU_CAPABILITY": "default"}]))
    made = portable[0]
    if os.environ.get("LOCKSTEP_RECORD_GOLDEN") == "1":
        record = {key: made[key] for key in HASHES} | {"recorded_on": made["machine"]}
        GOLDEN.write_text(json.dumps(record, indent=2) + "\n")
    for key in HASHES:
        moved = [run for run, p in zip(runs, portable, strict=True) if p[key] != made[key]]
        assert not moved, (
            f"portable {key} moved with the variables, threads or width (variables, threads, width): {moved}"
        )
        assert native[0][key] != native[1][key], f"the variables no longer change native {key}: test is vacuous"
    assert {threads for _, threads, _ in runs} == {1, 2, 3}
    recorded = json.loads(GOLDEN.read_text())
    differences, _ = explain(recorded["recorded_on"], made["machine"])
    for key in HASHES:
        assert made[key] == recorded[key], (
            f"portable training gave other bytes ({key}) on this machine ({made['machine']['hw.cpu.model']}) than "
            f"on the one it was recorded on ({recorded['recorded_on']['hw.cpu.model']}); byte-relevant "
            f"differences: {differences or 'none (a portability bug)'}"
        )


@pytest.mark.parametrize(
    ("stride", "padding", "dilation", "groups", "kernel", "bias"),
    [
        (1, 1, 1, 1, 3, True),
        (2, 1, 1, 1, 3, False),
        (2, 3, 1, 1, 7, False),
        (1, 2, 2, 2, 3, True),
        (2, 1, 1, 8, 3, False),
    ],
)
def test_portable_convolution_computes_what_torch_does(stride, padding, dilation, groups, kernel, bias) -> None:  # noqa: ANN001
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 11, 9, dtype=torch.float64, generator=generator, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(16, 8 // groups, kernel, kernel, dtype=torch.float64, generator=generator))
    b = torch.nn.Parameter(torch.randn(16, dtype=torch.float64, generator=generator)) if bias else None
    inputs = [x, w] + ([b] if bias else [])

    def conv() -> torch.Tensor:
        return F.conv2d(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups)

    computes_what_torch_does(conv, inputs, generator)


def test_portable_results_never_share_the_reused_temporaries() -> None:
    """The kernels reuse their temporaries' memory from call to call: what they hand back (outputs,
    gradients) must be new memory, so a later convolution of the same shapes cannot change it."""
    generator = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 4, 3, 3, dtype=torch.float64, generator=generator))
    first, second = (torch.randn(2, 4, 7, 7, dtype=torch.float64, generator=generator) for _ in range(2))
    with portable_kernels(True):
        out = F.conv2d(first, w, padding=1)
        kept = out.clone()
        (grad,) = torch.autograd.grad(out.sum(), w)
        grad_kept = grad.clone()
        with torch.no_grad():  # columns not kept: they go back to the pool at once
            F.conv2d(second, w, padding=1)
        again = F.conv2d(second, w, padding=1)
        torch.autograd.grad(again.square().sum(), w)
        with portable_kernels(False):
            expected = F.conv2d(first, w, padding=1)
    assert torch.equal(out, kept) and torch.equal(grad, grad_kept)
    torch.testing.assert_close(out, expected)


def test_portable_linear_and_conv1d_compute_what_torch_does() -> None:
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(7, 4).double()
    x = torch.randn(2, 5, 7, dtype=torch.float64, generator=generator)
    signal = torch.randn(2, 3, 10, dtype=torch.float64, generator=generator)
    kernel = torch.randn(5, 3, 3, dtype=torch.float64, generator=generator)
    with portable_kernels(False):
        expected = (linear(x), F.conv1d(signal, kernel, padding=1, stride=2))
    with portable_kernels(True):
        made = (linear(x), F.conv1d(signal, kernel, padding=1, stride=2))
        with pytest.raises(kernels.PortableOpError, match="aten::mv"):
            torch.mv(kernel[:, :, 0], signal[0, :, 0])
    torch.testing.assert_close(made, expected)


def test_the_mode_cannot_change_once_torch_is_loaded() -> None:
    assert cpu_mode.current() == "portable"  # tests/conftest.py pinned it before torch loaded
    with pytest.raises(cpu_mode.CpuModeError, match="must be set before torch"):
        cpu_mode.pin_env("native")
    with pytest.raises(cpu_mode.CpuModeError, match="loaded torch in portable mode"):
        cpu_mode.activate("native", 1)
    with pytest.raises(cpu_mode.CpuModeError, match="not one of auto, portable, native"):
        cpu_mode.pin_env("fast")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _warnings(check: Callable[[], bool]) -> list[str]:
    """The warnings cpu_mode's own logger emitted while `check` ran (which must hold), read by a handler on
    that logger: caplog's list held two records of one call in a fresh clone's `make test` (another test in
    the process had changed the logging set-up), which this count does not depend on."""
    logger, lines = logging.getLogger(cpu_mode.__name__), _Lines()
    level, disabled = logger.level, logger.disabled
    logger.addHandler(lines)
    logger.setLevel(logging.WARNING)
    logger.disabled = False
    try:
        assert check()
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
        logger.disabled = disabled
    return lines.lines


def test_auto_is_portable_where_the_cpu_supports_it_and_native_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_mode.resolve("auto") == "portable"  # this process was pinned portable: auto follows it
    monkeypatch.delenv(cpu_mode.MODE_ENV)  # a process nobody pinned yet decides by its CPU
    assert cpu_mode.portable_unsupported() is None and cpu_mode.resolve("auto") == "portable"  # x86-64, AVX2
    assert cpu_mode.resolve("native") == "native" and cpu_mode.resolve("portable") == "portable"
    monkeypatch.setattr(cpu_mode.platform, "machine", lambda: "aarch64")  # a Graviton, a GH200's Grace
    monkeypatch.setattr(cpu_mode, "cpuinfo", lambda: {"Features": "fp asimd evtstrm aes crc32 atomics"})
    assert cpu_mode.resolve("auto") == "portable"  # x86-64's bytes there too (test_arm64.py)
    monkeypatch.setattr(cpu_mode, "cpuinfo", lambda: {"Features": "fp evtstrm"})  # (no NEON: not a real arm64)
    (line,) = _warnings(lambda: cpu_mode.resolve("auto") == "native")
    assert "auto computes in native mode here (this CPU lacks asimd" in line
    monkeypatch.setattr(cpu_mode.platform, "machine", lambda: "riscv64")
    (line,) = _warnings(lambda: cpu_mode.resolve("auto") == "native")
    assert "auto computes in native mode here (this CPU is riscv64, neither x86-64 nor arm64" in line
    monkeypatch.undo()
    monkeypatch.delenv(cpu_mode.MODE_ENV)
    monkeypatch.setenv("CXX", "no-such-c++")  # an x86-64 CPU with AVX2, but nothing to build the kernels with
    (line,) = _warnings(lambda: cpu_mode.resolve("auto") == "native" and cpu_mode.resolve("portable") == "portable")
    assert "auto computes in native mode here (no C++ compiler (no-such-c++) to build its kernels" in line


def test_portable_asked_for_on_a_cpu_without_it_is_refused_as_missing_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_mode.platform, "machine", lambda: "riscv64")
    with pytest.raises(
        cpu_mode.CpuUnsupported, match="portable needs an x86-64 CPU with AVX2 or an arm64 one"
    ) as refused:
        cpu_mode.activate("portable", 1)
    assert refused.value.exit_code == 4


def test_a_child_of_a_portable_process_chooses_its_own_mode() -> None:
    env = cpu_mode.clean_env({**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "PATH": "/bin"})
    assert env["PATH"] == "/bin" and not set(cpu_mode.PORTABLE_ENV) & set(env) and cpu_mode.MODE_ENV not in env
    users_own = cpu_mode.clean_env({"MKL_CBWR": "AVX2"})  # not set by us: kept, and fingerprinted
    assert users_own == {"MKL_CBWR": "AVX2"}


def test_fingerprint_explains_what_changes_bytes() -> None:
    now = fingerprint()
    assert now["hw.cpu.mode"] == "portable" and now["hw.cpu.capability"] == "AVX2"
    assert now["hw.threads"] == str(torch.get_num_threads()) and now["hw.cpu.products"].startswith("fma chains, ")
    assert explain(now, now) == ([], False)
    # portable: another CPU model is no reason, another thread count is
    other_cpu = {**now, "hw.cpu.model": "Intel Xeon", "hw.cpu.flags": now["hw.cpu.flags"] + " avx512f"}
    assert explain(other_cpu, now) == ([], False)
    assert explain({**now, "hw.threads": "7"}, now)[0] == [f"hw.threads: run 7, now {now['hw.threads']}"]
    # native on another CPU: bytes are not expected to match, and the differences say why
    native_elsewhere = {**other_cpu, "hw.cpu.mode": "native"}
    differences, expected = explain(native_elsewhere, {**now, "hw.cpu.mode": "native"})
    assert expected and any(line.startswith("hw.cpu.model: run Intel Xeon") for line in differences)
    # determinism.cpu: auto, rebuilt where it resolves otherwise: never meant to match, and said so
    differences, expected = explain(now, {**now, "hw.cpu.mode": "native"})
    assert expected and differences == [
        "hw.cpu.mode: the run computed in portable mode, this machine in native mode "
        "(determinism.cpu: auto is portable only on x86-64 CPUs with AVX2 and FMA and on arm64 ones)"
    ]
    assert explain({"git.commit": "abc"}, now)[0] == [
        "the run records no hardware fingerprint (made before lockstep recorded one)"
    ]


def test_reproduce_says_why_bytes_differ() -> None:
    from tasks.tools.reproduce import Comparison, ReproduceReport, format_report

    def report(**fields: object) -> str:
        made = ReproduceReport("r1", "r1", "0", "commit abc", "md5", machine_now={"hw.cpu.mode": "portable"})
        made.weights = [Comparison("best.safetensors", "sha256", "aa", "bb")]
        for name, value in fields.items():
            setattr(made, name, value)
        return format_report(made)

    bug = report()
    assert "best.safetensors DIFFERS" in bug and "should have been identical (a reproducibility bug" in bug
    explained = report(explained_by=["hw.threads: run 1, now 2"])
    assert "explained by the machine's fingerprint:\n    hw.threads: run 1, now 2" in explained
    elsewhere = report(
        bytes_expected_to_differ=True,
        explained_by=["hw.cpu.model: run Intel Xeon, now AMD EPYC"],
        metrics={"best_val_accuracy": {"run": 0.9888, "rebuilt": 0.9851}},
    )
    assert "made in native mode (determinism.cpu) on another CPU: its bytes are not expected to match" in elsewhere
    assert "best_val_accuracy: run 0.9888, rebuilt 0.9851" in elsewhere and "hw.cpu.model: run Intel Xeon" in elsewhere
