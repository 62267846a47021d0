"""System metrics of a run (CPU, memory, disk, network; GPU utilisation, memory and power where
NVIDIA's management library, nvidia-ml-py, a dependency of the runner, or AMD's is there), sampled
by MLflow's own monitors (`mlflow.system_metrics.metrics`, the ones
`mlflow.start_run(log_system_metrics=True)` uses). A CUDA run without them says why once.

They are logged through the run's own buffered sender as `system/<name>` (MLflow's names, e.g.
`system/cpu_utilization_percentage`, which its UI charts in the "System metrics" tab), not by
MLflow's monitor thread: that thread writes to the store by itself, outside the runner's store
lock and retries, and stops for good at the first error, so it would race SQLite and give up
while a tracking server is away. Here a sample is one more buffered metric: it waits out an outage
and falls back to the offline store like the training metrics. `mlflow.system_metrics_s` sets the
period (0: off). MLflow's monitors need psutil (a dependency of the runner).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)
PREFIX = "system/"


def _monitors() -> list[Any]:
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

    monitors: list[Any] = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    try:  # as MLflow's SystemMetricsMonitor: NVIDIA's pynvml, else AMD's ROCm library, else none
        from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

        monitors.append(GPUMonitor())
    except Exception as nvidia:  # noqa: BLE001  (no GPU, or no management library)
        try:
            from mlflow.system_metrics.metrics.rocm_monitor import ROCMMonitor

            monitors.append(ROCMMonitor())
        except Exception:  # noqa: BLE001
            if _cuda_device():  # a GPU whose utilisation goes unrecorded: say why
                log.warning("No GPU utilisation in the system metrics (system/gpu_*): %s", nvidia)
    return monitors


def _cuda_device() -> bool:
    """Whether the run has a CUDA GPU (torch, where the run has imported it)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available()


class SystemSampler:
    """Samples the monitors every `interval_s` seconds in a daemon thread and hands each sample's
    aggregate to `log_metrics(metrics, step)` (steps 0, 1, 2, ...) until `stop`."""

    def __init__(
        self, log_metrics: Callable[[Mapping[str, float], int], None], interval_s: float
    ) -> None:
        self._log = log_metrics
        self.interval_s = float(interval_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._monitors: list[Any] = []
        self.samples = 0

    def start(self) -> bool:
        """Start sampling; False (with a warning) when MLflow's monitors cannot run here."""
        try:
            self._monitors = _monitors()
        except ImportError as error:
            log.warning(
                "System metrics are off: MLflow's monitors need %s (pip install psutil); "
                "set mlflow.system_metrics_s=0 to silence this",
                error.name or error,
            )
            return False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="system-metrics")
        self._thread.start()
        return True

    def sample(self) -> None:
        """One sample now: collect, aggregate, log, clear."""
        metrics: dict[str, float] = {}
        for monitor in self._monitors:
            monitor.collect_metrics()
            metrics.update(monitor.aggregate_metrics())
            monitor.clear_metrics()
        if metrics:
            self._log({PREFIX + k: float(v) for k, v in metrics.items()}, self.samples)
            self.samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception as error:  # noqa: BLE001  (a monitor failing ends sampling, not the run)
                log.warning("System metrics stopped: %s: %s", type(error).__name__, error)
                return

    def stop(self) -> None:
        """Stop sampling, with a last sample (so that a run shorter than one period has one)."""
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join(timeout=max(5.0, self.interval_s))
        alive, self._thread = self._thread.is_alive(), None
        if not alive:
            try:
                self.sample()
            except Exception as error:  # noqa: BLE001  (the run ends anyway)
                log.warning(
                    "Last system metrics sample failed: %s: %s", type(error).__name__, error
                )
