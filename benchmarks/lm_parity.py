"""Language-model parity: does each precision level train gpt_tiny on real text as well as fp32,
and what does the runner's step cost against a nanoGPT-style hand-written loop?

Task. The runner's GPT at its smallest (`model=gpt_tiny`: 2 layers, 4 heads, width 64, all 13 of
its Linear layers fp8-able) trained on real text that every machine has without a download: the
Python files of the standard library's folder (`os.path.dirname(os.__file__)`, `**/*.py`, less
`site-packages/*`: the standard library's own sources, not what is installed beside them),
byte-level (vocabulary 256), tokenised once into a token cache in this benchmark's temporary
folder (or `--token-cache`), windows of 64 tokens, the last 1% of the token stream held out for
validation. AdamW (lr 0.003, weight decay 0.1, eps 1e-6: Adam's 1e-8 underflows in 16-bit state)
with a cosine schedule, batch 16, one epoch cut to 400 steps (`--steps`), validation on the first
50 batches of the held-out tail (`--val-batches`), on the CPU unless `--device` says otherwise.
The seeds (0, 1, 2) vary `trainer.seed` only (weight initialisation and data order): the corpus
and its validation tail are the same for every run, so the levels are compared on equal terms.
Every (level, seed) is a real `runner.run.app.run` logged to an MLflow store (a fresh SQLite
store in a temporary folder unless `--tracking-uri`), whose objective is the run's best
validation loss (nats per token).

Levels. CPU: o0, o1_bf16, o2_bf16, o3_bf16_sr, o1_fp8 (fp8 emulated: its numerics, not its
speed). CUDA adds o1, o2, o3_bf16 and o2_fp8. fp8 levels are skipped, with a note in the
results, when torchao is not installed (or the GPU has no fp8 Tensor Cores); o0, the baseline,
is always run.

Targets, on the mean best validation loss over the seeds (|difference|):
  o1_bf16, o2_bf16      within 0.02 nats of o0 (o1, o2 in fp16 on CUDA: the same 0.02, by
                        analogy; the targets name the bf16 presets)
  o3_bf16_sr            within 0.03 nats of o2_bf16 (the same bf16 model with fp32 masters)
  o1_fp8, o2_fp8        within 0.05 nats of o1_bf16, o2_bf16 (their level without fp8); every
                        fp8 run must convert all 13 Linear layers (`precision.fp8_layers`)
  o3_bf16 (and o3)      reported against o0, not checked
  optimizer state       `<preset>+<format>state` (precision.optimizer_state) and the presets with
                        int8 state (o2_bf16_int8state, o3_bf16_sr_int8state): bf16 and int8
                        state within 0.02 nats of the same level with its own state,
                        int4 and fp8 reported; the state's memory (mem_optimizer_state_mb) at
                        most 0.3x (int8) and 0.2x (int4) of fp32 state. Not in the default
                        levels (torchao's update is slow on a CPU); e.g.
                        --levels o0,o2_bf16,o2_bf16_int8state,o2_bf16+bf16state,o2_bf16+int4state

Overhead (`--overhead-rounds`, default 15; 0 skips it): overhead.py's machinery on the same
model, batch and optimizer settings (one batch of the synthetic language at vocabulary 256 held
in memory): the runner's `Trainer.train_step` against a hand-written nanoGPT-style loop from the
same initial weights, blocks interleaved, for o0, o1_bf16, o2_bf16 (CUDA: o0, o1, o2). Target:
runner / hand-written median step time <= 1.03 (O2: < 1, the runner faster).

    python -m benchmarks.lm_parity                  # CPU: 5 levels x 3 seeds, about 15 minutes
    python -m benchmarks.lm_parity --seeds 0 --steps 50 --levels o0,o2_bf16 --overhead-rounds 3
    python -m benchmarks.lm_parity --device cuda    # -> benchmarks/results/<gpu>/lm_parity_cuda.md

Writes a Markdown report (also printed), a CSV with one row per run and a JSON with everything
to benchmarks/results/<machine>/lm_parity_<device>.* (`--out`), after every run (a run stopped at
a time limit keeps what it finished). Exit status: 0 when every run finished, whatever the verdict
(a benchmark, not a test); 1 when a run or the overhead measurement crashed (the runner's
divergence stop is an outcome, not a crash); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.common import (
    check_presets,
    compose,
    csv_list,
    load_average,
    resolve_device,
    results_path,
    store_uri,
    write_results,
)
from benchmarks.harness import STATE_CHECKED, STATE_MEMORY_TARGETS

EXPERIMENT = "lm-parity"
MODEL = "gpt_tiny"
EXPECTED_FP8_LAYERS = 13  # gpt_tiny: 2 blocks x (q, k, v, proj, up, down) + the head
BASELINE = "o0"
# level -> (reference level, tolerance in nats on the mean best val loss); a level not here is
# reported against O0 and not checked (O3 without stochastic rounding)
TARGETS: dict[str, tuple[str, float]] = {
    "o1_bf16": ("o0", 0.02),
    "o2_bf16": ("o0", 0.02),
    "o1": ("o0", 0.02),  # fp16 on CUDA: by analogy with the bf16 presets
    "o2": ("o0", 0.02),
    "o3_bf16_sr": ("o2_bf16", 0.03),
    "o1_fp8": ("o1_bf16", 0.05),
    "o2_fp8": ("o2_bf16", 0.05),
}
# optimizer-state levels (`<preset>+<format>state`, the presets with int8 state): bf16 and int8
# state within this of the same level with its own state; int4 and fp8 state reported. The
# state's memory (mem_optimizer_state_mb) against fp32 state's is shown beside, with targets.
STATE_TOLERANCE = 0.02
CPU_LEVELS = ["o0", "o1_bf16", "o2_bf16", "o3_bf16_sr", "o1_fp8"]
CUDA_LEVELS = ["o0", "o1", "o2", "o1_bf16", "o2_bf16", "o3_bf16", "o3_bf16_sr", "o1_fp8", "o2_fp8"]
CPU_OVERHEAD_LEVELS = ["o0", "o1_bf16", "o2_bf16"]
CUDA_OVERHEAD_LEVELS = ["o0", "o1", "o2"]
DEFAULT_SEEDS = [0, 1, 2]
DEFAULT_STEPS = 400
DEFAULT_VAL_BATCHES = 50
DEFAULT_OVERHEAD_ROUNDS = 15
DEFAULT_GLOB = "**/*.py"
DEFAULT_EXCLUDE = ("site-packages/*",)  # the stdlib folder holds the base installation's packages
BLOCK_SIZE = 64
BATCH_SIZE = 16
VAL_FRACTION = 0.01  # of ~160 MB: over a million validation tokens, far more than 50 batches use
OPTIMIZER = [
    "optimizer=adamw",
    "optimizer.lr=0.003",
    "optimizer.weight_decay=0.1",
    "optimizer.eps=1e-6",
    "scheduler=cosine",
]


def stdlib_folder() -> str:
    """The Python standard library's folder: real text on every machine, no download."""
    return os.path.dirname(os.__file__)


