"""`trainer.tune`: the settings the user left at their defaults, chosen by measuring them.

After the config is checked (its plan made) and before the run's plan is made, `tuned(plan, ...)`
times candidates on the run's own model, batch, device and level (runner.run.tune_measure):
channels_last (models with convolutions), cudnn.benchmark (CUDA), the fused kernels or torch's ops
(where the kernels are built), torch.compile, default then max-autotune (where the run's steps
repay its compile time), the whole step replayed as a CUDA graph (CUDA, where planning's refusals
allow it for the run; its capture charged as a compile).
Each is tried on top of the fastest so far, where what it is expected to take fits what is left of
`trainer.tune_budget_s` (a compile cannot be stopped once started); the fastest whose first-step
loss is within the level's tolerance of the untuned one wins. The chosen settings are the input
of the run's one plan (runner.run.plan.Measured), set on its config as overrides are: the run is
named, recorded and explained exactly as a run given them by hand. The candidates are built apart
from the run, and every random generator is put back.

What the user gave (the command line, a sweep's values, an experiment or config file: a value
other than the default) is never changed. `auto` skips a run too short to repay tuning; `on`
always tunes; `refresh` tunes again past the cache (runner.run.tune_cache); a resumed run keeps its
checkpoint's settings. Rank 0 decides, the other ranks take its decision.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

from runner.config import TUNABLE
from runner.config.values import override_text, with_values
from runner.errors import ConfigError
from runner.run import cuda_graphs, out_of_memory, rng, tune_cache, tune_data, tune_given
from runner.run.distributed import Comm
from runner.run.plan import RunPlan
from runner.run.tune_decision import DEFAULTS, Tuning, named, not_tried
from runner.run.tune_measure import (
    BUDGET_NOTE,
    COMPILE_GAIN,
    COMPILE_GUESS_S,
    MAX_AUTOTUNE,
    Row,
    choose,
    expected_s,
    gemm_layers,
    measure,
    refuse_if_loss_differs,
    skipped_note,
    step_counts,
    tolerance,
)

log = logging.getLogger(__name__)

AUTO_MIN_STEPS = 300  # trainer.tune=auto: fewer steps than this do not repay tuning
BUDGET_SHARE, BUDGET_CAP_S = 0.05, 120.0  # tune_budget_s=null: this share of the run, capped
# under on and refresh (the run tunes whatever its length): a quarter of the run, at least 15 s
ON_SHARE, ON_LEAST_S = 0.25, 15.0
REPAID = "steps repay"  # (the end of a row's note: the run would not repay its compile)
OUT_OF_MEMORY = "refused: out of memory"  # (a candidate's note: the untuned settings fit)
GRAPHS = "trainer.cuda_graphs"
STEP_GRAPH = {GRAPHS: cuda_graphs.STEP}  # the candidate: the whole step replayed
NOT_CAPTURED = "refused: cannot be captured"  # (a graph candidate's note: a refusal's reasons)


# ---- what may be tuned -----------------------------------------------------------------------
def given_keys(cfg, overrides: Sequence[str]) -> set[str]:
    """The tunable keys the user gave: named by an override, set in a config file the user
    chose (an experiment file, a group option, their own primary config: tune_given), or valued
    other than the default."""
    typed = {o.lstrip("+~").split("=", 1)[0].strip() for o in overrides}
    typed |= tune_given.file_keys(TUNABLE, overrides)
    return {key for key in TUNABLE if key in typed or OmegaConf.select(cfg, key) != DEFAULTS[key]}


def counts_on_data(plan: RunPlan, comm: Comm) -> bool:
    """Whether tuning the run of `plan` needs its datasets loaded to count its steps:
    trainer.tune=auto (which skips a run too short to repay it) where the config does not
    tell the count, on a run tuning measures (not resumed, not sharded)."""
    return (
        plan.cfg.trainer.tune == "auto"
        and plan.resume is None
        and not (plan.shards and comm.active)
        and plan.estimated_steps() is None
    )


# ---- the entry point -------------------------------------------------------------------------
def tuned(
    plan: RunPlan,
    comm: Comm,
    device: torch.device,
    overrides: Sequence[str] = (),
    datasets: Optional[Any] = None,
) -> Optional[Tuning]:
    """What tuning decided for the run of `plan` (the config as given; None: it did not tune):
    its `settings` are config keys and values, which the run's plan is then made with, as
    overrides (runner.run.plan.Measured). `overrides`: the command line's (what it names is
    given); `datasets`: the run's, loaded (trainer.tune=auto counts the run's steps on them
    where only the data can tell; else their count is unknown)."""
    mode = plan.cfg.trainer.tune
    if mode == "off":
        return None
    if plan.resume is not None:  # (the plan checked that what is given now is the checkpoint's)
        saved = plan.resume.state["config"]
        settings = {k: tree_value(saved, k) for k in TUNABLE}
        settings = {k: v for k, v in settings.items() if v is not None}
        log.info("trainer.tune: a resumed run keeps its checkpoint's settings")
        kept = {k: "kept from the checkpoint" for k in settings}
        return Tuning(settings, kept, source="checkpoint")
    if plan.shards and comm.active:  # one rank cannot build the whole model to time it
        log.info("trainer.tune: not tuned: a sharded run (trainer.strategy=fsdp) is not measured")
        return None
    given = given_keys(plan.cfg, overrides)
    steps = plan.estimated_steps(datasets if mode == "auto" else None, comm.world_size)
    tuning = comm.on_main(partial(_kept_apart, plan, device, given, steps))
    return comm.from_main(tuning)


def _kept_apart(
    plan: RunPlan, device: torch.device, given: set[str], steps: Optional[int]
) -> Optional[Tuning]:
    """`_decide`, with every random generator and cuDNN's flag put back afterwards."""
    state, benchmark = rng.rng_state(), torch.backends.cudnn.benchmark
    try:
        return _decide(plan, device, given, steps)
    finally:
        rng.restore_rng(state)
        torch.backends.cudnn.benchmark = benchmark


