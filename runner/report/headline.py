"""The comparison's headline: one row per configuration (a run, or where seeds vary the runs that
differ only in them), at most ten columns, each figure with what says how much of it is noise
(runner.measure.spread): the speed-up over O0 with its 95% interval, the throughput with its
p10-p90 spread, the accuracy difference with the seeds' std. The full table follows it in the
Markdown and the CSV (runner.report.tables)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from runner import metrics as m
from runner.measure import spread
from runner.measure.spread import Difference, Ratio
from runner.report.analysis import DEVICE_BUSY, Row, SeedGroup, all_lm, seed_groups, seeds_vary
from runner.tracking.varying import display_names

MAX_COLUMNS = 10


def mean_std(stats: tuple[float, float, int] | None, spec: str, scale: float = 1.0) -> str:
    """ "mean ± std" of SeedGroup.stats; the mean alone for one run; "-" for none."""
    if stats is None:
        return "-"
    mean, std, count = stats
    if count < 2:
        return format(mean * scale, spec)
    return f"{format(mean * scale, spec)} ± {format(std * scale, spec)}"


def reach_cell(row: Row) -> str:
    """The training time the run took to come within the target gap of its O0 run's best
    validation, and the epoch: "41.2 (epoch 3)"; "not reached"; "epoch 3" where it logged no
    epoch times; "-" without a baseline."""
    reach = row.reach
    if reach is None:
        return "-"
    if reach.epoch is None:
        return "not reached"
    if reach.seconds is None:
        return f"epoch {reach.epoch}"
    return f"{reach.seconds:.1f} (epoch {reach.epoch})"


def reach_stats(group: SeedGroup, value, spec: str) -> str:
    """A configuration's time to O0's best (or its speedup: `value` of a row), over the seeds that
    got there, saying how many did where some did not; a single run's as `reach_cell` says it."""
    if len(group.rows) == 1 and value is None:
        return reach_cell(group.rows[0])
    tried = [r.reach for r in group.rows if r.reach is not None]
    reached = sum(reach.epoch is not None for reach in tried)
    if value is None:
        value = lambda r: r.reach.seconds if r.reach else None  # noqa: E731
    cell = mean_std(group.stats(value), spec)
    if tried and not reached:
        return "not reached"
    return cell + (f" ({reached} of {len(tried)} reached)" if reached < len(tried) else "")


@dataclass
class Line:
    """One configuration of the headline, against its baseline configuration (None: none)."""

    label: str
    group: SeedGroup
    base: Optional[SeedGroup]

    @property
    def rows(self) -> list[Row]:
        return self.group.rows

    @property
    def lm(self) -> bool:
        return all(r.is_lm for r in self.rows)

    def speedup(self) -> Optional[Ratio]:
        """Its rate over its baseline's, with the 95% interval of the seeds' pooled traces; the
        mean of its runs' speedups where the rates cannot say it (runs made before the steady
        figure: train times); None without a baseline."""
        if self.base is None or self.base is self.group:
            return None
        runs, base = self.rows, self.base.rows
        if all(r.steady and r.throughput for r in (*runs, *base)):
            value = _mean([r.throughput for r in runs]) / _mean([b.throughput for b in base])
            traced = spread.speedup(
                [r.traces for r in runs], [b.traces for b in base], self.lm, value=value
            )
            return traced or Ratio(value)
        ratios = [r.speedup for r in runs if r.speedup is not None]
        return Ratio(_mean(ratios)) if ratios else None

    def quality(self) -> Optional[Difference]:
        """Its best validation minus its baseline's (accuracy, or a language model's loss)."""
        if self.base is None or self.base is self.group:
            return None
        metric = m.BEST_VAL_LOSS if self.lm else m.BEST_VAL_ACC
        return spread.difference(
            [r.get(metric) for r in self.rows], [b.get(metric) for b in self.base.rows]
        )

    def status(self) -> str:
        counts: dict[str, int] = {}
        for r in self.rows:
            counts[r.status] = counts.get(r.status, 0) + 1
        if len(counts) == 1 and len(self.rows) == 1:
            return self.rows[0].status
        return ", ".join(f"{n} {status}" for status, n in counts.items())


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def lines(rows: Sequence[Row]) -> list[Line]:
    """The headline's configurations: the seed groups where seeds vary, else one a run; each with
    the configuration its first run's baseline belongs to."""
    if seeds_vary(rows):
        groups = seed_groups(rows)
        labels = [
            f"{g.model} {g.label} ({len(g.rows)} seed{'s' if len(g.rows) > 1 else ''})"
            for g in groups
        ]
    else:
        names = display_names(rows)
        groups = [SeedGroup(names[r.run_id], r.model, [r]) for r in rows]
        labels = [g.label for g in groups]
    owner = {id(r): g for g in groups for r in g.rows}
    out = []
    for label, group in zip(labels, groups):
        base = group.rows[0].base
        out.append(Line(label, group, owner.get(id(base)) if base is not None else None))
    return out


