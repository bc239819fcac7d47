"""One pipeline run at a time: the project lock, from the entry points' side (fast: a run that
is refused stops before it reads any data)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

from tasks.core.config.yaml_io import load_params, set_params
from tasks.core.lock import HOLDER_FILE, PipelineBusy, pipeline_lock
from tests.conftest import ROOT, copy_project, run


def test_a_stage_run_by_dvc_is_refused_while_another_run_holds_the_lock(tmp_path: Path) -> None:
    repo = copy_project(tmp_path / "repo", {"orchestration": {"lock_wait_s": 1}})
    with pipeline_lock("Prefect flow run busy-bee", wait_s=0, root=repo):
        refused = run(["python", "-m", "tasks", "stats"], repo, check=False)
    assert refused.returncode == 3
    message = refused.stderr.strip().splitlines()[-1]
    assert message.startswith("error: stats: .dvc/tmp/lockstep-pipeline.lock: another pipeline run is in progress")
    assert "Prefect flow run busy-bee (pid" in message and "waited 1 s (orchestration.lock_wait_s)" in message
    assert "Traceback" not in refused.stderr
    assert not (repo / "artifacts").exists() and not (repo / "mlflow.db").exists()  # nothing written
    assert not (repo / HOLDER_FILE).exists()  # released with the block


def test_a_waiting_run_proceeds_when_the_holder_finishes(tmp_path: Path) -> None:
    order: list[str] = []
    with pipeline_lock("first", wait_s=0, root=tmp_path):
        waiter = threading.Thread(target=_take, args=(tmp_path, order))
        waiter.start()
        time.sleep(1.0)
        order.append("first done")
    waiter.join(timeout=30)
    assert order == ["first done", "second ran"]
    with pipeline_lock("holder", wait_s=0, root=tmp_path), pytest.raises(PipelineBusy, match="holder \\(pid"):
        _take(tmp_path, order, wait_s=0.2)


def _take(root: Path, order: list[str], wait_s: float = 30) -> None:
    with pipeline_lock("second", wait_s=wait_s, root=root):
        order.append("second ran")


def test_overrides_are_written_into_params_yaml_keeping_comments(tmp_path: Path) -> None:
    path = Path(shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml"))
    params = set_params(path, {"train.lr": 0.02, "compress.variants": ["static_int8"], "export.candidates": ["fp32"]})
    assert params.train.lr == 0.02 and params.compress.variants == ("static_int8",)
    assert load_params(path) == params
    changed = set((ROOT / "params.yaml").read_text().splitlines()) - set(path.read_text().splitlines())
    assert [line.split(":")[0].strip() for line in sorted(changed)] == ["candidates", "lr", "variants"]  # comments kept


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"train.lrr": 0.1}, "train.lrr: no such key"),
        ({"train.lr": -1}, "train.lr: Input should be greater than 0"),
        ({"nosection.x": 1}, "nosection.x: no such key"),
    ],
)
def test_bad_overrides_leave_params_yaml_untouched(tmp_path: Path, overrides: dict, fragment: str) -> None:
    from tasks.core.config.base import ConfigError

    path = Path(shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml"))
    with pytest.raises(ConfigError, match=fragment):
        set_params(path, overrides)
    assert path.read_text() == (ROOT / "params.yaml").read_text()


def test_the_download_task_retries_only_an_unreachable_source(tmp_path: Path) -> None:
    """The flow's retry condition, on real fetch failures and real Prefect states."""
    from prefect.states import Failed

    from flows.pipeline import STAGE_TASKS, _source_was_unreachable
    from tasks.data.fetch import Checksum, DownloadError, Retry, fetch
    from tests.conftest import free_port

    quick = Retry(attempts=2, backoff_s=0.01, timeout_s=2)
    checksum = Checksum("sha256", "0" * 64)
    with pytest.raises(DownloadError) as down:  # nothing listens on that port
        fetch([f"http://127.0.0.1:{free_port()}/digits.npz"], tmp_path / "a.npz", checksum, quick)
    with pytest.raises(DownloadError) as missing:
        fetch([(tmp_path / "absent.npz").as_uri()], tmp_path / "b.npz", checksum, quick)
    assert down.value.transient and not missing.value.transient
    assert _source_was_unreachable(None, None, Failed(data=down.value))
    assert not _source_was_unreachable(None, None, Failed(data=missing.value))
    assert not _source_was_unreachable(None, None, Failed(data=ValueError("a bug")))
    assert STAGE_TASKS["download"].retries == 2 and STAGE_TASKS["train"].retries == 0