def _decide(
    plan: RunPlan, device: torch.device, given: set[str], steps: Optional[int]
) -> Optional[Tuning]:
    mode = plan.cfg.trainer.tune
    if mode == "auto" and steps is not None and steps < AUTO_MIN_STEPS:
        # (it times steps of one batch: a step that accumulates several counts each)
        k = plan.cfg.trainer.accumulate_grad_batches
        counted = "steps" if k == 1 else f"batches ({k} a step, trainer.accumulate_grad_batches)"
        log.info(
            "trainer.tune=auto: not tuned: %d training %s are too few to repay tuning "
            "(it needs %d; trainer.tune=on tunes anyway)",
            steps,
            counted,
            AUTO_MIN_STEPS,
        )
        return None
    free = [k for k in TUNABLE if k not in given]
    for key in ("trainer.cudnn_benchmark", tune_data.PIN, GRAPHS):
        if device.type != "cuda" and key in free:
            free.remove(key)  # (no cuDNN, no copy to a GPU, no CUDA graph: nothing to measure)
    if not free:
        log.info("trainer.tune: nothing to tune: every tunable setting was given")
        return None
    facts = _facts(plan, device, free)
    digest = tune_cache.key(facts)
    started = time.perf_counter()
    with tune_cache.lock(digest):
        rows = None if mode == "refresh" else tune_cache.read(digest)
        if rows is not None and (
            _short_of_budget(plan, rows, steps) or _untried(plan, device, free, rows, steps)
        ):
            rows = None
        source = "cache"
        if rows is None:
            try:
                measured, budget = _measure_all(plan, device, free, steps)
            except _CannotFit as cannot:
                log.info("trainer.tune: not tuned: %s", cannot)
                return None
            step_ms = choose(measured, steps).steady_ms
            measured += tune_data.measure(plan, device, free, (budget, started), step_ms, steps)
            rows = [{**r.as_dict(), "budget_s": budget, "steps": steps} for r in measured]
            tune_cache.write(digest, rows, facts)
            source = "measured"
    model_rows, loader_rows = tune_data.split([Row.from_dict(r) for r in rows])
    tuning = _decision(plan, model_rows, free, given, steps, source)
    step_ms = model_rows[tuning.chosen].steady_ms
    tune_data.decide(tuning, plan, loader_rows, free, step_ms, steps)
    tuning.seconds = time.perf_counter() - started
    log.info("trainer.tune (%s, %.1f s):\n%s", source, tuning.seconds, tuning.table().rstrip())
    return tuning


def _short_of_budget(
    plan: RunPlan, rows: Sequence[Mapping[str, Any]], steps: Optional[int]
) -> bool:
    """Whether the cached `rows` skipped a candidate for want of a budget smaller than this
    run's (which then measures again, and keeps its own rows)."""
    skipped = [r for r in rows if str(r.get("note", "")).endswith(BUDGET_NOTE)]
    skipped += [r for r in rows if str(r.get("note", "")).startswith("not measured: over")]
    if not skipped:
        return False
    budgets = [r.get("budget_s") for r in skipped]
    had = max((b for b in budgets if isinstance(b, (int, float))), default=0.0)
    now = _budget_s(plan, steps, Row.from_dict(rows[0]))
    if now <= had:
        return False
    log.info(
        "trainer.tune: measuring again: the cached decision skipped candidates within %.0f s, "
        "this run's trainer.tune_budget_s is %.0f s",
        had,
        now,
    )
    return True


