"""One exit-code table (tasks/core/errors.py ExitCode, docs/reliability.md): each kind of failure its
own code, printed as one line by every entry point's `exit_code`."""

from __future__ import annotations

import errno

import pytest

from tasks.core.cli import exit_code
from tasks.core.config.base import ConfigError, OverrideRefused
from tasks.core.config.policy import refuse_remote_overrides
from tasks.core.errors import DataRefused, ExitCode, ExpectedFailure, HardwareMissing, Refused
from tasks.core.lock import PipelineBusy
from tasks.data.archive import UnsafeArchiveError
from tasks.determinism.cpu_mode import CpuModeError, CpuUnsupported
from tasks.ship.export import GateError


def _raises(exc: BaseException):
    def body() -> int:
        raise exc

    return body


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ExpectedFailure("data/images.npy: truncated"), 1),
        (OSError(errno.ENOSPC, "No space left on device", "artifacts/x"), 1),
        (ConfigError("params.yaml: train.lr: must be > 0"), 2),
        (CpuModeError("determinism.cpu: native must be set before torch is imported"), 2),
        (OverrideRefused("overrides: data.url reaches the network"), 3),
        (PipelineBusy("another pipeline run is in progress"), 3),
        (DataRefused("data check(s) refused the new snapshot"), 3),
        (GateError("no export candidate passed its gates"), 3),
        (UnsafeArchiveError("pets.zip: a link"), 3),
        (CpuUnsupported("determinism.cpu: portable needs an x86-64 CPU with AVX2"), 4),
        (HardwareMissing("train.device: cuda, but torch sees no CUDA device"), 4),
    ],
)
def test_each_kind_of_failure_exits_with_its_code_and_one_line(
    exc: BaseException, code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exit_code(_raises(exc), context="stage: ") == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err


def test_the_table_has_one_code_per_kind() -> None:
    assert [int(code) for code in ExitCode] == [0, 1, 2, 3, 4]
    assert (ExpectedFailure.exit_code, Refused.exit_code, HardwareMissing.exit_code) == (1, 3, 4)
    assert ConfigError("x").exit_code == ExitCode.BAD_INPUT


def test_a_refused_override_is_a_refusal_not_bad_input() -> None:
    with pytest.raises(OverrideRefused) as raised:
        refuse_remote_overrides({"data.url": "http://elsewhere.example/x.zip"}, allowed=set())
    assert raised.value.exit_code == ExitCode.REFUSED


def test_a_bug_keeps_its_traceback() -> None:
    with pytest.raises(ZeroDivisionError):
        exit_code(_raises(ZeroDivisionError("a bug")))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a CUDA device")
def test_asking_for_a_gpu_on_a_machine_without_one_is_missing_hardware() -> None:
    from tasks.train.devices import resolve_device

    with pytest.raises(HardwareMissing, match="'cuda:0': torch sees no CUDA device"):
        resolve_device("cuda:0")
