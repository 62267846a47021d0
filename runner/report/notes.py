"""The comparison's prose, as short bullets (none over MAX_LINE characters): how to read the
headline, what the full table's columns mean, and the runs to look at (lacking metrics, started
with precision warnings, unfinished)."""

from __future__ import annotations

from collections.abc import Sequence

from runner import metrics as m
from runner.report.analysis import Row, seeds_vary, timed_targets
from runner.tracking.varying import SEED_PARAMS, display_names, tuned_keys, varying_params

TUNED_TITLE = "tuned (trainer.tune)"


def warnings_of(row: Row) -> list[str]:
    """The warnings and errors among the precision findings a run started with ("warning
    precision.autocast_dtype"), from its findings tag; info findings are left out."""
    entries = [e.strip() for e in row.findings.split(";")]
    return [e for e in entries if e.partition(" ")[0] in ("warning", "error")]


def no_steady_step(row: Row) -> str:
    """Why a run that trained lacks its steady throughput, where it is known: every step it
    took was warm-up (the first `trainer.warmup_steps` of a session, or a step that compiled),
    which the epoch's own figure counts and the steady figure leaves out; "" otherwise."""
    epoch = m.EPOCH_TOKENS_PER_S if row.is_lm else m.EPOCH_SAMPLES_PER_S
    if row.throughput is not None or row.get(epoch) is None:
        return ""
    warmup = row.params.get("trainer.warmup_steps", "?")
    return (
        f" (no steady step: every step was warm-up, the first trainer.warmup_steps={warmup} "
        f"of a session or a step that compiled; {epoch}, which counts them, is "
        f"{row.get(epoch):.0f}; train more steps for the steady figure)"
    )


MAX_LINE = 400  # characters of a prose line (a bullet) at most


def clip(line: str) -> str:
    """A bullet of at most MAX_LINE characters (a run's error can be long: its tag keeps it)."""
    return line if len(line) <= MAX_LINE else line[: MAX_LINE - 5].rstrip() + " ..."


def reach_notes(rows: Sequence[Row], target_gap: float) -> list[str]:
    """What the time to O0's best means, with each baseline's target ([] without baselines)."""
    targets = timed_targets(rows)
    if not targets:
        return []
    return [
        "Time to O0's best: the training time (the epochs' `epoch_time_s` summed, validation "
        "excluded, warm-up included) to the end of the first epoch whose validation came within "
        f"`--target-gap` {target_gap:g} of the baseline's best (accuracy below, a language "
        'model\'s loss above), "not reached" where no epoch did.',
        "Speedup to O0's best: the baseline's own time to that target / the run's: a level that "
        "steps faster but needs more epochs to get there shows it here. Targets: "
        + ", ".join(f"{name} {target:.4g}" for name, target in targets)
        + ".",
    ]


def headline_notes(rows: Sequence[Row]) -> list[str]:
    """How to read the headline: one short bullet a column that needs one."""
    varying = [k for k in varying_params(rows) if k not in SEED_PARAMS]
    same = " with the same " + ", ".join(f"`{k}`" for k in varying) if varying else ""
    seeds = seeds_vary(rows)
    return [
        "Speed-up: the steady rate (`samples_per_s`, a language model's `tokens_per_s`: the "
        "median step's, averaged over the epochs) / the baseline's, above 1 faster; in brackets "
        "its 95% interval from the two runs' step times"
        + (", each configuration's seeds pooled" if seeds else "")
        + ' (docs/reading-the-time.md); "within noise" where it holds 1.0.',
        "Baseline: the O0 run of the same model"
        + same
        + " (of those, one of the same seed, optimizer, samples a step and batch size where "
        "there is one), named in the full table's last column.",
        "p10-p90: the rates of the slow and the fast steps (at the 90th and 10th percentile step "
        "times): how much the steps vary, not an interval.",
        "Memory vs O0: the peak memory / the baseline's, below 1 less. Δ vs O0: the best "
        "validation minus the baseline's"
        + (
            ', the seeds\' means ± their std combined; "within noise" where the seeds overlap'
            if seeds
            else " (one run each: repeat with seeds for its noise)"
        )
        + ".",
    ]


def table_notes(rows: Sequence[Row], target_gap: float) -> list[str]:
    """What the full table's columns mean, a short bullet each."""
    notes = [
        "Columns between run and model: the params that differ between these runs"
        + (
            f"; what trainer.tune chose is a run's result, not a difference: `{TUNED_TITLE}` "
            "lists what it changed (`tune.md` and the `tune.*` params say why)"
            if tuned_keys(rows)
            else ""
        )
        + ".",
        "Throughput: the steady figure, its epochs' mean, p10-p90 its spread (runs made before "
        "the steady figure: the epoch's own, the mean over the epochs after the first; their "
        "speedup: the baseline's train time / the run's).",
        "mfu: the achieved FLOP/s over the GPU's dense peak for the level's format, the epochs' "
        "mean (a GPU in the peak table only). Warm-up: the warm-up steps' time, over the run's "
        "sessions. Train time: all epochs, validation and warm-up included.",
        "Peak memory: "
        + ", ".join(sorted({r.peak_mem_kind for r in rows}))
        + " (`peak_mem_kind`: CUDA's max allocated memory, or on a CPU the training state "
        "counted from the tensors).",
        "Weights, masters, grads, optimizer state, activations: each kind of tensor's memory in "
        "one training step, counted from the tensors (activations: the bytes saved for "
        "backward); state total is their sum.",
        "Layers fp32/bf16/fp16/fp8: how many layers (modules with weights of their own) computed "
        "in each format at the first step, as the layer audit saw them (`layers/layers_ran.csv`).",
        *reach_notes(rows, target_gap),
    ]
    if any(r.is_lm for r in rows):
        notes.append(
            "Language models: best val loss is the mean token cross-entropy on the validation "
            "tokens (nats per token), perplexity its exponential; throughput in tokens per second."
        )
    return notes


def run_lists(rows: Sequence[Row]) -> list[str]:
    """The runs lacking metrics, that started with precision warnings, that did not finish."""
    names = display_names(rows)  # each run as its row names it, with its id
    lines: list[str] = []
    missing = [r for r in rows if r.missing]
    if missing:
        lines += ["Runs lacking metrics (shown as -):", ""]
        lines += [
            f"- {names[r.run_id]} (run {r.run_id}, {r.status}): no {', '.join(r.missing)}"
            + no_steady_step(r)
            for r in missing
        ]
        lines.append("")
    warned = [(r, w) for r in rows if (w := warnings_of(r))]
    if warned:
        lines += [
            "Runs that started with precision warnings (each message and hint is in the run's "
            "`precision.txt`; they can explain a level's speed or accuracy):",
            "",
        ]
        lines += [f"- {names[r.run_id]} (run {r.run_id}): {'; '.join(w)}" for r, w in warned]
        lines.append("")
    unfinished = [r for r in rows if r.status != "FINISHED"]
    if unfinished:
        lines += ["Runs that did not finish:", ""]
        lines += [
            f"- {names[r.run_id]} (run {r.run_id}, {r.status}): {r.reason or 'no reason recorded'}"
            for r in unfinished
        ]
        lines.append("")
    if not any(r.baseline for r in rows):
        lines += ["No finished O0 run to compare with: speedup and memory ratio are empty.", ""]
    return [clip(line) for line in lines]
