"""The runner beside its peers: the same model, data, optimizer and initial weights trained by
PyTorch Lightning's precision plugins and by a hand-written autocast + GradScaler loop, each
against the runner level that does the same work, timed interleaved in one process.

    peer                       runner level   what both do
    lightning:16-mixed         o1             fp32 weights, fp16 autocast, dynamic loss scaling
    lightning:bf16-mixed       o1_bf16        fp32 weights, bf16 autocast, no scaler
    lightning:bf16-true        o3_bf16        the whole model in bf16 (BatchNorm too), no masters
    hand:o1 / hand:o1_bf16     o1 / o1_bf16   overhead.py's stock torch.autocast (+ GradScaler)
    titan:float8               o1_fp8 with    torchtitan's float8 recipe: fp32 weights, bf16
                               fp8_linear=    autocast, torchao's rowwise fp8 Linear layers,
                               rowwise        each transformer block compiled (runner: the model)

The runner's side is its real step (`Trainer.train_step` over the objects a run builds:
common.build_runner). Lightning's side is a `lightning.Trainer` fitting a LightningModule that
wraps the runner's freshly initialised model in fp32 (`common.fp32_model`: same device, memory
format and weights) with the optimizer and scheduler the runner's `build_optimizer` and
`build_scheduler` make from the same config, over a DataLoader that hands it the runner's batch,
already on the device.
A Lightning step is timed from its `on_train_batch_start` to its `on_train_batch_end` hook, the
device synchronised at both (its training_step, backward, scaler and optimizer step, zero_grad:
what the runner's train_step does); the runner's and the hand loop's steps are synchronised the
same way. Blocks of `--steps` steps (after `--warmup` untimed ones; each Lightning block is one
`fit`) alternate between the runner and the peer, the order flipping every round, so drift hits
both alike; a side's figure is the median of its blocks' median step times.

    python -m benchmarks.peers --device cuda            # ResNet-50, 224 px, batch 128
    python -m benchmarks.peers                          # CPU: ResNet-18, 32 px, bf16 peers only
    python -m benchmarks.peers --device cuda --model torchvision:vit_b_16 --peers
    lightning:bf16-mixed
    python -m benchmarks.peers --device cuda --model gpt2_small --image-size 1024 --batch-size 8 \
        --extra model.vocab_size=50304 --peers titan:float8,hand:o1_bf16

torchtitan's float8 recipe is applied here as torchtitan 0.3 applies it on one GPU, with torchao
directly: torchtitan's own converter rewrites its model *configs* (its `Linear.Config`), not an
`nn.Module`, so it cannot take the runner's GPT. What it does, done the same way: torchao's
`Float8LinearConfig.from_recipe_name("rowwise")` (its `Float8LinearConverter`'s default recipe),
every Linear layer whose sizes are multiples of 16 converted (its default `filter_fqns` is empty;
its 405B config adds `lm_head`, our `head`: `--titan-filter head`, by module name here, by a
part of the name there), inductor's `emulate_precision_casts` on (it sets that for rowwise,
process-wide; here the compiled blocks' option, as the runner gives it to its compiled model),
each transformer block compiled `fullgraph=True` (its `apply_compile`), and on a single GPU
without FSDP its training step under `torch.autocast(bfloat16)` with fp32 weights; the step
itself is overhead.py's hand-written autocast loop. Its runner level is o1_fp8 with
`precision.fp8_linear=rowwise` and `trainer.compile=true`. On a CPU (fp8 emulated, which
torchtitan does not compile) neither side is compiled unless `--titan-compile` says so: a check
that both train the same thing (and, compiled, that the GPU's code path runs).

Target: the runner at least as fast as each peer (throughput runner / peer >= 1.0) on
the GPU. On a CPU the table is printed with no verdict (fp16 is emulated there; bf16 peers only).
Exit 0 whatever the verdict; 1 if a side crashed; 2 for bad arguments or Lightning missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence

from benchmarks.common import (
    add_device_option,
    add_extra_option,
    add_out_option,
    add_threads_option,
    apply_threads,
    build_runner,
    check_at_least_one,
    compose,
    csv_list,
    fill_defaults,
    fp32_model,
    interleaved_medians,
    is_language_model,
    load_average,
    model_label,
    one_batch_task,
    provenance,
    resolve_device,
    results_path,
    show,
    write_results,
)
from benchmarks.overhead import handwritten_step, timed_block

# peer -> the runner level doing the same work
PAIRS = {
    "lightning:16-mixed": "o1",
    "lightning:bf16-mixed": "o1_bf16",
    "lightning:bf16-true": "o3_bf16",
    "hand:o1": "o1",
    "hand:o1_bf16": "o1_bf16",
    "titan:float8": "o1_fp8",
}
TITAN_RECIPE = "rowwise"  # torchtitan's Float8LinearConverter.Config.recipe_name default
CUDA_PEERS = ["lightning:16-mixed", "lightning:bf16-mixed", "lightning:bf16-true", "hand:o1"]
CPU_PEERS = ["lightning:bf16-mixed", "lightning:bf16-true", "hand:o1_bf16"]
DEFAULTS = {
    "cuda": {
        "model": "resnet50",
        "image_size": 224,
        "batch_size": 128,
        "steps": 20,
        "warmup": 5,
        "rounds": 2,
    },
    "cpu": {
        "model": "resnet18",
        "image_size": 32,
        "batch_size": 32,
        "steps": 2,
        "warmup": 1,
        "rounds": 2,
    },
}
TARGET = 1.0  # runner throughput / peer throughput, at least
FIELDS = [
    "peer",
    "level",
    "status",
    "runner_ms",
    "peer_ms",
    "ratio",
    "meets",
    "runner_loss",
    "peer_loss",
    "picked",
    "tune_s",
    "error",
]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.peers",
        description="The runner's training step against Lightning's precision plugins and a "
        "hand-written autocast loop on the same model, data and weights; Markdown, CSV, JSON.",
    )
    add_device_option(p)
    p.add_argument(
        "--model",
        default=None,
        help="a model option or <zoo>:<arch> (default resnet50 on CUDA, resnet18 on CPU)",
    )
    p.add_argument(
        "--peers",
        type=csv_list,
        default=None,
        help=f"from {', '.join(PAIRS)} (default: {', '.join(CUDA_PEERS)} on CUDA; "
        f"{', '.join(CPU_PEERS)} on CPU)",
    )
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps a block")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before each block")
    p.add_argument("--rounds", type=int, default=None, help="timed blocks a side")
    add_extra_option(p, "more Hydra overrides for both sides' config (e.g. optimizer=adamw)")
    p.add_argument(
        "--titan-filter",
        type=csv_list,
        default=[],
        metavar="NAMES",
        help="titan:float8: Linear layers kept out of fp8 on both sides, by their "
        "module names (e.g. head, as torchtitan's 405B config keeps its lm_head); "
        "default none, torchtitan's default",
    )
    p.add_argument(
        "--titan-compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="titan:float8: compile both sides (each transformer block; the runner's "
        "model); default on CUDA only (on a CPU fp8 is emulated, which torchtitan "
        "does not compile, but it runs: a check of the GPU's code path)",
    )
    p.add_argument(
        "--tuned",
        action="store_true",
        help="the runner at its defaults with trainer.tune=on (it picks channels_last, the "
        "kernels, compile, ... by measuring them) against the peer at its defaults (a "
        "contiguous model and batch); the table names what was picked",
    )
    p.add_argument(
        "--run-steps",
        type=int,
        default=2000,
        help="--tuned: the training steps of the run the benchmark stands for (what repays "
        "tuning and compiling; default 2000)",
    )
    p.add_argument(
        "--tune-budget-s",
        type=float,
        default=None,
        help="--tuned: trainer.tune_budget_s, the seconds tuning may take for each peer's "
        "level (default the runner's: 120 s under trainer.tune=on); a candidate that would "
        "not fit is skipped",
    )
    add_out_option(
        p,
        "peers",
        default="benchmarks/results/<machine>/peers_<device>.md, with --tuned "
        "peers_tuned_<device>.md",
    )
    add_threads_option(p)
    args = p.parse_args(argv)
    apply_threads(p, args)
    args.device = resolve_device(p, args.device)
    fill_defaults(args, DEFAULTS[args.device])
    check_at_least_one(p, args, ("image_size", "batch_size", "steps", "rounds"))
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    args.peers = list(
        dict.fromkeys(args.peers or (CUDA_PEERS if args.device == "cuda" else CPU_PEERS))
    )
    unknown = [peer for peer in args.peers if peer not in PAIRS]
    if unknown:
        p.error(f"unknown peer {unknown[0]!r}: choose from {', '.join(PAIRS)}")
    if any(peer.startswith("lightning:") for peer in args.peers):
        try:
            import lightning  # noqa: F401
        except ImportError:
            print(
                "peers.py: the Lightning peers need the `lightning` package "
                "(pip install lightning), or name only hand:* peers",
                file=sys.stderr,
            )
            sys.exit(2)
    if "titan:float8" in args.peers:
        if not is_language_model(args.model):
            p.error(
                f"titan:float8 trains a language model (torchtitan compiles its transformer "
                f"blocks), not {args.model!r}: --model gpt2_small (or gpt_tiny, gpt)"
            )
        if importlib.util.find_spec("torchao") is None:
            print(
                'peers.py: titan:float8 needs torchao (pip install "amp-runner[fp8]")',
                file=sys.stderr,
            )
            sys.exit(2)
    elif args.titan_filter or args.titan_compile is not None:
        p.error(
            "--titan-filter and --titan-compile are for the titan:float8 peer, which --peers "
            "does not name"
        )
    if args.titan_compile is None:
        args.titan_compile = args.device == "cuda"
    if args.tune_budget_s is not None and (not args.tuned or not args.tune_budget_s > 0):
        p.error("--tune-budget-s is a number of seconds > 0, with --tuned")
    if args.tuned and "titan:float8" in args.peers:
        p.error("--tuned compares the runner's defaults with a peer's: not titan:float8")
    name = f"peers_tuned_{args.device}.md" if args.tuned else f"peers_{args.device}.md"
    args.out = args.out or results_path(name, args.device)
    return args


def level_label(args, peer: str) -> str:
    """The runner level a peer is compared with, as the table names it."""
    if peer != "titan:float8":
        return PAIRS[peer]
    return (
        f"{PAIRS[peer]} {TITAN_RECIPE}"
        + ("+compile" if args.titan_compile else "")
        + "".join(f", {name} bf16" for name in args.titan_filter)
    )


def task_overrides(args, peer: str) -> list[str]:
    """The runner side's overrides for `peer` (the peer is built from the same config)."""
    pair = []
    if peer == "titan:float8":
        pair = [
            f"precision.fp8_linear={TITAN_RECIPE}",
            *(["trainer.compile=true"] if args.titan_compile else []),
        ]
        # the same layers out of fp8 on the runner's side: a layer plan keeps them in bf16
        pair += [f"+precision.layers.{name}=bfloat16" for name in args.titan_filter]
    chosen = (  # --tuned: the runner's defaults, tuned; otherwise the layout set by hand
        ["trainer.tune=on"]
        + ([f"trainer.tune_budget_s={args.tune_budget_s:g}"] if args.tune_budget_s else [])
        if args.tuned
        else [
            "trainer.channels_last=" + ("true" if args.device == "cuda" else "false"),
            "trainer.cudnn_benchmark=true",
        ]
    )
    return [
        *one_batch_task(args.model, args.image_size, args.batch_size, args.device),
        *chosen,
        f"precision={PAIRS[peer]}",
        *pair,
        *args.extra,
    ]


