"""Kernel benchmark: one O2 Adam (and SGD) step (unscale + check + step + copy back) on a model's
parameter list, fused kernels against the stock torch composition, near the bandwidth limit?

Variants, timed interleaved in one process (a, b, c, a, b, c, ...), medians:
  (a) fused: the runner's engine (AmpEngine, O2, Adam) stepping from the scaled fp16 model
      gradients: a read-only check pass (2 B/param), the single host read, one fused pass
      (read grad 2, master 4, m 4, v 4; write master 4, m 4, v 4, fp16 copy 2): 30 B/param.
  (b) stock: torch._foreach_copy_ of the fp16 grads into fp32 master grads (6 B/param),
      torch._amp_foreach_non_finite_check_and_unscale_ on them (8), the host read of the flag,
      torch.optim.Adam(fused=True) on the masters (28), torch._foreach_copy_ of the masters into
      the fp16 model (6): 48 B/param.
  (c) torch.optim.AdamW(fused=True) on plain fp32 parameters: 28 B/param (no mixed precision).
  (f) the same AdamW under torch.amp.GradScaler, stepping from loss-scaled fp32 gradients: (a)'s
      job (unscale, overflow check, the step skipped on an overflow) as torch does it for fp32
      parameters, without a host read: the scaler's check rewrites every gradient (x 1.0: read
      4, write 4), then the fused AdamW unscales as it steps and writes the unscaled gradients
      back (read grad 4, param 4, m 4, v 4; write all four): 40 B/param. The scaled gradients
      are put back between its steps, untimed, as the next backward would leave them.
The SGD half of the same question, SGD with momentum 0.9:
  (d) fused: the engine (O2, SGD) from the scaled fp16 gradients: the check pass (2), one fused
      pass (read grad 2, master 4, momentum 4; write master 4, momentum 4, fp16 copy 2): 22.
  (e) torch.optim.SGD(momentum=0.9, fused=True) on plain fp32 parameters: 20 B/param.
Achieved GB/s = bytes / median time, also as a fraction of a copy-bandwidth measurement taken in
the same run (a 1 GiB fp32 copy: read + write).

Host cost: the same variants over ResNet-50's tensor count (161) of 16 elements each, where
the arithmetic is negligible and the time is what a step costs the host (Python, dispatch, the
kernels' call overhead); median microseconds of --host-iters interleaved steps.

    python -m benchmarks.fused_step --device cpu           # ResNet-50 and VGG-16, one run
    python -m benchmarks.fused_step --device cuda --iters 50
    python -m benchmarks.fused_step --models resnet50 --iters 5 --threads 1

Targets: (a) at least as fast as (c) (torch's fused AdamW, >= 1.0x) and >= 1.3x faster than (b),
on every model; (d) at least as fast as (c) too (the fused-step issue asks it of the C++ Adam and
SGD steps alike; (e) is (d)'s own peer, shown, not a target); the host cost of (a) at most
(c)'s; on CUDA also >= 80% of the copy bandwidth on VGG-16. Timings on a shared machine move
with its load: the variants run interleaved in one process and the ratios compare medians of the
same rounds. The script reports, it does not gate: exit 0 whatever the verdict, 1 if a variant
crashed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Optional

import torch
from torch import nn

from benchmarks.common import (
    add_device_option,
    add_out_option,
    add_threads_option,
    apply_threads,
    command,
    load_average,
    machine,
    now,
    results_path,
)

MODELS = ("resnet50", "vgg16")
BYTES_PER_PARAM = {
    "a_fused": 30,
    "b_stock": 48,
    "c_adamw_fp32": 28,
    "d_fused_sgd": 22,
    "e_sgd_fp32": 20,
    "f_adamw_scaler": 40,
}
MOMENTUM = 0.9
# (a) over (b), (a) over (c), and the copy-bandwidth fraction with the models it applies to
TARGETS = {
    "cpu": {"vs_stock": 1.3, "vs_adamw": 1.0, "bandwidth": None},
    "cuda": {"vs_stock": 1.3, "vs_adamw": 1.0, "bandwidth": (0.80, ("vgg16",))},
}
HOST_MODEL = "resnet50"  # the host-cost rows: its tensor count, HOST_NUMEL elements each
HOST_NUMEL = 16
LOSS_SCALE = 1024.0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_option(p)
    p.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated torchvision models (default {','.join(MODELS)})",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed steps per variant (default 31 on CPU, 50 on CUDA)",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--host-iters",
        type=int,
        default=301,
        help="interleaved steps per variant of the host-cost rows (0 skips them; default 301)",
    )
    add_threads_option(p)
    add_out_option(p, "kernels", beside="")
    args = p.parse_args(argv)
    apply_threads(p, args)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if not hasattr(__import__("torchvision").models, m)]
    if unknown:
        p.error(f"unknown torchvision model(s): {', '.join(unknown)}")
    args.iters = args.iters or (50 if args.device == "cuda" else 31)
    args.out = args.out or results_path(f"kernels_{args.device}.md", args.device)
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device) -> float:
    sync(device)
    started = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - started


def copy_bandwidth(device: torch.device, iters: int) -> float:
    """GB/s of a 1 GiB fp32 copy (bytes read + bytes written), median."""
    x = torch.ones(2**28, device=device)
    y = torch.empty_like(x)
    for _ in range(2):
        y.copy_(x)
    times = [timed(lambda: y.copy_(x), device) for _ in range(max(iters, 5))]
    return 2 * x.numel() * 4 / statistics.median(times) / 1e9


def param_shapes(model: str) -> list[torch.Size]:
    import torchvision

    with torch.device("meta"):
        net = getattr(torchvision.models, model)()
    return [p.shape for p in net.parameters()]


class Params(nn.Module):
    """A module holding parameters of the given shapes (the model's list, without its forward:
    the optimizer step does not need one)."""

    def __init__(self, shapes: list[torch.Size], dtype: torch.dtype, device: torch.device):
        super().__init__()
        g = torch.Generator(device=device).manual_seed(0)
        self.params = nn.ParameterList(
            nn.Parameter(
                torch.randn(s, generator=g, device=device, dtype=torch.float32).mul_(0.02).to(dtype)
            )
            for s in shapes
        )


def scaled_grads(shapes, device) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(1)
    return [
        torch.randn(s, generator=g, device=device).mul_(0.01 * LOSS_SCALE).half() for s in shapes
    ]


def variant_fused(shapes, grads, device, optimizer: str = "adam"):
    """(a) The runner's engine: O2 (fp16 model, fp32 masters), Adam, dynamic loss scale; (d)
    the same with SGD and momentum (`optimizer="sgd"`)."""
    from runner.precision import AmpEngine, resolve

    model = Params(shapes, torch.float32, device)
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=MOMENTUM)
    engine = AmpEngine(
        resolve("O2", {"keep_batchnorm_fp32": False}).properties, device, kernels="fused"
    )
    engine.scaler.load_state_dict({"loss_scale": LOSS_SCALE})
    engine.prepare(model, opt)
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    loss = torch.zeros((), device=device)

    def step():
        engine.scale_loss(loss)  # this round's gradients are loss 0's, as backward would say
        assert engine.step(opt)

    # the step must be the kernels' own: an engine that fell back to torch's ops (as every
    # single-GPU engine did before its device was fixed) would be timed under this label
    calls = []
    real = engine.kernels.ops

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    engine.kernels = dataclasses.replace(engine.kernels, ops=Counting())
    step()
    engine.kernels = dataclasses.replace(engine.kernels, ops=real)
    if f"{optimizer}_step" not in calls:
        raise RuntimeError(
            f"the engine stepped without the fused kernels (kernel calls: {calls}); "
            "variant (a) would time torch's ops"
        )
    return step, engine


def variant_stock(shapes, grads, device):
    """(b) The stock torch composition of the same O2 step."""
    half = list(Params(shapes, torch.float16, device).parameters())
    masters = [p.detach().float().requires_grad_(True) for p in half]
    master_grads = [torch.empty_like(m) for m in masters]
    for m, g in zip(masters, master_grads):
        m.grad = g
    opt = torch.optim.Adam(masters, lr=1e-4, fused=True)
    found = torch.zeros(1, device=device)
    inv = torch.full((1,), 1.0 / LOSS_SCALE, device=device)

    @torch.no_grad()
    def step():
        torch._foreach_copy_(master_grads, grads)
        torch._amp_foreach_non_finite_check_and_unscale_(master_grads, found, inv)
        if found.item() == 0:  # the skip decision, as every loss-scaled step makes it
            opt.step()
            torch._foreach_copy_(half, masters)

    return step, None


def variant_adamw_fp32(shapes, grads, device):
    """(c) AdamW(fused=True) on plain fp32 parameters: the fp32 training floor."""
    params = list(Params(shapes, torch.float32, device).parameters())
    for p, g in zip(params, grads):
        p.grad = g.float() / LOSS_SCALE
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    return opt.step, None


def variant_adamw_scaler(shapes, grads, device):
    """(f) AdamW(fused=True) on fp32 parameters under torch.amp.GradScaler: torch's own
    loss-scaled step (GradScaler hands the fused optimizer its scale and overflow flag: no host
    read), the same job as (a) without the fp16 model. The step leaves the gradients unscaled;
    `step.reset` (untimed) puts the scaled ones back, as the next backward would."""
    params = list(Params(shapes, torch.float32, device).parameters())
    scaled = [g.float() for g in grads]  # scaled by LOSS_SCALE, as backward of a scaled loss
    for p, g in zip(params, scaled):
        p.grad = g.clone()
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler(device.type, init_scale=LOSS_SCALE, growth_interval=10**9)
    scaler.scale(torch.zeros((), device=device))  # (the scaler's scale, made by its first use)

    def step():
        scaler.step(opt)
        scaler.update()

    step.reset = lambda: torch._foreach_copy_([p.grad for p in params], scaled)
    step.optimizer = opt
    return step, None


def variant_fused_sgd(shapes, grads, device):
    """(d) The runner's engine: O2, SGD with momentum, dynamic loss scale."""
    return variant_fused(shapes, grads, device, optimizer="sgd")