def _untried(
    plan: RunPlan,
    device: torch.device,
    free: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    steps: Optional[int],
) -> bool:
    """Whether this run would try a candidate the cached `rows` did not (a compile, which only
    a run long enough to repay it tries: a shorter run's decision is not a longer one's). A row
    skipped as not repaid by its run's steps counts as tried, unless this run is longer."""

    def longer(row: Mapping[str, Any]) -> bool:
        return steps is not None and steps > (row.get("steps") or steps)

    tried = [
        r.get("settings", {})
        for r in rows
        if not (str(r.get("note", "")).endswith(REPAID) and longer(r))
    ]
    for settings, _ in _alternatives(plan, device, free, steps, Row.from_dict(rows[0])):
        if not any(all(s.get(k) == v for k, v in settings.items()) for s in tried):
            log.info(
                "trainer.tune: measuring again: the cached decision, made for a shorter run, "
                "did not try %s",
                named(settings),
            )
            return True
    return False


def _facts(plan: RunPlan, device: torch.device, free: Sequence[str]) -> dict[str, Any]:
    """What a configuration's step time depends on (runner.run.tune_cache.key)."""
    tree = plan.config_tree
    data = {k: v for k, v in tree["data"].items() if not str(k).startswith(("num_", "seed"))}
    return {
        "model": tree["model"],
        "data": data,
        "batch_size": tree["trainer"]["batch_size"],
        "level": plan.properties.as_params(),
        "optimizer": tree["optimizer"],
        "device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "threads": torch.get_num_threads(),
        "free": sorted(free),
        "given": {k: tree_value(tree, k) for k in TUNABLE if k not in free},
        **tune_data.facts(free),
    }


