"""The trainer's step timer (`runner.measure.timing`), given what only the run knows: the session's
warm-up (`trainer.warmup_steps`), the task's items, the model's FLOPs per sample (counted in
planning), the device's peak for the level's format, the ranks, torch.compile's compiles and
what to change when the loop waits for data (README.md beside this file)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from runner.measure import peaks
from runner.measure.instruments import ArtifactSink
from runner.measure.step_trace import ARTIFACT_DIR
from runner.measure.timing import TimingInstrument


def compile_count() -> int:
    """How much torch.compile has compiled in this process so far (frames captured, and the
    graphs inductor compiled or took from its cache: a lazily compiled backward too); a step
    over which it grows compiled or recompiled."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return (
        counters["frames"]["total"]
        + inductor["fxgraph_cache_miss"]
        + inductor["fxgraph_cache_hit"]
        + inductor["fxgraph_cache_bypass"]
    )


def data_advice(loader: Any, device: torch.device) -> str:
    """What to change when the training loop waits for its batches, from the loader's own
    settings. Data in memory whose items are slices (`in_memory`: the tokens of
    data=synthetic_text) costs no worker's time: what waits there is the batch's collation and
    its copy, or another process on the machine; the advice says so, not to add workers (which
    trainer.tune says gain nothing)."""
    workers = int(getattr(loader, "num_workers", 0) or 0)
    if getattr(getattr(loader, "dataset", None), "in_memory", False):
        copy = " and its copy to the GPU (pinned memory helps)" if device.type == "cuda" else ""
        return (
            "The data is in memory (each item a slice): what waits is the batch's collation"
            f"{copy}, or other processes on this machine taking its CPUs (its load); more "
            "trainer.num_workers gain nothing here."
        )
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    advice = [
        f"Raise trainer.num_workers (now {workers}; this machine gives the run {cpus} CPUs)"
        if workers < (cpus or 1)
        else f"trainer.num_workers ({workers}) already matches the CPUs ({cpus})"
    ]
    if device.type == "cuda" and not getattr(loader, "pin_memory", False):
        advice.append("pin host memory for the copies to the GPU")
    if workers and not getattr(loader, "persistent_workers", False):
        advice.append("keep the workers between epochs (persistent workers)")
    advice.append(
        "or make the dataset's own loading cheaper (decoding, augmentation: time one dataset[i])"
    )
    return "; ".join(advice) + "."


def peak_for(device: torch.device, fmt: str) -> tuple[Optional[float], str]:
    """(the device's dense TFLOP/s in `fmt`, or None and why: said once by the timer)."""
    if device.type != "cuda":
        return None, ""  # a CPU: tflops only, nothing to say
    name = torch.cuda.get_device_name(device)
    peak = peaks.peak_tflops(name, fmt)
    if peak is not None:
        return peak, ""
    known = peaks.find_peak(name)
    if known is None:
        why = (
            f"no mfu: {name!r} is not in runner.measure.peaks' table of dense peaks "
            f"({', '.join(p.gpu for p in peaks.PEAKS)}); tflops is logged"
        )
    else:
        why = f"no mfu: the {known.gpu} has no {fmt} peak in the table; tflops is logged"
    return None, why


def timing_instrument(
    cfg: Any,
    device: torch.device,
    *,
    task: Any,
    engine: Any,
    model: torch.nn.Module,
    loader: Any,
    comm: Any,
    flops_per_sample: Optional[float],
    logger: Any,
    on_artifact: Optional[ArtifactSink] = None,
    artifact_dir: Optional[Path] = None,
    captures: Optional[Callable[[], int]] = None,
) -> TimingInstrument:
    """The step timer of a trainer (`cfg`: its TrainerConfig; `model`: the model itself).
    `on_artifact`: where its traces of steady step times go (None: none are written: a tuning
    trial, a pre-flight, a rank that writes no files), written beside the diagnostics' folder
    `artifact_dir` (its sibling `timing/`; None: a temporary folder). `captures`: how many times
    the whole step was captured in a CUDA graph so far (`trainer.cuda_graphs=step`): a step that
    captured is left out of the steady figures as a compiling one is (its capture is charged as
    a compile)."""
    fp8 = getattr(engine, "fp8", None)
    fmt = peaks.compute_format(
        engine.properties.compute_dtypes, fp8 is not None and bool(fp8.converted), model
    )
    peak, no_peak = peak_for(device, fmt)

    def reduce(values: Sequence[float]) -> list[float]:
        return comm.sum_(torch.tensor(list(values), device=device, dtype=torch.float64)).tolist()

    return TimingInstrument(
        device,
        cfg.warmup_steps,
        items_metric=task.items_metric,
        flops_per_sample=flops_per_sample,
        peak=peak,
        no_peak=no_peak,
        world_size=comm.world_size,
        reduce=reduce if comm.active else None,
        compiles=_counting(compile_count if cfg.compile else None, captures),
        data_advice=data_advice(loader, device),
        logger=logger,
        on_artifact=on_artifact,
        folder=None if artifact_dir is None else Path(artifact_dir).parent / ARTIFACT_DIR,
    )


def _counting(*counts: Optional[Callable[[], int]]) -> Optional[Callable[[], int]]:
    """One count that grows when any of `counts` (None: not counted) grows."""
    kept = [count for count in counts if count is not None]
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else lambda: sum(count() for count in kept)