def variant_sgd_fp32(shapes, grads, device):
    """(e) SGD(momentum, fused=True) on plain fp32 parameters: (d)'s fp32 floor."""
    params = list(Params(shapes, torch.float32, device).parameters())
    for p, g in zip(params, grads):
        p.grad = g.float() / LOSS_SCALE
    opt = torch.optim.SGD(params, lr=1e-4, momentum=MOMENTUM, fused=True)
    return opt.step, None


VARIANTS = {
    "a_fused": variant_fused,
    "b_stock": variant_stock,
    "c_adamw_fp32": variant_adamw_fp32,
    "d_fused_sgd": variant_fused_sgd,
    "e_sgd_fp32": variant_sgd_fp32,
    "f_adamw_scaler": variant_adamw_scaler,
}


def prepare(step: Callable[[], None]) -> None:
    """What a variant's step needs done before it, untimed (`step.reset`, where it has one)."""
    reset = getattr(step, "reset", None)
    if reset is not None:
        reset()


def interleaved(shapes, device, iters: int, warmup: int) -> tuple[dict, Optional[str]]:
    """Every variant's step times over the same rounds (a, b, c, a, b, c, ...), and the kernels
    the engine of (a) stepped with."""
    steps = {}
    kernels = None
    for name, make in VARIANTS.items():
        # gradients of its own for each variant: none finds another's just read, still in cache
        steps[name], engine = make(shapes, scaled_grads(shapes, device), device)
        if engine is not None:
            from runner import csrc

            kernels = csrc.name_of(engine.kernels)
    for _ in range(warmup):
        for fn in steps.values():
            prepare(fn)
            fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(iters):  # interleaved: every variant sees the same conditions
        for name, fn in steps.items():
            prepare(fn)  # (untimed)
            times[name].append(timed(fn, device))
    return times, kernels


