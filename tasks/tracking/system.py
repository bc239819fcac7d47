"""The machine's load while a run trains: MLflow's system metrics, sampled without touching the store.

MLflow's own monitor (`mlflow.start_run(log_system_metrics=True)`) runs a thread that, every sampling
interval, reads the run back from the store (`get_run`, to see whether it ended) and writes its sample
(`log_batch`): two store calls a second at the project's interval. On 2 cores that thread was most of
what tracking cost the train stage (B4: 1.059x with it, 1.018x without, benchmarks/results/).

`SystemMetrics` keeps MLflow's collectors (`SystemMetricsMonitor`'s CPU, memory, disk, network and,
where NVML finds one, GPU monitors: the same `system/...` names the UI's system-metrics tab charts, and
MLflow's environment variables for the interval, the samples per point and the node id), but its thread
only samples into memory. The points reach the store with the run's own metric writes
(`StageRun.flush`), and the thread writes them itself only when the run has written nothing for
LIVE_WRITE_S (a long epoch), so the UI stays live at the cost of one write per half minute.

A run always gets at least one point: `stop` aggregates what was sampled since the last point, or
samples once, so a training shorter than the interval is not left without any (MLflow drops them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from tasks.core.redact import redact

log = logging.getLogger(__name__)

LIVE_WRITE_S = 30.0  # the longest the store may lag behind the sampled points while a run is silent


class SystemMetrics:
    """Samples the machine every MLflow sampling interval on a daemon thread; `take` hands over the
    points sampled so far as (name, value, timestamp ms, step) rows."""

    def __init__(self, run_id: str, write: Callable[[], None], written_at: Callable[[], float]) -> None:
        # heavy: mlflow's system metrics import psutil and (where installed) NVML; only the train run's
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        # MLflow's monitor, never started: its collectors, interval, samples per point and node id
        self._monitor = SystemMetricsMonitor(run_id)
        self._prefix = "system/" + (f"{self._monitor.node_id}/" if self._monitor.node_id else "")
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
        interval, per_point = float(self._monitor.sampling_interval), int(self._monitor.samples_before_logging)
        while not self._stop.wait(interval):
            with self._lock:
                self._sample()
                if self._samples >= per_point:
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
        self._monitor.collect_metrics()
        self._samples += 1

    def _add_point(self) -> None:
        """The samples so far, aggregated as MLflow does (means; network totals), as one point."""
        stamp = int(time.time() * 1000)
        metrics: dict[str, Any] = self._monitor.aggregate_metrics()
        self._points += [(self._prefix + name, float(value), stamp, self._step) for name, value in metrics.items()]
        for collector in self._monitor.monitors:
            collector.clear_metrics()
        self._step, self._samples = self._step + 1, 0

    def _write_or_warn(self) -> None:
        try:
            self._write()
        except Exception as exc:  # the run's own next write (or its end) raises it where it is handled
            reason = redact(" ".join(str(exc).split()))[:300]  # a server URL may carry credentials
            log.warning("system metrics: could not write to the tracking store yet: %s", reason)
