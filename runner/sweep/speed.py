"""The sweep's closing lines on speed: each finished job's steady rate with its spread, and its
speed-up over its baseline with an interval and a verdict (runner.measure.spread)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Optional

from runner.metrics import DEVICE_BUSY_FRAC
from runner.tracking import tags as tag
from runner.tracking.varying import baseline_keys, display_names, distance, params_of

History = Callable[[str, str], Sequence[tuple[int, float]]]
Traces = Callable[[str], Sequence[Any]]  # a run's EpochTraces (runner.measure.step_trace)


def _mean(history: History, run_id: str, metric: str) -> Optional[float]:
    """The mean of a run's finite values of `metric` over its epochs (None: none)."""
    values = [v for _, v in history(run_id, metric) if math.isfinite(v)]
    return sum(values) / len(values) if values else None


def speed_summary(
    children: Sequence[Any], history: History, traces: Optional[Traces] = None
) -> str:
    """The sweep's jobs side by side at the speed that compares, one line each in job order: each
    finished job's steady throughput (`tokens_per_s` for a language model, else `samples_per_s`:
    runner.measure.timing), the mean over its epochs that logged one, as its "Finished" line and
    the report give it, with its spread (the epochs' `_p10` and `_p90`, averaged the same way),
    and its ratio to its baseline, named: the O0 job of the same model and the same values of
    what else the sweep varies, seeds apart (the nearest of them: `varying.distance`), as the
    report compares (`runner.tracking.varying`; else that group's first job, else the sweep's).
    It was the sweep's first job for all, so `-m precision=o2,o0` called O0 the slower one,
    where the report gives O2 against O0; and an lr's O2 was compared with another lr's O0.
    With `traces` (a run's traces of steady step times: runner.measure.step_trace), the ratio is
    that of the two runs' median steps with its 95% interval, "within noise" where it holds 1.0
    (runner.measure.spread). A job that measured its device's busy share (`device_busy_frac`, on
    a GPU) says it. `history`: a metric's (step, value) points of a run
    (runner.tracking.base.Reader.history)."""
    # (here, not at the top: the sweep's callback imports this module where a bad config must
    # stop before torch is imported, and the timer's names come with it)
    from runner.measure import spread
    from runner.metrics import SAMPLES_PER_S, TOKENS_PER_S, spread_names
    from runner.tracking.base import FINISHED

    lines, rated = [], []
    for child in sorted(children, key=lambda c: int(c.tags.get(tag.JOB_NUM, 0))):
        if child.status != FINISHED:
            continue
        metric = TOKENS_PER_S if TOKENS_PER_S in child.metrics else SAMPLES_PER_S
        rate = _mean(history, child.run_id, metric)
        if rate is None:
            lines.append((child, None, ""))
            continue
        p10, p90 = (_mean(history, child.run_id, k) for k in spread_names(metric))
        rated.append((child, rate))
        unit = metric.removesuffix("_per_s")
        busy = child.metrics.get(DEVICE_BUSY_FRAC)  # (measured on a GPU: the run's own figure)
        said = spread.rate_text(rate, p10, p90, unit) + " steady"
        lines.append((child, rate, said + (f", device busy {busy:.0%}" if busy else "")))

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
    for child, rate, text in lines:
        if rate is None:
            out.append(f"  {names[child.run_id]}: no steady throughput (every step was warm-up)")
            continue
        base, base_rate = baseline(child)
        if base is child:
            out.append(f"  {names[child.run_id]}: {text}, the baseline")
            continue
        ratio = None
        if traces is not None:
            items = TOKENS_PER_S in child.metrics
            ratio = spread.speedup(
                [traces(child.run_id)], [traces(base.run_id)], items, value=rate / base_rate
            )
        ratio = ratio or spread.Ratio(rate / base_rate)
        out.append(
            f"  {names[child.run_id]}: {text}, {spread.ratio_text(ratio)} vs {names[base.run_id]}"
        )
    return "".join(line + "\n" for line in out)
