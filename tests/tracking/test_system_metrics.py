"""The train run's system metrics: sampled on a thread that leaves the store alone while the run writes."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import pytest

from tasks.core.config.service import TrackingConfig
from tasks.tracking import system
from tasks.tracking.runs import PARENT_ENV, stage_run

CPU = "system/cpu_utilization_percentage"
NAMES = {  # what MLflow's UI charts on a run's system-metrics tab (no GPU here)
    CPU, "system/system_memory_usage_megabytes", "system/system_memory_usage_percentage",
    "system/disk_usage_percentage", "system/disk_usage_megabytes", "system/disk_available_megabytes",
    "system/network_receive_megabytes", "system/network_transmit_megabytes",
}  # fmt: skip


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One sqlite store for the module's runs (creating one runs MLflow's migrations: seconds)."""
    return tmp_path_factory.mktemp("system-metrics")


@pytest.fixture
def store(shared_store: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{shared_store / 'mlflow.db'}")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING", "1")
    monkeypatch.delenv("MLFLOW_SYSTEM_METRICS_NODE_ID", raising=False)
    monkeypatch.delenv(PARENT_ENV, raising=False)
    monkeypatch.chdir(shared_store)  # lineage tags read dvc.lock / data.dvc relative to here: absent
    return shared_store


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(10_000))


def _threads() -> set[str]:
    return {thread.name for thread in threading.enumerate()}


def test_the_train_run_samples_the_machine_and_writes_only_with_its_own_metrics(store: Path) -> None:
    with stage_run("train", TrackingConfig(), {"lr": 0.1}) as run:
        client = run.mlflow.MlflowClient()
        assert "lockstep-system-metrics" in _threads() and "SystemMetricsMonitor" not in _threads()
        _busy(1.8)  # about three samples, none written: the run has been silent for less than LIVE_WRITE_S
        assert client.get_metric_history(run.run_id, CPU) == []
        run.log_metrics({"train_loss": 0.5}, step=1)  # the run's first write carries them
        written = client.get_metric_history(run.run_id, CPU)
        assert len(written) >= 2, written
        _busy(1.5)
    assert "lockstep-system-metrics" not in _threads()  # stopped with the run
    history = client.get_metric_history(run.run_id, CPU)
    assert [m.step for m in history] == list(range(len(history))) and len(history) > len(written)
    # the thread's spans start at the run's start: a busy process's first span is not MLflow's 0.0
    assert all(0 < m.value <= 100 for m in history), [m.value for m in history]
    assert NAMES <= set(client.get_run(run.run_id).data.metrics)


def test_a_run_shorter_than_the_interval_still_gets_a_point(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "60")
    with stage_run("train", TrackingConfig(), {}) as run:
        _busy(0.2)
    history = run.mlflow.MlflowClient().get_metric_history(run.run_id, CPU)
    assert [m.step for m in history] == [0] and 0 < history[0].value <= 100