def ratios(rows: dict, key: str) -> dict:
    """The report's speedups: (b)'s, (c)'s and (f)'s time over (a)'s, (c)'s and (e)'s over (d)'s
    (above 1, (a) or (d) is faster)."""
    a = rows["a_fused"][key]
    d = rows["d_fused_sgd"][key]
    return {
        "speedup_a_vs_b": rows["b_stock"][key] / a,
        "speedup_a_vs_c": rows["c_adamw_fp32"][key] / a,
        "speedup_a_vs_f": rows["f_adamw_scaler"][key] / a,
        "speedup_d_vs_c": rows["c_adamw_fp32"][key] / d,
        "speedup_d_vs_e": rows["e_sgd_fp32"][key] / d,
    }


def bench_model(
    model: str, device: torch.device, iters: int, warmup: int, bandwidth: float
) -> dict:
    shapes = param_shapes(model)
    n = sum(s.numel() for s in shapes)
    times, kernels = interleaved(shapes, device, iters, warmup)
    rows = {}
    for name, ts in times.items():
        median = statistics.median(ts)
        moved = BYTES_PER_PARAM[name] * n
        rows[name] = {
            "median_ms": median * 1e3,
            "min_ms": min(ts) * 1e3,
            "bytes_per_param": BYTES_PER_PARAM[name],
            "gbytes": moved / 1e9,
            "gb_per_s": moved / median / 1e9,
            "fraction_of_copy": moved / median / 1e9 / bandwidth,
        }
    return {
        "model": model,
        "params": n,
        "tensors": len(shapes),
        "kernels": kernels,
        "variants": rows,
        **ratios(rows, "median_ms"),
    }