@dataclass
class RunResult(harness.Run):
    OBJECTIVE = ("best_val_loss", "validation loss")  # nats per token: what app.run returns

    best_val_loss: float | None = None
    val_perplexity: float | None = None  # of the last epoch (one epoch: the best)
    val_token_acc: float | None = None
    tokens_per_s: float | None = None
    train_time_s: float | None = None
    skipped_steps: float | None = None
    fp8_layers: int | None = None  # fp8 runs: the precision.fp8_layers param
    state_mb: float | None = None  # mem_optimizer_state_mb: the optimizer state's stored MiB
    optimizer_state: str | None = None  # the precision.optimizer_state param (the state's format)
    train_windows: int | None = None  # the data.train_size / data.val_size params
    val_windows: int | None = None


@dataclass
class LevelSummary:
    level: str
    opt_level: str = ""
    dtype: str = ""
    fp8: str | None = None
    reference: str | None = None  # the level it is checked against (None: not checked)
    tolerance: float | None = None  # nats
    losses: dict[int, float | None] = field(default_factory=dict)  # per seed
    mean: float | None = None
    std: float | None = None
    perplexity: float | None = None  # exp(mean): the perplexity of the mean loss
    diff: float | None = None  # mean - the reference's mean (nats; positive: worse)
    within_target: bool | None = None  # None: not checked, or not judged
    diff_vs_o0: float | None = None
    mean_token_acc: float | None = None
    mean_tokens_per_s: float | None = None
    skipped_steps: float | None = None
    fp8_layers: list[int] = field(default_factory=list)  # per finished fp8 run
    statuses: list[str] = field(default_factory=list)
    # optimizer-state levels: the format, the mean state MiB, its ratio to fp32 state (with its
    # target, where the format has one) and to the level with its own state
    state_format: str | None = None
    state_reference: str | None = None
    state_mb: float | None = None
    state_type: str | None = None  # its runs' precision.optimizer_state
    state_memory_ratio: float | None = None  # of fp32 state (common.fp32_state_ratio)
    state_vs_reference: float | None = None
    reference_state_type: str | None = None
    within_memory_target: bool | None = None

    @property
    def checked(self) -> bool:
        return self.reference is not None


