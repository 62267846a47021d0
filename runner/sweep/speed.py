"""The sweep's closing lines: its jobs side by side at the speed that compares
(`speed_summary`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from runner.tracking import tags as tag
from runner.tracking.varying import baseline_keys, display_names, distance, params_of


def speed_summary(
    children: Sequence[Any], history: Callable[[str, str], Sequence[tuple[int, float]]]
) -> str:
    """The sweep's jobs side by side at the speed that compares, one line each in job order: each
    finished job's steady throughput (`tokens_per_s` for a language model, else `samples_per_s`:
    runner.measure.timing), the mean over its epochs that logged one, as its "Finished" line and the
    report give it, and its ratio to its baseline, named: the O0 job of the same model and the same
    values of what else the sweep varies, seeds apart (the nearest of them: `varying.distance`), as
    the report compares (`runner.tracking.varying`; else that group's first job, else the sweep's).
    It was the sweep's first job for all, so `-m precision=o2,o0` called O0 the slower one, where
    the report gives O2 against O0; and an lr's O2 was compared with another lr's O0. `history`: a
    metric's (step, value) points of a run (runner.tracking.base.Reader.history)."""
    from runner.measure.timing import SAMPLES_PER_S, TOKENS_PER_S
    from runner.tracking.base import FINISHED

    lines, rated = [], []
    for child in sorted(children, key=lambda c: int(c.tags.get(tag.JOB_NUM, 0))):
        if child.status != FINISHED:
            continue
        metric = TOKENS_PER_S if TOKENS_PER_S in child.metrics else SAMPLES_PER_S
        rates = [v for _, v in history(child.run_id, metric) if math.isfinite(v)]
        if not rates:
            lines.append((child, None, ""))
            continue
        rate = sum(rates) / len(rates)
        rated.append((child, rate))
        lines.append((child, rate, metric.removesuffix("_per_s")))

    keys = baseline_keys([c for c, _ in rated])
    names = display_names([c for c, _, _ in lines])  # (ids where names repeat: two machines)

    def group(child: Any) -> tuple:
        model = child.tags.get(tag.MODEL) or child.params.get("model.name")
        params = params_of(child)
        return (model, *(params.get(k) for k in keys))

    groups = {c.run_id: group(c) for c, _ in rated}  # (once a job: baseline compares them all)

    def baseline(child: Any) -> tuple[Any, float]:
        same = [(c, r) for c, r in rated if groups[c.run_id] == groups[child.run_id]]
        o0 = [(c, r) for c, r in same if c.params.get("precision.opt_level") == "O0"]
        o0.sort(key=lambda cr: distance(cr[0].params, child.params))
        return (o0 or same or rated)[0]

    out = []
    for child, rate, unit in lines:
        if rate is None:
            out.append(f"  {names[child.run_id]}: no steady throughput (every step was warm-up)")
            continue
        base, base_rate = baseline(child)
        out.append(
            f"  {names[child.run_id]}: {rate:,.0f} {unit}/s steady ({rate / base_rate:.2f}x "
            f"{names[base.run_id]})"
        )
    return "".join(line + "\n" for line in out)