def test_a_silent_run_writes_its_points_while_it_trains(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long epoch logs nothing for minutes: the thread writes the points itself, every LIVE_WRITE_S."""
    monkeypatch.setattr(system, "LIVE_WRITE_S", 1.0)
    with stage_run("train", TrackingConfig(), {}) as run:
        client, deadline = run.mlflow.MlflowClient(), time.monotonic() + 30
        while not client.get_metric_history(run.run_id, CPU):  # the run itself writes nothing meanwhile
            assert time.monotonic() < deadline, "the thread wrote no point in 30 s"
            _busy(0.2)


def test_other_stages_sample_nothing(store: Path) -> None:
    with stage_run("evaluate", TrackingConfig(), {}) as run:
        assert "lockstep-system-metrics" not in _threads()
        _busy(0.6)
    assert not any(name.startswith("system/") for name in run.mlflow.MlflowClient().get_run(run.run_id).data.metrics)


def test_a_store_that_fails_the_threads_write_is_warned_about_and_tried_again_later(
    store: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The thread's own write failing (the store down during a long epoch) keeps the points for the run's
    next write, says so, and is not retried at every sample."""
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.1")
    monkeypatch.setattr(system, "LIVE_WRITE_S", 0.5)
    attempts: list[float] = []

    def write() -> None:
        attempts.append(time.monotonic())
        raise ConnectionError("https://user:s3cret@mlflow.example/api: connection refused")

    sampler = system.SystemMetrics(write, lambda: float("-inf"))
    deadline = time.monotonic() + 30
    while len(attempts) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    sampler.stop()
    gaps = [later - earlier for earlier, later in itertools.pairwise(attempts)]
    assert len(attempts) >= 3 and min(gaps) >= 0.5, gaps  # LIVE_WRITE_S apart, not at each sample (0.1 s)
    steps = [point[3] for point in sampler.take()]
    assert sorted(set(steps)) == list(range(len(set(steps)))) and len(set(steps)) > len(attempts)  # all kept
    warned = [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]
    assert warned and "s3cret" not in warned[0] and "https://***@mlflow.example/api: connection refused" in warned[0]


def test_the_collectors_record_what_mlflows_own_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same names, the same aggregation (means to one decimal; network totals since the start) as
    MLflow's CPU, disk and network monitors, sampled at the same moments (psutil stubbed to fixed readings)."""
    from collections import namedtuple

    import psutil
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

    memory, disk = namedtuple("Memory", "used total percent"), namedtuple("Disk", "used free percent")
    net = namedtuple("Net", "bytes_recv bytes_sent")
    readings = iter(itertools.chain.from_iterable(itertools.repeat(x, 2) for x in (12.5, 40.0, 77.7)))
    monkeypatch.setattr(psutil, "cpu_percent", lambda: next(readings))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(3_123_456_789, 8_000_000_000, 39.0))
    monkeypatch.setattr(psutil, "disk_usage", lambda _: disk(55_555_555_555, 44_444_444_444, 55.6))
    received = iter([1_000_000, 1_000_000, 3_500_000, 3_500_000, 9_250_000, 9_250_000, 12_000_001, 12_000_001])
    monkeypatch.setattr(psutil, "net_io_counters", lambda: net(next(received), 2_000_000))
    ours = [system.HostCollector(), system.NetworkCollector()]
    theirs = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    for _ in range(3):
        for collector in theirs[:1] + ours[:1] + theirs[1:2] + theirs[2:] + ours[1:]:
            collector.collect_metrics()
    mine = {k: v for collector in ours for k, v in collector.aggregate_metrics().items()}
    mlflows = {k: v for monitor in theirs for k, v in monitor.aggregate_metrics().items()}
    assert mine == mlflows and mine["cpu_utilization_percentage"] == 43.4 and len(mine) == 8, (mine, mlflows)
    assert {f"system/{name}" for name in mine} == NAMES


def test_mlflows_variables_set_the_interval_and_a_wrong_one_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", raising=False)
    sampler = system.SystemMetrics(lambda: None, lambda: float("-inf"))
    sampler.stop()
    assert sampler._interval == 1.0  # a point a second unless the variable says otherwise (MLflow: 10 s)
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "2.5")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_NODE_ID", "trainer-b")
    sampler = system.SystemMetrics(lambda: None, lambda: float("-inf"))
    sampler.stop()
    assert sampler._interval == 2.5 and {point[0].split("/")[1] for point in sampler.take()} == {"trainer-b"}
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING", "ten")
    with pytest.raises(ValueError, match="MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING='ten': expected int"):
        system.SystemMetrics(lambda: None, lambda: float("-inf"))


def test_the_sampler_loads_no_mlflow(tmp_path: Path) -> None:
    """A direct-written run's sampler (tasks/tracking/sqlite_store.py's case) loads no MLflow module."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from tasks.tracking import system\n"
        "sampler = system.SystemMetrics(lambda: None, lambda: float('-inf'))\n"
        "sampler.stop()\n"
        "assert sampler.take(), 'no point'\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlflow'))\n"
    )
    from tests.conftest import ROOT, subprocess_env

    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
