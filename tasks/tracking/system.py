"""The machine's load while a run trains: MLflow's system metrics, sampled without touching the store.

MLflow's own monitor (`mlflow.start_run(log_system_metrics=True)`) runs a thread that, every sampling
interval, reads the run back from the store (`get_run`, to see whether it ended) and writes its sample
(`log_batch`): two store calls a second at the project's interval. On 2 cores that thread was most of
what tracking cost the train stage (B4: 1.059x with it, 1.018x without, benchmarks/results/).

`SystemMetrics` keeps what MLflow's monitor records (`SystemMetricsMonitor`'s CPU, memory, disk and
network figures, and a GPU's where NVML or ROCm answers: the same `system/...` names the UI's
system-metrics tab charts, and MLflow's environment variables for the interval, the samples per point and
the node id), but its thread only samples into memory. The points reach the store with the run's own metric writes
(`StageRun.flush`), and the thread writes them itself only when the run has written nothing for
LIVE_WRITE_S (a long epoch), so the UI stays live at the cost of one write per half minute.

A run always gets at least one point: `stop` aggregates what was sampled since the last point, or
samples once, so a training shorter than the interval is not left without any (MLflow drops them).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import psutil

from tasks.core.redact import redact

log = logging.getLogger(__name__)

LIVE_WRITE_S = 30.0  # the longest the store may lag behind the sampled points while a run is silent
# a point every second (MLflow's default: every 10 s), so that a training of a minute has a curve;
# sampled into memory, written with the run's metrics
INTERVAL_S = 1.0


class SystemMetrics:
    """Samples the machine every MLflow sampling interval on a daemon thread; `take` hands over the
    points sampled so far as (name, value, timestamp ms, step) rows."""

    def __init__(self, write: Callable[[], None], written_at: Callable[[], float]) -> None:
        # MLflow's environment variables, over our default interval
        self._interval = _setting("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", float) or INTERVAL_S
        self._per_point = _setting("MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING", int) or 1
        node = _setting("MLFLOW_SYSTEM_METRICS_NODE_ID", str)
        self._prefix = "system/" + (f"{node}/" if node else "")
        self._collectors: list[Any] = [HostCollector(), NetworkCollector(), *_gpu_collectors()]
        self._write, self._written_at = write, written_at
        self._lock = threading.Lock()
        self._points: list[tuple[str, float, int, int]] = []
        self._step, self._samples = 0, 0
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._tried_at = float("-inf")  # the thread's last write, or attempt at one
        self._thread = threading.Thread(target=self._sample_until_stopped, name="lockstep-system-metrics", daemon=True)
        self._thread.start()

    def take(self) -> list[tuple[str, float, int, int]]:
        """The points sampled since the last call, oldest first."""
        with self._lock:
            points, self._points = self._points, []
        return points

    def stop(self) -> None:
        """Stop sampling: the thread makes what it sampled since its last point (or, if there was no
        point yet, one sample then) the last point, and ends. Safe to call twice."""
        self._stop.set()
        self._thread.join()

    def _sample_until_stopped(self) -> None:
        # psutil's cpu_percent is the load since the calling thread's previous call: this one starts the
        # first span (MLflow's thread records a meaningless 0.0 as its first CPU sample instead)
        psutil.cpu_percent()
        while not self._stop.wait(self._interval):
            with self._lock:
                self._sample()
                if self._samples >= self._per_point:
                    self._add_point()
            if time.monotonic() - max(self._written_at(), self._started, self._tried_at) >= LIVE_WRITE_S:
                self._tried_at = time.monotonic()  # a store that is down is tried again LIVE_WRITE_S later
                self._write_or_warn()
        with self._lock:  # the run ended: its last point (its only one, for a run shorter than the interval)
            if self._samples == 0 and self._step == 0:
                self._sample()
            if self._samples:
                self._add_point()

    def _sample(self) -> None:
        for collector in self._collectors:
            collector.collect_metrics()
        self._samples += 1

    def _add_point(self) -> None:
        """The samples so far, aggregated as MLflow does (means; network totals), as one point."""
        stamp = int(time.time() * 1000)
        metrics: dict[str, Any] = {}
        for collector in self._collectors:
            metrics.update(collector.aggregate_metrics())
            collector.clear_metrics()
        self._points += [(self._prefix + name, float(value), stamp, self._step) for name, value in metrics.items()]
        self._step, self._samples = self._step + 1, 0

    def _write_or_warn(self) -> None:
        try:
            self._write()
        except Exception as exc:  # the run's own next write (or its end) raises it where it is handled
            reason = redact(" ".join(str(exc).split()))[:300]  # a server URL may carry credentials
            log.warning("system metrics: could not write to the tracking store yet: %s", reason)


# MLflow's own collectors (mlflow/system_metrics/metrics/cpu_monitor.py, disk_monitor.py, network_monitor.py),
# the same psutil calls, names and rounding, written out here because importing them loads all of MLflow
# (~1.8 CPU-s on a 2-core Zen 3) and its monitor opens MLflow's client store (~1 s more), in every train
# process, where the run's rows are written without the client (tasks/tracking/sqlite_store.py).
# tests/tracking/test_system_metrics.py compares them with MLflow's, name for name.


class HostCollector:
    """CPU, memory and the root disk: each point the mean of its samples, to one decimal."""

    def __init__(self) -> None:
        self._samples: dict[str, list[float]] = defaultdict(list)

    def collect_metrics(self) -> None:
        memory, disk = psutil.virtual_memory(), psutil.disk_usage(os.sep)
        for name, value in (
            ("cpu_utilization_percentage", psutil.cpu_percent()),
            ("system_memory_usage_megabytes", memory.used / 1e6),
            ("system_memory_usage_percentage", memory.used / memory.total * 100),
            ("disk_usage_percentage", disk.percent),
            ("disk_usage_megabytes", disk.used / 1e6),
            ("disk_available_megabytes", disk.free / 1e6),
        ):
            self._samples[name].append(value)

    def aggregate_metrics(self) -> dict[str, float]:
        return {name: round(sum(values) / len(values), 1) for name, values in self._samples.items()}

    def clear_metrics(self) -> None:
        self._samples.clear()


class NetworkCollector:
    """Megabytes received and sent since the run started: the latest sample, not a mean."""

    def __init__(self) -> None:
        start = psutil.net_io_counters()
        self._start = (start.bytes_recv / 1e6, start.bytes_sent / 1e6)
        self._latest: dict[str, float] = {}

    def collect_metrics(self) -> None:
        now = psutil.net_io_counters()
        self._latest = {
            "network_receive_megabytes": now.bytes_recv / 1e6 - self._start[0],
            "network_transmit_megabytes": now.bytes_sent / 1e6 - self._start[1],
        }

    def aggregate_metrics(self) -> dict[str, float]:
        return dict(self._latest)

    def clear_metrics(self) -> None:
        self._latest = {}


def _setting(name: str, kind: type) -> Any:
    """MLflow's environment variable `name` as `kind` (None where unset), as mlflow.environment_variables reads it."""
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected {kind.__name__}") from None


def _gpu_collectors() -> list[Any]:
    """MLflow's GPU collectors where a GPU answers (NVML for NVIDIA, pyrsmi for AMD), as its monitor picks
    them; loaded only then: a GPU host's training is long enough for MLflow's import."""
    if importlib.util.find_spec("pynvml") is not None:
        import pynvml  # optional: nvidia-ml-py, where installed

        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:  # the library without a driver or a GPU: most CPU hosts
            log.debug("system metrics: no NVIDIA GPU (%s)", exc)
        else:
            # heavy: mlflow (~1.8 s), only on a host with an NVIDIA GPU
            from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

            return [GPUMonitor()]
    if importlib.util.find_spec("pyrsmi") is not None:
        # heavy: mlflow (~1.8 s), only where AMD's ROCm SMI bindings are installed
        from mlflow.system_metrics.metrics.rocm_monitor import ROCMMonitor

        try:
            return [ROCMMonitor()]
        except Exception as exc:  # as MLflow's monitor does: no AMD GPU, no GPU metrics
            log.debug("system metrics: no AMD GPU (%s)", exc)
    return []
