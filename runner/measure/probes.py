"""Timing and memory probes: what `epoch_time_s` and `peak_mem_mb` mean on each device.

CUDA: `peak_mem_mb` is the caching allocator's max allocated bytes, reset when the run starts.
CPU: `peak_mem_mb` is the training state counted from the tensors themselves
(`runner.measure.memory`:
weights, masters, gradients, optimizer state and the activations saved for backward in one step),
which the trainer records once it has measured a step; a process's resident memory cannot tell one
run from another that ran before it in the same process (a sweep's jobs reuse what earlier ones
freed). The resident-memory figure is still kept, as `rss_growth_mb`: the process's peak resident
memory (VmHWM) above the resident memory at run start. Linux lets a process reset its high-water
mark (writing 5 to /proc/self/clear_refs); where that is refused the figure falls back to
getrusage's ru_maxrss, which may include peaks from before the run (`rss_kind` says which).
The kind of `peak_mem_mb` is reported (`kind`) and logged as the `peak_mem_kind` tag. DataLoader
worker processes are not counted on CPU.
"""

from __future__ import annotations

import functools
import math
import resource
import time
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kb(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class MemoryProbe:
    """Peak memory of this run in MB, from `reset()` on (see the module's docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "cpu_tensor_accounted"
        self.rss_kind = "cpu_rss_peak_above_start"
        self._baseline_kb = 0
        self._tensor_mb: float | None = None

    def reset(self) -> None:
        self._tensor_mb = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            _CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            self.rss_kind = "cpu_ru_maxrss_above_start"
        self._baseline_kb = _status_kb("VmRSS") or 0

    def record_tensors(self, total_mb: float) -> None:
        """A tensor-accounted total of the training state (`runner.measure.memory.MemoryByKind`):
        the
        largest recorded is the CPU's `peak_mb()`."""
        self._tensor_mb = total_mb if self._tensor_mb is None else max(self._tensor_mb, total_mb)

    def peak_mb(self) -> float:
        """CUDA: the allocator's peak. CPU: the largest tensor-accounted total recorded (NaN
        before the first one)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        return math.nan if self._tensor_mb is None else self._tensor_mb

    def rss_growth_mb(self) -> float | None:
        """CPU: the process's peak resident memory above its resident memory at `reset()`
        (None on CUDA, where the allocator's figure is exact)."""
        if self.device.type == "cuda":
            return None
        if self.rss_kind == "cpu_rss_peak_above_start":
            peak_kb = _status_kb("VmHWM") or 0
        else:
            peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return max(0, peak_kb - self._baseline_kb) / 1024


def synchronize(device: torch.device) -> None:
    """Wait for queued device work so wall-clock timings mean something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Wall-clock seconds between start() and stop(), device-synchronised at both ends."""

    def __init__(self, device: torch.device):
        self.device = device
        self._t0 = 0.0

    def start(self) -> None:
        synchronize(self.device)
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        synchronize(self.device)
        return time.perf_counter() - self._t0


@functools.cache
def training_rate(dtype: torch.dtype, repeats: int = 2, least_s: float = 0.05) -> float:
    """This CPU's FLOP rate training a convolution in `dtype` (FLOP/s): a 3x3 convolution's
    forward and backward on a small batch (4 x 32 channels x 16 x 16), on torch's threads as a
    run uses them, the fastest of at least `repeats` timed steps after one untimed, repeated
    until they add up to `least_s` (a step of a few ms, timed twice on a busy machine, was up to
    15x off: the fastest of many is the machine's rate between its other work); measured once
    per process (fp16, which a CPU emulates: about 0.1-0.3 s; the others about `least_s`). What
    a run's steps take in that format is its FLOPs at about this rate."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, 16, 16, generator=generator).to(dtype).requires_grad_()
    w = torch.randn(32, 32, 3, 3, generator=generator).to(dtype).requires_grad_()
    flops = 3 * 2 * 4 * 32 * 32 * 9 * 16 * 16  # (forward, and the backward's two products)

    def step() -> None:
        torch.nn.functional.conv2d(x, w, padding=1).sum().backward()

    step()
    times: list[float] = []
    while len(times) < repeats or (sum(times) < least_s and len(times) < 1000):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return flops / max(min(times), 1e-9)