def tree_value(tree: Mapping[str, Any], key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def _measure_all(
    plan: RunPlan, device: torch.device, free: Sequence[str], steps: Optional[int]
) -> tuple[list[Row], float]:
    """The untuned settings first, then each alternative on top of the fastest so far, while
    what it is expected to take (runner.run.tune_measure's estimates from the times measured so
    far) fits what is left of the budget; once over the budget, the rest are skipped. The total
    is the budget and at most one candidate's misestimate. Returns the rows and the budget.

    Before them, the untuned settings run once untimed, two steps (`_first_estimate`): the
    process's one-time work (its first CUDA work, cuDNN's search for the model's shapes: timing
    ResNet-50's untuned settings first took 17-21 s on an H200) would otherwise fall on the
    first candidate timed, making the later ones look faster and each expected to take as
    long; and its second step says how many steps a candidate is timed for (a slow step, fewer:
    tune_measure.step_counts) and whether any candidate fits the budget. A candidate that
    changes the memory layout (channels_last) is expected to pay cuDNN's search again."""
    started = time.perf_counter()
    log.info(
        "trainer.tune: timing the untuned settings on a copy of the run, then candidates for %s",
        ", ".join(free),
    )
    prime, budget, _ = _first_estimate(plan, device, steps, started)
    counts = step_counts((prime.steady_ms or 0.0) / 1e3)
    start = time.perf_counter()
    base = measure(plan, {}, device, counts)
    rows = [base]
    counts = step_counts((base.steady_ms or 0.0) / 1e3)  # (a timed step: a better estimate)
    log.info(
        "trainer.tune: untuned: %s; the candidates within %.0f s (trainer.tune_budget_s)",
        _timed(base),
        budget,
    )
    # the longest a candidate took, by kind; the search a new layout costs (over-estimated by
    # the process's first work, which the first step of the untimed run also held)
    costs = {"eager": time.perf_counter() - start}
    search_s = max(prime.warmup_s - base.warmup_s, 0.0)
    layers = gemm_layers(plan.meta_model())
    repays = steps * base.steady_ms / 1e3 * COMPILE_GAIN if steps and base.steady_ms else None
    tol = tolerance(plan.properties.compute_dtypes)
    if plan.properties.fp8_linear:
        tol = max(tol, tolerance(["fp8"]))
    for settings, guess in _alternatives(plan, device, free, steps, base):
        trial = {**choose(rows, steps).settings, **settings}
        search = search_s if "trainer.channels_last" in settings else 0.0
        kind, expected = expected_s(trial, guess + search, costs, layers, device)
        left = budget - (time.perf_counter() - started)
        note = skipped_note(kind, expected, left) if expected > left else ""
        if not note and kind == "autotune" and repays is not None and expected > repays:
            note = f"skipped: compiling with max-autotune would take ~{expected:.0f} s, more "
            note += f"than {steps} {REPAID}"
        refused = _graph_refusals(plan, device, trial)
        note = f"{NOT_CAPTURED}: {'; '.join(refused)}" if refused else note
        if note:
            row = Row(trial, note=note)
        else:
            start = time.perf_counter()
            row = _measured(plan, trial, device, counts)
            if not row.note:  # (else it ran out of memory)
                took = time.perf_counter() - start
                took -= row.warmup_s if kind == "eager" and search else 0.0  # (its layout's search)
                costs[kind] = max(costs.get(kind, 0.0), took)
                refuse_if_loss_differs(row, base.loss, tol)
        # skipped, refused (out of memory, another first-step loss): why; else its step
        said = f" {row.note}" if row.note else f": {_timed(row)}"
        log.info("trainer.tune: %s%s", named(trial), said)
        rows.append(row)
    return rows, budget


def _timed(row: Row) -> str:
    """A measured row in a progress line: its steady step, and its compile where it had one."""
    said = f"{row.steady_ms:.1f} ms a steady step" if row.steady_ms is not None else "not timed"
    return said + (f" (compiled in {row.compile_s:.1f} s)" if row.compile_s else "")


def _measured(
    plan: RunPlan, trial: Mapping[str, Any], device: torch.device, counts: tuple[int, int]
) -> Row:
    """`measure`, where a candidate that runs out of memory is refused (the untuned settings,
    measured first, fit: its layout or its compile needs more); its memory is freed first."""
    try:
        return measure(plan, trial, device, counts)
    except ConfigError as error:  # (a step the capture found it cannot hold: a host read)
        if error.key != GRAPHS:
            raise
        return Row(dict(trial), note=f"{NOT_CAPTURED}: {error.problem}")
    except Exception as error:
        if not out_of_memory.is_out_of_memory(error):
            raise
    out_of_memory.release(device)  # (the failed step's frames are gone here)
    return Row(dict(trial), note=OUT_OF_MEMORY)


def _budget_s(plan: RunPlan, steps: Optional[int], base: Row) -> float:
    """trainer.tune_budget_s, or where null, from the run's estimated time (its steps at the
    untuned step, as the run takes it: its loader, threads and layout): under auto
    BUDGET_SHARE of it, under on and refresh ON_SHARE of it but at least ON_LEAST_S; capped at
    BUDGET_CAP_S (the cap alone where the run's length is unknown). Tuning pays for itself: a
    10-step run of 7.6-s steps spent 112 s tuning, measured nothing, and trained 85 s."""
    budget = plan.cfg.trainer.tune_budget_s
    if budget is not None:
        return float(budget)
    if not steps or base.steady_ms is None:
        return BUDGET_CAP_S
    run_s = steps * base.steady_ms / 1e3
    if plan.cfg.trainer.tune == "auto":
        return min(BUDGET_CAP_S, BUDGET_SHARE * run_s)
    return min(BUDGET_CAP_S, max(ON_LEAST_S, ON_SHARE * run_s))


class _CannotFit(Exception):
    """No candidate can be measured within the budget: the message says why."""


def _first_estimate(
    plan: RunPlan, device: torch.device, steps: Optional[int], started: float
) -> tuple[Row, float, float]:
    """The untuned settings once, untimed (two steps: the process's one-time work, then one
    step), so that what tuning would take is known before it is spent: (that row, the budget,
    what measuring one candidate is expected to take). `_CannotFit` where the untuned settings
    and one candidate together cannot be measured within what is left of the budget: said at
    once, rather than timing the defaults alone."""
    prime = measure(plan, {}, device, (1, 1))
    took = time.perf_counter() - started
    step_s = (prime.steady_ms or 0.0) / 1e3
    budget = _budget_s(plan, steps, prime)
    build_s = max(took - 2 * step_s - prime.warmup_s, 0.0)  # (a candidate's build)
    one = build_s + sum(step_counts(step_s)) * step_s
    left = budget - took
    if 2 * one > left:
        raise _CannotFit(
            f"a step takes ~{step_s:.2g} s here, so timing the untuned settings and one "
            f"candidate would take ~{2 * one:.0f} s, over the {max(left, 0.0):.0f} s left of "
            f"trainer.tune_budget_s ({budget:.0f} s); a larger trainer.tune_budget_s measures "
            "them"
        )
    return prime, budget, one


def _alternatives(
    plan: RunPlan, device: torch.device, free: Sequence[str], steps: Optional[int], base: Row
) -> list[tuple[dict[str, Any], float]]:
    """(settings to try, the compile seconds guessed for them) for each free setting."""
    from runner import csrc

    out: list[tuple[dict[str, Any], float]] = []
    model = plan.meta_model()
    convolutional = model is None or any(
        isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules()
    )
    if "trainer.channels_last" in free and convolutional:
        out.append(({"trainer.channels_last": True}, 0.0))
    if "trainer.cudnn_benchmark" in free and device.type == "cuda":
        out.append(({"trainer.cudnn_benchmark": False}, 0.0))
    if "precision.kernels" in free and csrc.load(device, "auto", wait=False) is not None:
        out.append(({"precision.kernels": "torch"}, 0.0))
    if "trainer.compile" in free and steps is not None and base.steady_ms is not None:
        guess = COMPILE_GUESS_S["cuda" if device.type == "cuda" else "cpu"]
        if steps * base.steady_ms / 1e3 * COMPILE_GAIN > guess:
            # the default compile first: its measured time is what max-autotune's is estimated
            # from (tried only where that estimate fits the budget and the run repays it)
            out.append(({"trainer.compile": True}, guess))
            graphs = OmegaConf.select(plan.cfg, "trainer.cuda_graphs", default=False)
            if "trainer.compile_mode" in free and device.type == "cuda" and not graphs:
                autotune = {"trainer.compile": True, "trainer.compile_mode": MAX_AUTOTUNE}
                out.append((autotune, guess))
    # the whole step replayed: last, instead of a compile (the other route to its graphs)
    graph = {**STEP_GRAPH, **({"trainer.compile": False} if "trainer.compile" in free else {})}
    if GRAPHS in free and device.type == "cuda" and not _graph_refusals(plan, device, graph):
        steps_s = (base.steady_ms or 0.0) / 1e3  # (its warm-up's and capture's extra steps)
        out.append((graph, (cuda_graphs.WARMUP_STEPS + 1) * steps_s))
    return out


def _graph_refusals(plan: RunPlan, device: torch.device, settings: Mapping[str, Any]) -> list:
    """Why planning would refuse `trainer.cuda_graphs` for the run with `settings` (a
    candidate's, on top of the fastest so far), as it refuses a run given them by hand; empty
    where they hold none (or no graph)."""
    if cuda_graphs.mode(settings.get(GRAPHS, False)) == cuda_graphs.OFF:
        return []
    cfg = with_values(plan.cfg, settings)
    return cuda_graphs.refusals(cfg, plan.properties, plan.task, device)


def _decision(
    plan: RunPlan,
    rows: list[Row],
    free: Sequence[str],
    given: set[str],
    steps: Optional[int],
    source: str,
) -> Tuning:
    """The chosen row's settings for the free keys, and why each tunable key has its value."""
    best = choose(rows, steps)
    settings = {k: best.settings.get(k, tree_value(plan.config_tree, k)) for k in free}
    speedup = rows[0].steady_ms / max(best.steady_ms, 1e-9) if best is not rows[0] else 1.0
    reasons: dict[str, str] = {}
    for key in TUNABLE:
        tried = [r for r in rows[1:] if key in r.settings]
        if key in given:
            reasons[key] = "kept: given"
        elif key not in free:
            reasons[key] = "not tuned: nothing to measure on this device"
        elif key in best.settings and best is not rows[0]:
            others = [f"{k}={override_text(v)}" for k, v in best.settings.items() if k != key]
            together = f" (together with {', '.join(others)})" if others else ""
            reasons[key] = f"tuned: {speedup:.2f}x the untuned steady step{together}"
        elif not tried:
            reasons[key] = not_tried(key, steps, rows[0], plan.device)
        elif any(r.note.startswith(NOT_CAPTURED) for r in tried):
            reasons[key] = "kept: the step cannot be captured in a CUDA graph here (refused)"
        elif any(r.note == OUT_OF_MEMORY for r in tried):
            reasons[key] = "kept: the other value ran out of memory (refused)"
        elif any(r.note.startswith("refused") for r in tried):
            reasons[key] = "kept: the other value changed the loss (refused)"
        elif any(not r.note for r in tried):
            reasons[key] = "kept: the default measured as fast or faster"
        elif all(r.note.endswith(REPAID) for r in tried):
            reasons[key] = "kept: the other value would not repay its compile time"
        else:
            reasons[key] = "kept: the other value was not measured (over the budget)"
    return Tuning(settings, reasons, rows, source, chosen=rows.index(best))