# ---- the sides ----------------------------------------------------------------------------------
def synced_step_times(step: Callable[[], object], steps: int, warmup: int, device) -> tuple:
    """Run `warmup` untimed steps, then time `steps` steps one by one (device-synchronised at
    both ends of each); the median seconds a step and the last step's result."""
    for _ in range(warmup):
        step()
    timed = [timed_block(step, 1, device) for _ in range(steps)]
    return statistics.median(seconds for seconds, _ in timed), timed[-1][1]


class LightningSide:
    """A LightningModule over `model` with the runner's optimizer and scheduler for `cfg`,
    fitted by a fresh `lightning.Trainer` for each block, its steps timed by a callback.
    `benchmark`: Lightning's `benchmark` (torch.backends.cudnn.benchmark, set at each fit), true
    as the runner's `trainer.cudnn_benchmark` defaults to."""

    def __init__(self, model, cfg, batch, precision: str, device, benchmark: bool = True):
        import lightning as L
        import torch

        from runner.components.optim import build_optimizer, build_scheduler
        from runner.measure.probes import synchronize

        # Lightning's start-up chatter (GPU available, the model summary's absence, few workers)
        # is not this benchmark's output
        for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
            logging.getLogger(name).setLevel(logging.ERROR)
        self.device, self.precision, self.benchmark, self.times = device, precision, benchmark, []
        self.last_loss = float("nan")
        side = self
        criterion = torch.nn.CrossEntropyLoss()

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.model = model
                self.optimizer = build_optimizer(cfg.optimizer, self.model.parameters())
                self.scheduler = build_scheduler(
                    cfg.scheduler, self.optimizer, 1, cfg.trainer.max_epochs
                )

            def training_step(self, batch, index):
                x, y = batch
                logits = self.model(x)
                loss = (
                    criterion(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                    if logits.dim() == 3
                    else criterion(logits, y)
                )
                side.last_loss = loss.detach()
                return loss

            def configure_optimizers(self):
                if self.scheduler is None:
                    return self.optimizer
                return {
                    "optimizer": self.optimizer,
                    "lr_scheduler": {"scheduler": self.scheduler, "interval": "step"},
                }

        class StepTimer(L.Callback):
            def __init__(self):
                self.started = 0.0

            def on_train_batch_start(self, trainer, module, batch, index):
                synchronize(side.device)
                self.started = time.perf_counter()

            def on_train_batch_end(self, trainer, module, outputs, batch, index):
                synchronize(side.device)
                side.times.append(time.perf_counter() - self.started)

        class OneBatch(torch.utils.data.Dataset):  # the runner's batch, already on the device
            def __init__(self, steps: int):
                self.steps = steps

            def __len__(self):
                return self.steps

            def __getitem__(self, index):
                return batch

        self._L, self._module, self._timer, self._data = L, Module(), StepTimer(), OneBatch

    def fit(self, steps: int, callbacks: Sequence = ()) -> None:
        """One `fit` of a fresh `lightning.Trainer` for `steps` steps on the batch, watched by
        `callbacks` (Lightning's: a step timer, a busy window)."""
        import torch

        trainer = self._L.Trainer(
            accelerator="gpu" if self.device.type == "cuda" else "cpu",
            devices=1,
            precision=self.precision,
            max_steps=steps,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            benchmark=self.benchmark,
            callbacks=list(callbacks),
        )
        loader = torch.utils.data.DataLoader(self._data(steps), batch_size=None, shuffle=False)
        with warnings.catch_warnings():  # few workers, a scheduler step before the first, ...
            warnings.simplefilter("ignore")
            trainer.fit(self._module, train_dataloaders=loader)

    def block(self, steps: int, warmup: int) -> float:
        """One `fit` of warmup + steps steps; the median of the timed steps' seconds."""
        self.times = []
        self.fit(warmup + steps, [self._timer])
        timed = self.times[warmup:]
        if len(timed) != steps:
            raise RuntimeError(f"Lightning ran {len(self.times)} steps, not {warmup + steps}")
        return statistics.median(timed)


def titan_float8_model(model, device, skip: Sequence[str] = (), compile: bool = True):
    """`model` (fp32, on the device) made ready for torchtitan's float8 training step, in place:
    its Linear layers of sizes that are multiples of 16 (and not named in `skip`) swapped for
    torchao's Float8Linear with the rowwise recipe (emulated on a device without fp8 Tensor Cores),
    then, with `compile`, each transformer block compiled with `fullgraph=True`. Returns the names
    of the converted layers."""
    import dataclasses

    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    blocks = getattr(model, "blocks", None) or getattr(model, "layers", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise TypeError(
            f"titan:float8 compiles each transformer block (`blocks` or `layers`, a "
            f"ModuleList); {type(model).__name__} has none"
        )
    emulate = not (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9))
    config = Float8LinearConfig.from_recipe_name(TITAN_RECIPE)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    skip = set(skip)
    converted: list[str] = []

    def module_filter(module, name: str) -> bool:  # torchtitan's module_filter_fn
        take = (
            isinstance(module, torch.nn.Linear)
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
            and name not in skip
        )
        if take:
            converted.append(name)
        return take

    convert_to_float8_training(model, config=config, module_filter_fn=module_filter)
    if compile:  # torchtitan's apply_compile
        # inductor's emulate_precision_casts, which torchtitan sets process-wide for rowwise:
        # given to the compiled blocks here, so that nothing else in the process changes
        for block in blocks:
            block.compile(fullgraph=True, options={"emulate_precision_casts": True})
    return converted


def tuned_config(overrides: Sequence[str], run_steps: int) -> tuple:
    """The config of `overrides` with what trainer.tune picks for the run it stands for: the same
    task (one batch an epoch) for `run_steps` epochs, so `run_steps` steps to repay tuning and
    compiling. Returns (the config, the picked settings as the table names them, the seconds
    tuning took)."""
    from runner.config.values import override_text
    from runner.run import tune
    from runner.run.distributed import Comm
    from runner.run.plan import make_plan

    stands_for = make_plan(compose([*overrides, f"trainer.max_epochs={run_steps}"]))
    tuning = tune.tuned(stands_for, Comm(), stands_for.device, overrides)
    if tuning is None:
        return compose(overrides), "nothing to tune", 0.0
    chosen = [f"{key}={override_text(value)}" for key, value in tuning.settings.items()]
    return compose([*overrides, *chosen]), tuning.picked(), tuning.seconds


def measure(args, peer: str) -> dict:
    """One peer against its runner level: both built from the same config and initial weights,
    their blocks interleaved."""
    import torch

    level = level_label(args, peer)
    row = {"peer": peer, "level": level, "status": "ok", "error": None}
    try:
        torch.manual_seed(0)
        overrides = task_overrides(args, peer)
        cfg = compose(overrides)
        if args.tuned:
            cfg, row["picked"], row["tune_s"] = tuned_config(overrides, args.run_steps)
        start = fp32_model(cfg)  # the weights the runner's model starts from, in fp32
        parts = build_runner(cfg)
        device, trainer, batch = parts.device, parts.trainer, parts.batch
        peer_batch = batch
        if args.tuned:  # the peer at its defaults: a contiguous model and batch
            start = start.to(memory_format=torch.contiguous_format)
            peer_batch = (batch[0].contiguous(), batch[1])
        kind, _, name = peer.partition(":")
        if kind in ("hand", "titan"):
            if kind == "titan":
                fp8 = titan_float8_model(start, device, args.titan_filter, args.titan_compile)
                ours = set(parts.engine.fp8.converted if parts.engine.fp8 else ())
                if ours != set(fp8):  # the same GEMMs in fp8 on both sides, or no comparison
                    raise RuntimeError(
                        f"the runner converted {sorted(ours)} to fp8, torchtitan's "
                        f"recipe {sorted(fp8)}"
                    )
            hand = handwritten_step(start, cfg, parts.properties, peer_batch)
            state = {"peer_loss": float("nan")}

            def peer_block() -> float:
                seconds, loss = synced_step_times(hand, args.steps, args.warmup, device)
                state["peer_loss"] = float(loss)
                return seconds
        else:
            lightning = LightningSide(start, cfg, peer_batch, name, device)

            def peer_block() -> float:
                return lightning.block(args.steps, args.warmup)

        runner_state = {"loss": float("nan")}

        def runner_block() -> float:
            seconds, loss = synced_step_times(
                lambda: trainer.train_step(*batch), args.steps, args.warmup, device
            )
            runner_state["loss"] = float(loss)
            return seconds

        blocks = {"runner": runner_block, "peer": peer_block}
        medians = interleaved_medians(
            list(blocks), lambda side: blocks[side](), args.rounds, f"{peer} vs {level}"
        )
        ratio = medians["peer"] / medians["runner"]  # = runner throughput / peer throughput
        row.update(
            {
                "runner_ms": 1e3 * medians["runner"],
                "peer_ms": 1e3 * medians["peer"],
                "ratio": ratio,
                "meets": ratio >= TARGET if args.device == "cuda" else None,
                "runner_loss": runner_state["loss"],
                "peer_loss": (
                    float(lightning.last_loss) if kind == "lightning" else state["peer_loss"]
                ),
            }
        )
    except Exception as error:  # noqa: BLE001  (reported; the exit status says so)
        row["status"], row["error"] = "crashed", f"{type(error).__name__}: {error}"
        traceback.print_exc()
    return row


# ---- reporting ----------------------------------------------------------------------------------
def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


TUNED_TARGET = {"cpu": 1.1, "cuda": 1.2}  # --tuned: runner / peer where a candidate was picked


def tuned_verdict(report: dict) -> str:
    """--tuned: the target holds where trainer.tune picked something other than the defaults
    (elsewhere the runner's defaults were already the fastest it measured: no target)."""
    target = TUNED_TARGET[report["device"]]
    rows = [r for r in report["rows"] if r["status"] == "ok"]
    paid = [r for r in rows if r.get("picked") not in ("the defaults", "nothing to tune")]
    missed = [r for r in paid if r["ratio"] < target]
    text = ", ".join(f"{r['peer']} {r['ratio']:.2f}x ({r.get('picked')})" for r in rows)
    if not paid:
        return f"NO TARGET (trainer.tune kept the defaults everywhere): {text}."
    state = "MET" if not missed else "MISSED"
    return f"{state}: runner tuned / peer at defaults {text} (target >= {target:g}x where picked)."


def verdict(report: dict) -> str:
    if report.get("tuned"):
        return tuned_verdict(report)
    rows = [r for r in report["rows"] if r["status"] == "ok"]
    if report["device"] != "cuda":
        return (
            "NO TARGET on CPU (the target, runner / peer >= 1.0, is for the GPU): "
            + ", ".join(f"{r['peer']} {r['ratio']:.2f}x" for r in rows)
            + "."
        )
    missed = [r for r in rows if not r["meets"]]
    crashed = [r["peer"] for r in report["rows"] if r["status"] != "ok"]
    text = (
        f"{'MET' if rows and not missed else 'MISSED'}: runner / peer throughput "
        + ", ".join(f"{r['peer']} {r['ratio']:.2f}x" for r in rows)
        + f" (target >= {TARGET:g}x each)."
    )
    return text + (f" Crashed: {', '.join(crashed)}." if crashed else "")


def render(report: dict) -> str:
    m, tuned = report["machine"], report.get("tuned")
    lines = [
        f"# The runner beside its peers ({report['device']})",
        "",
        f"{model_label(report['model'])}, {report['image_size']} "
        f"{'tokens a sequence' if is_language_model(report['model']) else 'px'}, "
        f"batch {report['batch_size']}; "
        f"{report['rounds']} interleaved rounds of {report['steps']}-step blocks a side after "
        f"{report['warmup']} untimed steps each; a step device-synchronised at both ends; "
        "medians. Ratio = peer step time / runner step time = runner throughput / peer "
        "throughput (>= 1: the runner is at least as fast). The losses are each side's last "
        "timed step's, both training on the one batch (a small model learns it by heart: "
        "near 0)."
        + (
            f" The runner at its defaults with trainer.tune=on, tuned for a run of "
            f"{report['run_steps']} steps"
            + (
                f" within trainer.tune_budget_s={report['tune_budget_s']:g}"
                if report.get("tune_budget_s")
                else ""
            )
            + " (what it picked: the last columns); the peer at its "
            "defaults (a contiguous model and batch)."
            if report.get("tuned")
            else ""
        ),
        "",
        f"Machine: {m.get('cpu', '?')}; {m.get('gpu', 'no GPU')}; torch {m.get('torch', '?')}; "
        f"Lightning {report.get('lightning', '-')}. Date {report['date']}. "
        f"Command: `{report['command']}`.",
        "",
        "| peer | runner level | runner ms/step | peer ms/step | ratio | target | "
        "loss runner / peer |" + (" trainer.tune picked | tuning s |" if tuned else ""),
        "|---|---|---:|---:|---:|---|---|" + ("---|---:|" if tuned else ""),
    ]
    for r in report["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['peer']} | {r['level']} | {r['status']}: {r['error']} | | | | |")
            continue
        target = "-" if r["meets"] is None else ("met" if r["meets"] else "missed")
        lines.append(
            f"| {r['peer']} | {r['level']} | {_f(r['runner_ms'], '.2f')} | "
            f"{_f(r['peer_ms'], '.2f')} | {_f(r['ratio'], '.3f')} | {target} | "
            f"{_f(r['runner_loss'], '.4g')} / {_f(r['peer_loss'], '.4g')} |"
            + (f" {r.get('picked')} | {_f(r.get('tune_s'), '.1f')} |" if tuned else "")
        )
    lines += ["", "Verdict: " + verdict(report), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    started, load_start = time.perf_counter(), load_average()
    print(
        f"peers on {args.device}: {model_label(args.model)} against "
        f"{', '.join(args.peers)}; {args.rounds} rounds of {args.steps}-step blocks",
        flush=True,
    )
    rows = [measure(args, peer) for peer in args.peers]
    try:
        import lightning

        lightning_version = lightning.__version__
    except ImportError:
        lightning_version = None
    report = {
        "benchmark": "peers",
        "device": args.device,
        "model": args.model,
        "image_size": args.image_size,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "tuned": args.tuned,
        "run_steps": args.run_steps if args.tuned else None,
        "tune_budget_s": args.tune_budget_s,
        "lightning": lightning_version,
        "rows": rows,
        **provenance("peers", argv, args.device, load_start, started),
        "overrides": {peer: task_overrides(args, peer) for peer in args.peers},
    }
    markdown = render(report)
    paths = write_results(args.out, markdown, rows, FIELDS, report)
    show(markdown, paths)
    return 1 if any(r["status"] != "ok" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