# ---- arguments ----------------------------------------------------------------------------------
def fp8_unavailable(device: str) -> str | None:
    """Why fp8 levels cannot run here (None when they can): torchao missing, or a GPU without
    fp8 Tensor Cores (compute capability 8.9 or newer)."""
    if importlib.util.find_spec("torchao") is None:
        return 'torchao is not installed (pip install "amp-runner[fp8]")'
    if device == "cuda":
        import torch

        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            return (
                f"the GPU (compute capability {major}.{minor}) has no fp8 Tensor Cores "
                "(8.9 or newer)"
            )
    return None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lm_parity",
        description="Language-model parity: each precision level's best validation loss on "
        "gpt_tiny trained on real text against fp32's, over several seeds, and the runner's "
        "training step against a hand-written loop; writes Markdown, CSV and JSON.",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda", "auto"],
        default="cpu",
        help="trainer.device (default cpu; auto: CUDA when available)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        help=f"training steps, trainer.limit_train_batches (default {DEFAULT_STEPS}; one epoch)",
    )
    parser.add_argument(
        "--val-batches",
        type=int,
        default=DEFAULT_VAL_BATCHES,
        help=f"validation batches, trainer.limit_val_batches (default {DEFAULT_VAL_BATCHES})",
    )
    parser.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="a folder (or file) of text: data.path (default: the Python "
        f"standard library's folder, {stdlib_folder()})",
    )
    parser.add_argument(
        "--glob",
        default=DEFAULT_GLOB,
        help=f"the corpus folder's files: data.glob (default {DEFAULT_GLOB})",
    )
    parser.add_argument(
        "--exclude",
        type=csv_list,
        default=list(DEFAULT_EXCLUDE),
        help="comma-separated patterns of the corpus folder's files to leave out: "
        f"data.exclude (default {','.join(DEFAULT_EXCLUDE)}: the standard "
        "library's own sources, not the packages installed beside them)",
    )
    parser.add_argument(
        "--token-cache",
        type=Path,
        default=None,
        help="data.cache_dir: where the tokenised corpus is cached (default: a "
        "folder in the benchmark's temporary folder, deleted at the end)",
    )
    parser.add_argument(
        "--overhead-rounds",
        type=int,
        default=DEFAULT_OVERHEAD_ROUNDS,
        help="interleaved rounds of the step-overhead measurement (default "
        f"{DEFAULT_OVERHEAD_ROUNDS}; 0 skips it)",
    )
    parser.add_argument(
        "--overhead-levels",
        type=csv_list,
        default=None,
        help=f"presets for the overhead (default: CPU "
        f"{','.join(CPU_OVERHEAD_LEVELS)}; CUDA {','.join(CUDA_OVERHEAD_LEVELS)})",
    )
    harness.add_options(
        parser,
        EXPERIMENT,
        "lm_parity",
        levels_help=f"comma-separated precision presets (default: CPU "
        f"{','.join(CPU_LEVELS)}; CUDA {','.join(CUDA_LEVELS)}); o0, the "
        "baseline, is added when missing; fp8 levels are skipped without torchao",
        fixed="the corpus and its validation tail",
        extra_help="more Hydra overrides for the "
        "parity runs, applied last (e.g. data.val_fraction=0.05)",
    )
    args = parser.parse_args(argv)

    for name in ("steps", "val_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.overhead_rounds < 0:
        parser.error("--overhead-rounds must be >= 0")
    args.seeds = harness.parse_seeds(parser, args.seeds, DEFAULT_SEEDS)
    args.device = resolve_device(parser, args.device)
    args.corpus = (args.corpus or Path(stdlib_folder())).expanduser().resolve()
    if not args.corpus.exists():
        parser.error(f"--corpus {args.corpus} does not exist")

    levels = args.levels or (CUDA_LEVELS if args.device == "cuda" else CPU_LEVELS)
    levels = harness.parse_levels(parser, levels, BASELINE, compiled=False)
    args.skipped = {}  # level -> why it was not run
    reason = fp8_unavailable(args.device) if any("fp8" in lvl for lvl in levels) else None
    if reason:
        args.skipped = {lvl: reason for lvl in levels if "fp8" in lvl}
    args.levels = [lvl for lvl in levels if lvl not in args.skipped]

    overhead_levels = args.overhead_levels or (
        CUDA_OVERHEAD_LEVELS if args.device == "cuda" else CPU_OVERHEAD_LEVELS
    )
    check_presets(parser, overhead_levels)
    bad = [lvl for lvl in overhead_levels if lvl.startswith("o3") or "fp8" in lvl]
    if bad:
        parser.error(
            f"--overhead-levels {', '.join(bad)}: no hand-written counterpart (O3 and "
            "fp8 have none); choose O0, O1 or O2 presets"
        )
    args.overhead_levels = list(dict.fromkeys(overhead_levels))
    if args.out is None:
        args.out = results_path(f"lm_parity_{args.device}.md", args.device)
    return args


# ---- the task -----------------------------------------------------------------------------------
def _quoted(value: str) -> str:
    """A Hydra override value in single quotes (globs and paths hold `*`, `:` and the like)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def task_overrides(args: argparse.Namespace) -> list[str]:
    """The parity runs' task (before `precision=<level> trainer.seed=<seed>`)."""
    return [
        f"model={MODEL}",
        "data=text",
        f"data.path={_quoted(str(args.corpus))}",
        f"data.glob={_quoted(args.glob)}",
        "data.exclude=[" + ",".join(_quoted(e) for e in args.exclude) + "]",
        f"data.block_size={BLOCK_SIZE}",
        f"data.val_fraction={VAL_FRACTION}",
        f"data.cache_dir={_quoted(str(args.token_cache))}",
        *OPTIMIZER,
        f"trainer.batch_size={BATCH_SIZE}",
        "trainer.max_epochs=1",
        f"trainer.limit_train_batches={args.steps}",
        f"trainer.limit_val_batches={args.val_batches}",
        "trainer.num_workers=0",
        "trainer.progress_bar=false",
        "trainer.log_every_n_steps=50",
        "trainer.checkpoint_every_n_epochs=0",  # no checkpoint files (only an interrupt writes one)
        f"trainer.device={args.device}",
        *args.extra,
    ]


def describe_corpus(cfg: Any) -> dict:
    """Tokenise the corpus into the cache once, before the runs (so that no run's time includes
    it), and describe it from the data itself: files, bytes, tokens, and the train/validation
    split in tokens and in windows (a run's `data.train_size`/`data.val_size` params count
    windows). Raises the runner's ConfigError where the corpus is unusable."""
    from runner.components import text

    root, files = text.corpus_files(cfg.data)
    started = time.perf_counter()
    bin_path, meta = text.tokenised_corpus(cfg.data)
    tokenise_s = time.perf_counter() - started
    bundle = text.build_text(cfg.data)
    return {
        "root": root,
        "glob": str(cfg.data.glob),
        "exclude": [str(e) for e in cfg.data.exclude],
        "files": len(files),
        "bytes": sum(os.path.getsize(path) for _, path in files),
        "tokenizer": "bytes" if meta["tokenizer"] == "bytes" else str(meta["tokenizer"]),
        "vocab_size": int(meta["vocab_size"]),
        "tokens": int(meta["num_tokens"]),
        "train_tokens": int(bundle.train.length),
        "val_tokens": int(bundle.val.length),
        "train_windows": len(bundle.train),
        "val_windows": len(bundle.val),
        "block_size": int(cfg.data.block_size),
        "val_fraction": float(cfg.data.val_fraction),
        "sha256": meta["sha256"],
        "cache_file": bin_path,
        "tokenise_s": tokenise_s,
        # installed packages under the folder (the stdlib's site-packages): the corpus then
        # differs between machines, so compare results only with the same token stream SHA-256
        "site_packages_files": sum(1 for rel, _ in files if "site-packages/" in f"/{rel}"),
        "first_file": files[0][0],
        "last_file": files[-1][0],
    }


# ---- running ------------------------------------------------------------------------------------
def target_of(level: str) -> tuple[str | None, float | None, str | None, str | None]:
    """(reference, tolerance, state format, state reference) of a level: TARGETS' entry; an
    optimizer-state level is checked against its level with its own state where its format is
    bf16 or int8 (within STATE_TOLERANCE), else reported against o0."""
    state_ref, fmt = harness.state_reference(level)
    reference, tolerance = TARGETS.get(level, (None, None))
    if fmt in STATE_CHECKED and reference is None:
        reference, tolerance = state_ref, STATE_TOLERANCE
    return reference, tolerance, fmt, state_ref


def run_name(level: str, seed: int) -> str:
    return f"{MODEL}-{level.replace('+', '-')}-seed{seed}"


def run_one(args: argparse.Namespace, level: str, seed: int) -> RunResult:
    """One real run of `level` at `seed`, then its metrics and params read back from the store."""
    result = RunResult(level, seed)
    stored = harness.train(args, result, task_overrides(args), run_name(level, seed))
    for name in (
        "val_perplexity",
        "val_token_acc",
        "tokens_per_s",
        "train_time_s",
        "skipped_steps",
    ):
        setattr(result, name, stored.metrics.get(name))
    params = stored.params
    if "precision.fp8_layers" in params:
        result.fp8_layers = int(params["precision.fp8_layers"])
    result.state_mb = stored.metrics.get("mem_optimizer_state_mb")
    result.optimizer_state = params.get("precision.optimizer_state")
    if "data.train_size" in params:
        result.train_windows = int(params["data.train_size"])
        result.val_windows = int(params["data.val_size"])
    return result


# ---- summary ------------------------------------------------------------------------------------
def summarise(
    results: Sequence[RunResult], levels: Sequence[str], seeds: Sequence[int]
) -> list[LevelSummary]:
    """Per level: the losses per seed, mean ± std (only where every seed finished), the
    perplexity of the mean, and the difference to its reference level against its target."""
    rows: list[LevelSummary] = []
    for level in levels:
        mine = [r for r in results if r.level == level]
        first = mine[0] if mine else RunResult(level, 0)
        reference, tolerance, fmt, state_ref = target_of(level)
        row = LevelSummary(
            level=level,
            opt_level=first.opt_level,
            dtype=first.dtype,
            fp8=first.fp8,
            reference=reference,
            tolerance=tolerance,
            state_format=fmt,
            state_reference=state_ref,
            state_mb=harness.mean(r.state_mb for r in mine),
            state_type=next((r.optimizer_state for r in mine if r.optimizer_state), None),
            losses=harness.by_seed(mine, "best_val_loss"),
            mean_token_acc=harness.mean(r.val_token_acc for r in mine if r.status == "finished"),
            mean_tokens_per_s=harness.mean(r.tokens_per_s for r in mine if r.status == "finished"),
            fp8_layers=[r.fp8_layers for r in mine if r.fp8_layers is not None],
            statuses=[r.status for r in mine],
        )
        row.mean, row.std = harness.seed_stats(row.losses, seeds)
        if row.mean is not None:
            row.perplexity = math.exp(row.mean) if row.mean < 700 else math.inf
        skipped = harness.finite(r.skipped_steps for r in mine)
        row.skipped_steps = sum(skipped) if skipped else None
        rows.append(row)
    means = {r.level: r.mean for r in rows}
    by_level = {r.level: r for r in rows}
    for row in rows:
        harness.compare_state(row, by_level.get(row.state_reference or ""))
        if row.mean is not None and means.get(BASELINE) is not None:
            row.diff_vs_o0 = row.mean - means[BASELINE]
        if row.checked and row.mean is not None and means.get(row.reference) is not None:
            row.diff = row.mean - means[row.reference]
            # a hair of slack: a difference printed as 0.020 must not fail a 0.02 target
            row.within_target = abs(row.diff) <= row.tolerance + 1e-12
    return rows


def fp8_layer_problems(rows: Sequence[LevelSummary]) -> list[str]:
    """fp8 rows whose runs did not convert every Linear layer of gpt_tiny (or did not say)."""
    problems = []
    for row in rows:
        if not row.fp8 or not any(s == "finished" for s in row.statuses):
            continue
        counts = sorted(set(row.fp8_layers))
        if counts != [EXPECTED_FP8_LAYERS]:
            problems.append(f"{row.level} {'/'.join(map(str, counts)) or 'unknown'}")
    return problems


def verdict(rows: Sequence[LevelSummary], skipped: dict[str, str] | None = None) -> str:
    """One line: PASS when every checked level was judged and is within its target (and every
    fp8 run converted all 13 Linear layers), MISS when one is outside it, INCOMPLETE when a
    checked level could not be judged (a run did not finish, or its reference was not run)."""
    base = next((r for r in rows if r.level == BASELINE), None)
    if base is None or base.mean is None:
        return "Verdict: NO BASELINE: o0 did not finish every seed, nothing can be compared."
    present = {r.level for r in rows}

    def fmt(r: LevelSummary) -> str:
        return f"{r.level} {r.diff:+.4f} vs {r.reference} (target {r.tolerance:g})"

    checked = [r for r in rows if r.checked]
    judged = [r for r in checked if r.within_target is not None]
    missed = [r for r in judged if not r.within_target]
    unjudged = [r for r in checked if r.within_target is None]
    fp8_problems = fp8_layer_problems(rows)
    memory_misses = [r for r in rows if r.within_memory_target is False]
    if missed or fp8_problems or memory_misses:
        head = "MISS"
    elif unjudged or not checked:
        head = "INCOMPLETE"
    else:
        head = "PASS"
    parts = []
    if not checked:
        parts.append("no checked level was run")
    if missed:
        parts.append("outside the target: " + ", ".join(fmt(r) for r in missed) + " nats")
    met = [r for r in judged if r.within_target]
    if met:
        parts.append(
            ("every checked level within its target: " if head == "PASS" else "within the target: ")
            + ", ".join(fmt(r) for r in met)
            + " nats"
        )
    for r in unjudged:
        why = f"{r.reference} was not run" if r.reference not in present else "a run did not finish"
        parts.append(f"{r.level} NOT JUDGED ({why})")
    if any(r.fp8 for r in rows):
        parts.append(
            f"fp8 layers: UNEXPECTED {', '.join(fp8_problems)} (expected {EXPECTED_FP8_LAYERS})"
            if fp8_problems
            else f"fp8 layers: {EXPECTED_FP8_LAYERS} in every fp8 run, as expected"
        )
    states = [r for r in rows if r.state_memory_ratio is not None]
    if states:
        parts.append("optimizer state memory: " + ", ".join(_state_memory(r) for r in states))
    reported = [r for r in rows if not r.checked and r.level != BASELINE]
    if reported:
        parts.append(
            "reported, not checked: "
            + ", ".join(
                f"{r.level} "
                + ("(no result)" if r.diff_vs_o0 is None else f"{r.diff_vs_o0:+.4f} vs o0")
                for r in reported
            )
        )
    for level, why in (skipped or {}).items():
        parts.append(f"{level} skipped ({why})")
    return (
        f"Verdict: {head}: " + "; ".join(parts) + f" (o0: {base.mean:.4f} nats per token, "
        f"perplexity {base.perplexity:.3f})."
    )


def _state_memory(r: LevelSummary) -> str:
    """`o2_bf16_int8state 0.27x of fp32 state (target <= 0.3: yes)`, and the ratio to its
    level's own state where that is not fp32."""
    text = f"{r.level} {r.state_memory_ratio:.2f}x of fp32 state"
    if r.within_memory_target is not None:
        text += (
            f" (target <= {STATE_MEMORY_TARGETS[r.state_format]:g}: "
            f"{'yes' if r.within_memory_target else 'NO'})"
        )
    if r.reference_state_type not in (None, "float32"):
        text += f", {r.state_vs_reference:.2f}x of {r.state_reference}'s {r.reference_state_type}"
    return text


# ---- the overhead -------------------------------------------------------------------------------
def overhead_argv(args: argparse.Namespace, cfg: Any) -> list[str]:
    """overhead.py's arguments for the parity task's step: gpt_tiny on one batch of `batch` x
    `block_size` tokens of the synthetic language at the corpus's vocabulary (256: the same
    head), with the same optimizer and schedule on both sides."""
    return [
        "--device",
        args.device,
        "--model",
        MODEL,
        "--image-size",
        str(int(cfg.data.block_size)),  # a language model's: the sequence length
        "--batch-size",
        str(int(cfg.trainer.batch_size)),
        "--rounds",
        str(args.overhead_rounds),
        "--levels",
        ",".join(args.overhead_levels),
        "--extra",
        *OPTIMIZER,
        "data.vocab_size=256",
    ]


def measure_overhead(args: argparse.Namespace, cfg: Any) -> dict:
    """overhead.py's `Level`s built, warmed up and stepped in interleaved rounds, exactly as
    overhead.py's main does; returns its results, settings and verdict."""
    from benchmarks import overhead

    oargs = overhead.parse_args(overhead_argv(args, cfg))
    load_start = load_average()
    started = time.perf_counter()
    levels = overhead.measure(oargs, prefix="overhead: ")
    results = [lv.result() for lv in levels]
    report = {
        "argv": overhead_argv(args, cfg),
        "task": {
            "model": MODEL,
            "sequence_length": oargs.image_size,
            "batch_size": oargs.batch_size,
            "vocab_size": 256,
        },
        "rounds": oargs.rounds,
        "block": oargs.block,
        "warmup": oargs.warmup,
        "dynamic_levels": [lv.level for lv in levels if lv.dynamic],
        "overrides": overhead.task_overrides(oargs, "<level>"),
        "results": results,
        "load_start": load_start,
        "load_end": load_average(),
        "wall_s": time.perf_counter() - started,
    }
    report["verdict"] = overhead.ratio_verdict(results)
    return report


def overhead_lines(report: dict | None, rounds: int) -> list[str]:
    if rounds == 0:
        return ["## Step overhead", "", "Skipped (`--overhead-rounds 0`).", ""]
    if report is None:
        return ["## Step overhead", "", "Not measured yet (it runs after the parity runs).", ""]
    if "error" in report:
        return ["## Step overhead", "", f"**Crashed**: {report['error']}", ""]
    from benchmarks import overhead

    t = report["task"]
    lines = [
        "## Step overhead",
        "",
        f"The runner's `Trainer.train_step` against a hand-written nanoGPT-style loop (logits "
        f"`(B, T, V)` flattened against the next tokens, the same AdamW and cosine schedule, "
        f"the same initial weights) on one batch of {t['batch_size']} x {t['sequence_length']} "
        f"tokens of the synthetic language at vocabulary {t['vocab_size']} held in memory "
        f"(overhead.py's machinery). {report['rounds']} interleaved round(s) of one "
        f"{report['block']}-step block per side and level (the order flips every round), after "
        f"{report['warmup']} warm-up steps per side; times per step, medians over the blocks; "
        "ratio = runner / hand-written. Load average "
        f"{report['load_start']} at start, {report['load_end']} at end.",
        "",
        *overhead.table_lines(report, ms=".2f"),
    ]
    lines += ["", f"Overhead verdict: {report['verdict']}", ""]
    return lines


# ---- report -------------------------------------------------------------------------------------
def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def corpus_lines(corpus: dict | None) -> list[str]:
    if not corpus:
        return []
    c = corpus
    return [
        "## Corpus",
        "",
        f"- `{c['root']}`, files `{c['glob']}`"
        + (f" less `{', '.join(c['exclude'])}`" if c.get("exclude") else "")
        + f": {c['files']:,} files ({c['first_file']} ... "
        f"{c['last_file']}, in this order in the token stream), {c['bytes'] / 1e6:.1f} MB"
        + (
            f"; {c['site_packages_files']:,} of the files are installed packages (under "
            "site-packages), so the corpus differs between machines: compare results only "
            "where the token stream's SHA-256 is the same"
            if c.get("site_packages_files")
            else ""
        ),
        f"- Tokens ({c['tokenizer']}, vocabulary {c['vocab_size']}): {c['tokens']:,} in all; "
        f"train {c['train_tokens']:,} ({c['train_windows']:,} windows of {c['block_size']}), "
        f"validation (the last {c['val_fraction']:g}) {c['val_tokens']:,} "
        f"({c['val_windows']:,} windows)",
        f"- Token stream SHA-256 `{c['sha256'][:16]}...`; tokenised in {c['tokenise_s']:.1f} s "
        "before the runs (each run reads the cache)",
        "",
    ]


def render_markdown(report: dict, rows: Sequence[LevelSummary]) -> str:
    seeds = report["seeds"]
    steps, val_batches = report["steps"], report["val_batches"]
    batch, block = report["batch_size"], report["block_size"]
    seen = steps * batch * block
    lines = [
        f"# Language-model parity ({report['device']})",
        "",
        f"Does each precision level train `{MODEL}` on real text as well as fp32? Best "
        f"validation loss (nats per token) after {steps} steps of {batch} x {block} "
        f"tokens ({seen:,} training tokens), validated on the first {val_batches} batches of "
        "the corpus's held-out tail, per seed (`trainer.seed`: initialisation and data order; "
        "the corpus is fixed). A checked level passes when its mean is within its tolerance of "
        "its reference level's mean: the bf16 (and fp16) O1/O2 presets within 0.02 of o0, "
        "`o3_bf16_sr` within 0.03 of `o2_bf16`, fp8 within 0.05 of the same level without fp8. "
        "Δ is the level's mean minus its reference's (positive: worse).",
        "",
        "| level | preset | dtype | "
        + " | ".join(f"seed {s}" for s in seeds)
        + " | mean ± std | perplexity of the mean | reference | Δ (nats) | target | meets "
        "| Δ vs o0 | token acc | tokens/s | skipped steps | fp8 layers |",
        "|---|---|---|"
        + "---:|" * len(seeds)
        + "---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = harness.seed_cells(r.losses, r.level, report, lambda v: f"{v:.4f}")
        mean = "-" if r.mean is None else f"{r.mean:.4f} ± {r.std or 0:.4f}"
        if r.level == BASELINE:
            reference, target, meets = "-", "-", "baseline"
        elif not r.checked:
            reference, target, meets = "o0", "-", "not checked"
        else:
            reference, target = f"`{r.reference}`", f"±{r.tolerance:g}"
            meets = (
                "not judged" if r.within_target is None else "yes" if r.within_target else "**no**"
            )
        if r.state_memory_ratio is not None:
            meets += f"; state {r.state_memory_ratio:.2f}x of fp32" + (
                ""
                if r.within_memory_target is None
                else f" (<= {STATE_MEMORY_TARGETS[r.state_format]:g}: "
                f"{'yes' if r.within_memory_target else '**no**'})"
            )
        diff = r.diff if r.checked else r.diff_vs_o0 if r.level != BASELINE else None
        fp8 = "-" if not r.fp8 else (" / ".join(str(n) for n in dict.fromkeys(r.fp8_layers)) or "?")
        lines.append(
            f"| {r.opt_level or '?'} | `{r.level}` | {r.dtype or '?'} | "
            + " | ".join(cells)
            + f" | {mean} | {_num(r.perplexity, '.3f')} | {reference} | {_num(diff, '+.4f')} | "
            f"{target} | {meets} | {'-' if r.level == BASELINE else _num(r.diff_vs_o0, '+.4f')} | "
            f"{_num(None if r.mean_token_acc is None else 100 * r.mean_token_acc, '.2f')}% | "
            f"{_num(r.mean_tokens_per_s, ',.0f')} | {_num(r.skipped_steps, 'g')} | {fp8} |"
        )
    lines += ["", verdict(rows, report["skipped"]), ""]
    notes = []
    if any(r.fp8 for r in rows):
        notes.append(
            f"fp8 layers: the runs' `precision.fp8_layers` param, the Linear layers "
            f"whose GEMMs ran in fp8; `{MODEL}` has {EXPECTED_FP8_LAYERS} (q, k, v, "
            "proj, up, down in each of 2 blocks, and the head), all fp8-able."
            + (
                " On a CPU fp8 is emulated (torchao): its numerics, not its speed."
                if report["device"] == "cpu"
                else ""
            )
        )
    for level, why in report["skipped"].items():
        notes.append(f"`{level}` was not run: {why}.")
    notes.append(
        "Perplexity of the mean: exp(mean best validation loss). token acc: the mean "
        "`val_token_acc` (next byte predicted right). tokens/s: the mean steady training "
        "throughput (`tokens_per_s`: the steps after the warm-up), which depends on the "
        "machine and its load."
    )
    for note in notes:
        lines += [note, ""]
    lines += corpus_lines(report.get("corpus"))
    lines += overhead_lines(report.get("overhead"), report["overhead_rounds"])
    lines += [
        "## Setup",
        "",
        *harness.setup_lines(report),
        f"- Load average (1, 5, 15 min): {report['load_start']} at start, "
        f"{report.get('load_end', '-')} at end",
        f"- Versions: {report['versions']}",
        "- Task (Hydra overrides, then `precision=<level> trainer.seed=<seed>`): "
        + " ".join(f"`{o}`" for o in report["overrides"]),
        "",
    ]
    lines += harness.unfinished_lines(report["_results"])
    return "\n".join(lines)


CSV_FIELDS = [
    "level",
    "opt_level",
    "dtype",
    "seed",
    "status",
    "best_val_loss",
    "val_perplexity",
    "val_token_acc",
    "tokens_per_s",
    "train_time_s",
    "skipped_steps",
    "fp8_layers",
    "state_mb",
    "train_windows",
    "val_windows",
    "wall_s",
    "run_id",
    "error",
]


def write_outputs(out: Path, report: dict, rows: Sequence[LevelSummary]) -> list[Path]:
    payload = {k: v for k, v in report.items() if not k.startswith("_")}
    payload["summary"] = [{**asdict(r), "checked": r.checked} for r in rows]
    payload["verdict"] = verdict(rows, report["skipped"])
    return write_results(
        out,
        render_markdown(report, rows),
        [asdict(r) for r in report["_results"]],
        CSV_FIELDS,
        payload,
    )


def versions() -> str:
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return ", ".join(
        f"{name} {version(dist)}"
        for name, dist in (
            ("amp-runner", "amp-runner"),
            ("MLflow", "mlflow"),
            ("Hydra", "hydra-core"),
            ("torchao", "torchao"),
            ("numpy", "numpy"),
        )
    )


# ---- entry point --------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # the benchmark's temporary folder: the MLflow store and the token cache, unless given
    own_cache = args.token_cache is None
    folder = (
        Path(tempfile.mkdtemp(prefix="lm-parity-"))
        if own_cache or args.tracking_uri is None
        else None
    )
    if own_cache:
        args.token_cache = folder / "tokens"
    args.token_cache = args.token_cache.expanduser().resolve()
    if args.tracking_uri is None:
        args.tracking_uri = f"sqlite:///{folder / 'mlflow.db'}"
    args.tracking_uri = store_uri(args.tracking_uri, "lm-parity-")
    try:
        return _main(argv, args)
    finally:
        if own_cache:  # hundreds of MB for the stdlib; the MLflow store stays
            shutil.rmtree(args.token_cache, ignore_errors=True)
            if folder is not None and not any(folder.iterdir()):
                folder.rmdir()


def _main(argv: list[str], args: argparse.Namespace) -> int:
    from runner.errors import ConfigError

    load_start = load_average()
    started = time.perf_counter()
    cfg = compose(task_overrides(args))
    print(
        f"Language-model parity: {len(args.levels)} levels x {len(args.seeds)} seeds on "
        f"{args.device}, {args.steps} steps each; corpus {args.corpus} ({args.glob}); MLflow "
        f"store {args.tracking_uri}",
        flush=True,
    )
    for level, why in args.skipped.items():
        print(f"skipping {level}: {why}", flush=True)
    try:
        corpus = describe_corpus(cfg)
    except ConfigError as error:  # an unusable corpus, glob or cache folder: bad arguments
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        f"corpus: {corpus['files']} files, {corpus['tokens']:,} tokens (train "
        f"{corpus['train_tokens']:,}, validation {corpus['val_tokens']:,}); tokenised in "
        f"{corpus['tokenise_s']:.1f} s",
        flush=True,
    )
    harness.open_store(args, "lm-parity-")
    report = {
        "benchmark": EXPERIMENT,
        "device": args.device,
        "model": MODEL,
        "levels": args.levels,
        "skipped": args.skipped,
        "seeds": args.seeds,
        "steps": args.steps,
        "val_batches": args.val_batches,
        "batch_size": int(cfg.trainer.batch_size),  # the task's (after --extra)
        "block_size": int(cfg.data.block_size),
        "targets": {
            lvl: {"reference": ref, "tolerance_nats": tol} for lvl, (ref, tol) in TARGETS.items()
        },
        "expected_fp8_layers": EXPECTED_FP8_LAYERS,
        "corpus": corpus,
        "overrides": task_overrides(args),
        "overhead_rounds": args.overhead_rounds,
        "overhead": None,
        "load_start": load_start,
        "versions": versions(),
        **harness.report_fields("lm_parity", argv, args),
    }

    def save() -> list[Path]:
        report["total_wall_s"] = time.perf_counter() - started
        report["load_end"] = load_average()
        return write_outputs(args.out, report, summarise(results, args.levels, args.seeds))

    def said(result: RunResult) -> str:
        return (
            f"{result.status}: best val loss {_num(result.best_val_loss, '.4f')}, "
            f"{_num(result.tokens_per_s, ',.0f')} tokens/s, {result.wall_s:.0f} s"
        )

    results = report["_results"]
    harness.run_all(args, report, lambda level, seed: run_one(args, level, seed), said, save)
    status = 0
    if args.overhead_rounds:
        try:
            report["overhead"] = measure_overhead(args, cfg)
        except Exception as error:  # noqa: BLE001  (reported, and the exit status says so)
            traceback.print_exc()
            report["overhead"] = {"error": f"{type(error).__name__}: {error}"}
            status = 1
    text = render_markdown(report, summarise(results, args.levels, args.seeds))
    return max(status, harness.finish(text, save(), results))


if __name__ == "__main__":
    sys.exit(main())
