"""The portable kernels inside a test process: switched on or off whatever an earlier test left, their C++ op
built, and a convolution checked against torch's own kernels; and a script run in a process of its own as a
stage runs (`run_script`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from tasks.determinism import blas, cpu_mode, dispatch
from tests.conftest import ROOT


@contextmanager
def portable_kernels(on: bool) -> Iterator[None]:
    """torch's own kernels (False) or the portable ones (True) for the block."""
    was = dispatch.installed()
    dispatch.install() if on else dispatch.uninstall()
    try:
        yield
    finally:
        dispatch.install() if was else dispatch.uninstall()


def replace_ops(patch: pytest.MonkeyPatch, **how: Callable[[Any], Any] | None) -> None:
    """blas.op for the rest of the test (or of `patch`'s context) with the named ops replaced: None, an op
    that cannot be built here; or a function of the real op that gives its stand-in (at a narrower width)."""
    real = blas.op

    def op(name: str) -> Any:
        if name not in how:
            return real(name)
        replace = how[name]
        return None if replace is None else replace(real(name))

    patch.setattr(blas, "op", op)


def needs_the_op() -> None:
    """Skip the test where blas_pool.cpp cannot be built (no compiler), except in CI, where it must be."""
    try:
        blas.build()
    except blas.BuildError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


def computes_what_torch_does(
    compute: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor], generator: torch.Generator
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """`compute()` and its gradients for `inputs` on the portable kernels, asserted close to torch's own
    (float64 inputs); returns them, with the random upstream gradient both were given."""
    with portable_kernels(False):
        expected = compute()
        upstream = torch.randn(expected.shape, dtype=expected.dtype, generator=generator)
        expected_grads = torch.autograd.grad(expected, inputs, upstream)
    with portable_kernels(True):
        made = compute()
        grads = torch.autograd.grad(made, inputs, upstream)
    torch.testing.assert_close(made, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)
    return made, grads, upstream


def run_script(script: str, *args: str, **env: str) -> str:
    """The standard output of `python -c script args` in the repository, started as a stage is: without the
    CPU variables and thread settings this process has (the script pins its own mode), with `env` added;
    asserted to succeed."""
    clean = cpu_mode.clean_env({k: v for k, v in os.environ.items() if not k.startswith(("OPENBLAS", "OMP_"))})
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