def _speed_cell(line: Line) -> str:
    if line.base is line.group:
        return "baseline"
    ratio = line.speedup()
    return "-" if ratio is None else spread.ratio_text(ratio)


def _rate_cell(line: Line) -> str:
    """The configuration's throughput with its spread: "1,045 (980-1,090)"."""
    rates = [r.throughput for r in line.rows if r.throughput is not None]
    if not rates:
        return "-"
    low, high = zip(*(r.spread for r in line.rows))
    text = spread.number(_mean(rates))
    if any(v is None for v in (*low, *high)):
        return text
    return f"{text} ({spread.number(_mean(low))}-{spread.number(_mean(high))})"


def _quality_cells(line: Line) -> tuple[str, str]:
    """(its best validation, its difference from the baseline's)."""
    lm = line.lm
    metric, spec, scale = (m.BEST_VAL_LOSS, ".4f", 1.0) if lm else (m.BEST_VAL_ACC, ".2f", 100.0)
    best = mean_std(line.group.stats(lambda r: r.get(metric)), spec, scale)
    if line.base is line.group:
        return best, "baseline"
    diff = line.quality()
    if diff is None:
        return best, "-"
    return best, diff.text(scale, "+.4f" if lm else "+.2f")


def columns(rows: Sequence[Row]) -> list[str]:
    lm, cls = any(r.is_lm for r in rows), any(not r.is_lm for r in rows)
    unit = "tokens" if lm and not cls else "samples" if cls and not lm else "samples or tokens"
    quality = (
        ("best val loss", "Δ loss vs O0 (nats)")
        if all_lm(rows)
        else ("best val acc (%)", "Δ acc vs O0 (pt)")
        if not lm
        else ("best val (acc %, loss)", "Δ vs O0 (pt, nats)")
    )
    titles = [
        "run",
        "speed-up vs O0 [95%]",
        f"{unit}/s (p10-p90)",
        "memory vs O0",
        *quality,
        "time to O0's best (s)",
    ]
    if any(r.get(DEVICE_BUSY) is not None for r in rows):
        titles.append("GPU busy (%)")
    return [*titles, "status"]


def render(rows: Sequence[Row]) -> list[str]:
    """The headline table's Markdown lines."""
    titles = columns(rows)
    busy = "GPU busy (%)" in titles
    out = [
        "| " + " | ".join(titles) + " |",
        "|---|" + "---:|" * (len(titles) - 2) + "---|",
    ]
    for line in lines(rows):
        best, diff = _quality_cells(line)
        cells = [
            line.label,
            _speed_cell(line),
            _rate_cell(line),
            mean_std(line.group.stats(lambda r: r.memory_ratio), ".2f"),
            best,
            diff,
            reach_stats(line.group, None, ".1f"),
        ]
        if busy:
            cells.append(mean_std(line.group.stats(lambda r: r.get(DEVICE_BUSY)), ".0f"))
        out.append("| " + " | ".join([*cells, line.status()]) + " |")
    assert len(titles) <= MAX_COLUMNS
    return out