def bench_host(device: torch.device, iters: int, warmup: int) -> dict:
    """The host cost of one step: HOST_MODEL's tensor count, HOST_NUMEL elements each."""
    count = len(param_shapes(HOST_MODEL))
    times, kernels = interleaved([torch.Size([HOST_NUMEL])] * count, device, iters, warmup)
    rows = {
        name: {"median_us": statistics.median(ts) * 1e6, "min_us": min(ts) * 1e6}
        for name, ts in times.items()
    }
    return {
        "model": HOST_MODEL,
        "tensors": count,
        "numel_each": HOST_NUMEL,
        "iters": iters,
        "kernels": kernels,
        "variants": rows,
        **ratios(rows, "median_us"),
    }


def verdict(device: str, results: list[dict], host: Optional[dict]) -> str:
    t = TARGETS[device]
    parts = []
    ok = True
    for r in results:
        a = r["variants"]["a_fused"]
        good = r["speedup_a_vs_b"] >= t["vs_stock"] and r["speedup_a_vs_c"] >= t["vs_adamw"]
        good &= r["speedup_d_vs_c"] >= t["vs_adamw"]
        text = (
            f"{r['model']}: {r['speedup_a_vs_c']:.2f}x AdamW, {r['speedup_a_vs_b']:.2f}x stock, "
            f"SGD (d) {r['speedup_d_vs_c']:.2f}x AdamW ({r['speedup_d_vs_e']:.2f}x fused SGD)"
        )
        if t["bandwidth"] is not None and r["model"] in t["bandwidth"][1]:
            good &= a["fraction_of_copy"] >= t["bandwidth"][0]
            text += f", {100 * a['fraction_of_copy']:.0f}% of copy bandwidth"
        ok &= good
        parts.append(f"{text} ({'meets' if good else 'misses'} target)")
    if host is not None:
        good = host["speedup_a_vs_c"] >= 1.0
        ok &= good
        parts.append(
            f"host cost ({host['tensors']} tensors of {host['numel_each']}): "
            f"{host['variants']['a_fused']['median_us']:.0f} us against AdamW's "
            f"{host['variants']['c_adamw_fp32']['median_us']:.0f} us "
            f"({'meets' if good else 'misses'} target)"
        )
    target = (
        f"(a) >= {t['vs_adamw']}x torch's fused AdamW and >= {t['vs_stock']}x the stock composition"
        f", (d) >= {t['vs_adamw']}x torch's fused AdamW"
    )
    if t["bandwidth"] is not None:
        target += f", >= {100 * t['bandwidth'][0]:.0f}% of the copy bandwidth on " + ", ".join(
            t["bandwidth"][1]
        )
    return (
        f"{'PASS' if ok else 'MISS'}: targets on {device} are {target}; the host cost of (a) at "
        "most AdamW's. " + "; ".join(parts) + "."
    )


LABELS = {
    "a_fused": "(a) fused kernels (engine, `precision.kernels`={k})",
    "b_stock": "(b) stock torch composition",
    "c_adamw_fp32": "(c) AdamW fused, fp32",
    "d_fused_sgd": "(d) fused kernels, SGD (engine, `precision.kernels`={k})",
    "e_sgd_fp32": "(e) SGD fused, fp32",
    "f_adamw_scaler": "(f) AdamW fused, fp32, under GradScaler",
}


def faster_by(r: dict, name: str) -> str:
    """The last column: how much faster the fused variants are than this row's."""
    parts = {
        "b_stock": [("a", "speedup_a_vs_b")],
        "c_adamw_fp32": [("a", "speedup_a_vs_c"), ("d", "speedup_d_vs_c")],
        "e_sgd_fp32": [("d", "speedup_d_vs_e")],
        "f_adamw_scaler": [("a", "speedup_a_vs_f")],
    }.get(name, [])
    return ", ".join(f"({v}) {r[key]:.2f}x" for v, key in parts if key in r)


def render(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"# Kernels: one O2 optimizer step, Adam and SGD ({report['device']})",
        "",
        "Unscale + overflow check + Adam step on fp32 masters + copy back into the fp16 model, "
        "for a torchvision model's parameter list; (d) and (e) are the same with SGD (momentum "
        f"{MOMENTUM}); (f) is (c) under torch's GradScaler, stepping from loss-scaled "
        "gradients: torch's own loss-scaled step, for fp32 parameters. Median of "
        f"{report['iters']} interleaved steps per variant (after {report['warmup']} warm-up "
        "steps; the variants take turns, so a busy spell of the machine falls on all of them). "
        "Bytes are what each variant must move per step; GB/s is bytes / median time; "
        f"the copy bandwidth measured in the same run is {report['copy_gb_per_s']:.1f} GB/s "
        "(1 GiB fp32 copy, read + write; a plain copy pays a read of every line it writes, so "
        "streaming kernels can exceed it: above 100% means at least as fast as a copy). Each "
        "variant reads gradients of its own, so none finds another's in cache.",
        "",
        "| model | params | variant | B/param | GB moved | median ms | GB/s | % of copy bw "
        "| fused faster by |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        for name, v in r["variants"].items():
            lines.append(
                f"| {r['model']} | {r['params'] / 1e6:.1f}M | {LABELS[name].format(k=r['kernels'])}"
                f" | {v['bytes_per_param']} | {v['gbytes']:.2f} | {v['median_ms']:.1f} | "
                f"{v['gb_per_s']:.1f} | {100 * v['fraction_of_copy']:.0f}% | {faster_by(r, name)} |"
            )
    lines += [
        "",
        "(a) against (c), torch's fused AdamW: "
        + ", ".join(f"{r['model']} {r['speedup_a_vs_c']:.2f}x" for r in report["results"])
        + "; against (b), the stock composition: "
        + ", ".join(f"{r['model']} {r['speedup_a_vs_b']:.2f}x" for r in report["results"])
        + "; (d), the SGD step, against (c): "
        + ", ".join(f"{r['model']} {r['speedup_d_vs_c']:.2f}x" for r in report["results"])
        + " and against (e), torch's fused SGD: "
        + ", ".join(f"{r['model']} {r['speedup_d_vs_e']:.2f}x" for r in report["results"])
        + "; (a) against (f), torch's fused AdamW under GradScaler (the same loss-scaled, "
        "overflow-checked step, on fp32 parameters): "
        + ", ".join(f"{r['model']} {r['speedup_a_vs_f']:.2f}x" for r in report["results"])
        + " (above 1: the fused step is faster).",
    ]
    host = report.get("host")
    if host is not None:
        lines += [
            "",
            f"## Host cost of one step ({host['tensors']} tensors, {host['model']}'s count, of "
            f"{host['numel_each']} elements each)",
            "",
            "Negligible arithmetic: the time is the step's host work (Python, dispatch, the "
            f"kernels' call overhead). Median of {host['iters']} interleaved steps per variant.",
            "",
            "| variant | median us | min us | fused faster by |",
            "|---|---:|---:|---:|",
        ]
        for name, v in host["variants"].items():
            lines.append(
                f"| {LABELS[name].format(k=host['kernels'])} | {v['median_us']:.0f} | "
                f"{v['min_us']:.0f} | {faster_by(host, name)} |"
            )
    lines += [
        "",
        f"Verdict: {report['verdict']}",
        "",
        "## Setup",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores (torch uses {m['torch_threads']} threads)"
        + (f"; GPU {m['gpu']}, CUDA {m['cuda']}" if "gpu" in m else "")
        + f"; torch {m['torch']}, Python {m['python']}, {m['platform']}",
        f"- Load average (1, 5, 15 min): {report['load_average']['start']} at start, "
        f"{report['load_average']['end']} at end",
        f"- Date: {report['date']}",
        f"- Command: `{report['command']}`",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = torch.device(args.device)
    load_at_start = load_average()
    print(
        f"Kernel benchmark on {args.device}: {', '.join(args.models)}; {args.iters} steps per "
        "variant",
        flush=True,
    )
    bandwidth = copy_bandwidth(device, args.iters)
    print(f"copy bandwidth: {bandwidth:.1f} GB/s", flush=True)
    results = []
    for model in args.models:
        print(f"{model} ...", end=" ", flush=True)
        r = bench_model(model, device, args.iters, args.warmup, bandwidth)
        results.append(r)
        print(
            ", ".join(f"{k} {v['median_ms']:.1f} ms" for k, v in r["variants"].items()), flush=True
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    host = None
    if args.host_iters > 0:
        print("host cost ...", end=" ", flush=True)
        host = bench_host(device, args.host_iters, args.warmup)
        print(
            ", ".join(f"{k} {v['median_us']:.0f} us" for k, v in host["variants"].items()),
            flush=True,
        )
    report = {
        "benchmark": "kernels",
        "device": args.device,
        "iters": args.iters,
        "warmup": args.warmup,
        "copy_gb_per_s": bandwidth,
        "results": results,
        "host": host,
        "verdict": verdict(args.device, results, host),
        "machine": machine(args.device),
        "command": command("fused_step", argv),
        "date": now(),
        "load_average": {"start": load_at_start, "end": load_average()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = render(report)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    print()
    print(text)
    print(f"Wrote {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
