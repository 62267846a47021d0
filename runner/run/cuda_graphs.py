"""`trainer.cuda_graphs`: `optimizer` (or `true`), the optimizer step captured once in a CUDA graph
and replayed at every later step, and forward and backward through torch.compile's CUDA graphs
where the model is compiled; `step`, the whole training step captured (runner.run.whole_step,
which this module's planning checks too: `refusals` holds both modes' reasons).

What is captured is the engine's public step as the trainer calls it: the clip (where
`trainer.grad_clip_norm` asks for one) and `engine.step` (unscale, overflow check, the update or
its skip, the loss scale's update, the masters copied into the model). A graph replays the
kernels it recorded and none of the Python around them, so the step can be captured only where
it decides nothing on the host: no read of a device value (the overflow flag, a step counter)
and no state kept on the host that a step changes (a Python step counter, a random key's count).
Planning refuses what cannot hold before anything is built (`check`); the first steps, run
eagerly on a side stream as torch's CUDA graphs ask, check the rest at run start (`StepGraph`).

The gradients are the graph's inputs: it reads them from tensors of its own, into which each
step's gradients are copied (one foreach copy; the trainer drops its gradients as ever). That
copy is the least a replay can cost with an eager backward: autograd hands each step's gradient
to the parameter in a new tensor (steals the backward's buffer), and letting it accumulate into
the graph's tensors instead would add one in-place add per parameter and a zeroing pass. So a
replay saves the host the step's launches (Python and one kernel call per group and bucket) and
costs the device one read and write of every gradient and the gradients' memory once more: it
pays where the host, not the GPU, bounds the step (small models or batches, and with
torch.compile's graphs of forward and backward); on a step the GPU bounds the host's launches
are hidden behind the backward already. The runner's kernels read each param group's learning
rate from the device (`runner.precision.rates`: a tensor per group, set from the group's number
before each replay), so a schedule that sets a new rate at every step (cosine) replays the one
graph. The other hyperparameters the step reads as numbers (betas, momentum, weight decay, and
the rate where torch's own optimizer steps) are recorded with the graph, which is captured again
when one of them changes (a `scheduler=step` decay); a schedule that changes them at every step
(onecycle's momentum; cosine where torch's optimizer steps) is refused.

README.md beside this file (torch.compile, CUDA graphs) and docs/precision.md tell the story.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from runner.config import options
from runner.errors import ConfigError
from runner.precision import rates
from runner.run import distributed

log = logging.getLogger(__name__)

KEY = "trainer.cuda_graphs"
WARMUP_STEPS = 3  # eager steps on a side stream before the capture (torch's advice for graphs)
FUSED_OPTIMIZERS = ("sgd", "adam", "adamw")  # what the runner's kernels step (precision.fused)
# schedules that set a new learning rate at every step: the graph would be captured every step
PER_STEP_SCHEDULES = ("cosine", "onecycle")
# of those, what sets only the learning rate, which the runner's kernels read from the device
RATE_ONLY_SCHEDULES = ("cosine",)
OFF, OPTIMIZER, STEP = "false", "optimizer", "step"  # the modes (runner.config.CUDA_GRAPHS)
_WITHOUT = (
    "without fp8 layers, per-layer formats, stochastic rounding, low-bit optimizer state, "
    "gradient accumulation, scheduler=onecycle, or scheduler=cosine where torch's own optimizer "
    "steps"
)
_LEVELS = (
    "at a level whose step keeps its state on the device (O0-O3 and their bf16 presets; where "
    "the loss is scaled, the runner's kernels with sgd, adam or adamw)"
)
ALLOWED = f"false, or true for one process on a CUDA GPU {_LEVELS}, {_WITHOUT}"
ALLOWED_STEP = (
    f"false, or step for one process on a CUDA GPU {_LEVELS}, {_WITHOUT}, without "
    "trainer.compile, range diagnostics or a language model's own dataset"
)


def mode(value: Any) -> str:
    """`trainer.cuda_graphs`'s mode from its value (a TrainerConfig's, or a config): false (off),
    optimizer (true says it too) or step."""
    if isinstance(value, DictConfig):
        value = OmegaConf.select(value, KEY, default=False)
    if value is True or value == OPTIMIZER:
        return OPTIMIZER
    return STEP if value == STEP else OFF


def compile_mode(cfg: DictConfig) -> str:
    """torch.compile's mode for the model: `trainer.compile_mode`, except that with
    `trainer.cuda_graphs=optimizer` the default mode becomes `reduce-overhead` (forward and
    backward replayed as CUDA graphs; `max-autotune` already uses them)."""
    compiled = str(OmegaConf.select(cfg, "trainer.compile_mode", default="default"))
    if mode(cfg) == OPTIMIZER and compiled == "default":
        return "reduce-overhead"
    return compiled


# ---- planning -----------------------------------------------------------------------------
def refusals(cfg: DictConfig, properties: Any, task: str, device: torch.device) -> list[str]:
    """What keeps `trainer.cuda_graphs` (optimizer or step) from holding for this run, each said
    with the key to change (empty: nothing does, or the key is off). The whole step holds the
    optimizer step, so `step` is refused for every reason `optimizer` is, and a few of its own
    (`_step_refusals`)."""
    if mode(cfg) == OFF:
        return []
    found = []
    if device.type != "cuda":
        found.append(
            f"the run is on {device.type} (trainer.device={cfg.trainer.device}), and a CUDA "
            "graph needs a CUDA device"
        )
    if distributed.will_join_a_group() or cfg.trainer.strategy == "fsdp":
        found.append(
            "the run is one of several processes (torchrun or trainer.strategy=fsdp): a "
            "captured step cannot hold the ranks' collectives (DDP's gradient all-reduce, the "
            "overflow vote, FSDP2's gathers)"
        )
    if properties.fp8_linear:
        found.append(
            f"precision.fp8_linear={properties.fp8_linear}: torchao's fp8 layers keep scales "
            "the capture is not checked to hold"
        )
    if properties.layers or properties.layer_plan:
        found.append(
            "precision.layers/precision.layer_plan set a format per layer, whose plan and "
            "audit act on eager steps"
        )
    if properties.stochastic_rounding:
        found.append(
            "precision.stochastic_rounding=true: each step's random key counts steps on the "
            "host, so a replayed step would round with the captured key every time"
        )
    if properties.low_bit_state:
        found.append(
            f"precision.optimizer_state={properties.optimizer_state}: torchao's low-bit "
            "optimizers compile their own step, which a CUDA graph does not capture"
        )
    accumulate = cfg.trainer.accumulate_grad_batches
    if accumulate > 1:
        found.append(
            f"trainer.accumulate_grad_batches={accumulate}: the captured step reads the "
            "gradients of one backward where they stand, and accumulation moves them (summed in "
            "fp32 between the batches of a step at a 16-bit level)"
        )
    found += _host_verdicts(cfg, properties)
    schedule = OmegaConf.select(cfg, "scheduler.name")
    if schedule in RATE_ONLY_SCHEDULES and not _kernels_step(cfg, properties):
        found.append(
            f"scheduler={schedule} sets a new learning rate at every step, and a captured step "
            "of torch's own optimizer holds the rate it was captured with (it would be captured "
            "again every step; the runner's kernels, which read it from the device, step sgd, "
            "adam and adamw at a level with master weights or a loss scale)"
        )
    elif schedule in PER_STEP_SCHEDULES and schedule not in RATE_ONLY_SCHEDULES:
        found.append(
            f"scheduler={schedule} sets a new learning rate at every step, and its momentum "
            "(betas) too, which a captured step holds as captured (it would be captured again "
            "every step)"
        )
    if mode(cfg) == STEP:
        return found + _step_refusals(cfg, task)
    if cfg.trainer.compile and task == options.LANGUAGE_MODEL and options.has_target(cfg.data):
        found.append(
            "trainer.compile=true replays forward and backward as CUDA graphs, one per input "
            "shape, and a language model's own dataset (data._target_) may yield sequences of "
            "any length (the runner's text datasets cut block_size tokens)"
        )
    return found


def _step_refusals(cfg: DictConfig, task: str) -> list[str]:
    """What only the whole step's capture cannot hold: a compiled model (torch.compile's
    reduce-overhead mode is the other route to the same graphs), hooks that act on chosen steps'
    forward and backward, inputs whose shapes vary."""
    found = []
    if cfg.trainer.compile:
        found.append(
            "trainer.compile=true: torch.compile replays forward and backward as CUDA graphs of "
            "its own (compile_mode=reduce-overhead, the other route to a replayed step), which a "
            "capture of the whole step cannot hold (trainer.cuda_graphs=optimizer goes with it)"
        )
    every = cfg.trainer.diagnose_every_n_steps
    if every > 0:
        found.append(
            f"trainer.diagnose_every_n_steps={every}: the range diagnostics hook the forward and "
            "backward of the steps they diagnose, which a replayed step runs without its Python"
        )
    if task == options.LANGUAGE_MODEL and options.has_target(cfg.data):
        found.append(
            "a language model's own dataset (data._target_) may yield sequences of any length, "
            "and a captured step holds one shape (each other shape would run eagerly; the "
            "runner's text datasets cut block_size tokens)"
        )
    return found


def _kernels_step(cfg: DictConfig, properties: Any) -> bool:
    """Whether the runner's kernels take the update (they read the learning rate from the
    device): sgd, adam or adamw without amsgrad, with precision work to fuse."""
    kernels = OmegaConf.select(cfg, "precision.kernels", default="auto")
    name = None if options.has_target(cfg.optimizer) else cfg.optimizer.get("name")
    if kernels == "torch" or name not in FUSED_OPTIMIZERS or cfg.optimizer.get("amsgrad"):
        return False
    scale = properties.loss_scale
    return scale == "dynamic" or float(scale) != 1.0 or bool(properties.master_weights)


def _host_verdicts(cfg: DictConfig, properties: Any) -> list[str]:
    """The runner's kernels take the update where there is precision work to fuse (a loss scale
    to check, or master weights) for sgd, adam and adamw without amsgrad, with the overflow
    verdict and Adam's step counters on the device. Elsewhere the update is torch's own
    optimizer step: at a level that checks for overflow (a dynamic loss scale, or a static one
    other than 1) it waits for the flag on the host, and torch's Adam counts its steps on the
    host (a CPU tensor) at any level."""
    kernels = OmegaConf.select(cfg, "precision.kernels", default="auto")
    name = None if options.has_target(cfg.optimizer) else cfg.optimizer.get("name")
    amsgrad = name in FUSED_OPTIMIZERS and bool(cfg.optimizer.get("amsgrad"))
    scale = properties.loss_scale
    checks = scale == "dynamic" or float(scale) != 1.0
    fusable = kernels != "torch" and name in FUSED_OPTIMIZERS and not amsgrad
    if _kernels_step(cfg, properties):
        return []
    what = f"optimizer={name}" if name else "an optimizer by _target_"
    what += " with optimizer.amsgrad=true" if amsgrad else ""
    what += " with precision.kernels=torch" if kernels == "torch" else ""
    if checks:
        return [
            f"{what} at {properties.opt_level} (precision.loss_scale={scale}): torch's own "
            "optimizer step waits for the overflow flag on the host (the runner's kernels, "
            "for sgd, adam and adamw without amsgrad, skip on the device)"
        ]
    if name in ("adam", "adamw"):
        where = (
            ""
            if not fusable
            else (
                f" at {properties.opt_level} (no master weights, no loss scale: no precision work "
                "for the runner's kernels)"
            )
        )
        return [
            f"{what}{where}: the update is torch's own Adam, which counts its steps on the host "
            "(a CPU tensor) that a replayed step would leave as captured (optimizer=sgd, or a "
            "level with master weights such as o2 or o2_bf16, steps on the device)"
        ]
    return []


def check(cfg: DictConfig, properties: Any, task: str, device: torch.device) -> None:
    """Planning's check: ConfigError naming `trainer.cuda_graphs`, every reason it cannot hold
    for this run, and what is allowed."""
    found = refusals(cfg, properties, task, device)
    if found:
        value = OmegaConf.select(cfg, KEY)
        said = str(value).lower() if isinstance(value, bool) else str(value)
        allowed = ALLOWED_STEP if mode(cfg) == STEP else ALLOWED
        raise ConfigError(KEY, f"{said}, but " + "; ".join(found), allowed)


# ---- the run ------------------------------------------------------------------------------
def _numbers(optimizer: torch.optim.Optimizer, live: bool = False) -> tuple:
    """What the step reads as host numbers from each param group (the learning rate, betas,
    weight decay, ...): a captured step holds them as constants. `live`: the kernels read the
    learning rate from the device (`runner.precision.rates`), so it is not one of them."""
    skip = ("params", "lr") if live else ("params",)
    return tuple(
        tuple(
            (k, v)
            for k, v in sorted(group.items())
            if k not in skip and isinstance(v, (bool, int, float, tuple, str, type(None)))
        )
        for group in optimizer.param_groups
    )


def _host_state(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """The first piece of optimizer state that lives on the host (a Python number, a CPU tensor,
    such as a step counter): a replayed step would never change it. None: all on the device."""
    for state in optimizer.state.values():
        for name, value in state.items():
            host = isinstance(value, (int, float)) and not isinstance(value, bool)
            host = host or (isinstance(value, torch.Tensor) and value.device.type != "cuda")
            if host:
                return f"the optimizer's state '{name}' ({type(value).__name__} on the host)"
    return None


class StepGraph:
    """The optimizer step of a run with `trainer.cuda_graphs`, called where the trainer would
    clip and call `engine.step`: the first `WARMUP_STEPS` steps run eagerly on a side stream
    (the last under torch's sync debug mode, which refuses a host read), the next is captured
    and every later one replays the graph. Returns what the engine's step returned (for a
    device value, a copy of the graph's output, which every replay rewrites).

    `params`: the model's parameters, whose gradients the graph reads from tensors of its own
    (`static`, filled by one foreach copy a step from what the backward made). `compiled`: the
    model goes through torch.compile's CUDA graphs too (each step is marked as a new one)."""

    def __init__(
        self,
        engine: Any,
        optimizer: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
        clip_norm: Optional[float] = None,
        compiled: bool = False,
    ):
        self.engine, self.optimizer, self.clip_norm = engine, optimizer, clip_norm
        self.params = [p for p in params if p.requires_grad]
        self.compiled = compiled
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.output: Any = None
        self.numbers: tuple = ()
        self.eager_steps = self.captures = self.replays = 0
        self._replays_at_capture = 0
        self._live = False  # the captured step read the learning rates from the device
        # the parameters with a gradient at the capture, and the graph's gradient tensors
        self.stepped: list[torch.nn.Parameter] = []
        self.static: list[torch.Tensor] = []
        self._side: Optional[torch.cuda.Stream] = None  # the warm-up's stream (made at the first)
        # the learning rates on the device, read by the kernels (the eager steps make them)
        self.rates = rates.live_rates(optimizer)

    def _step(self) -> Any:
        if self.clip_norm:
            self.engine.clip_grad_norm_(self.clip_norm, self.optimizer)
        # the trainer's call: the verdict left on the device (a bool tensor, True when stepped)
        return self.engine.step(self.optimizer, wait=False)

    def __call__(self) -> Any:
        try:
            if self.eager_steps < WARMUP_STEPS:
                return self._warm_up()
            self.rates.refresh()  # (eagerly, before the graph reads them)
            live = self.rates.covers()
            if self._live and not live:  # new param groups: their rates made by an eager step
                return self._warm_up()
            numbers = _numbers(self.optimizer, live=live)
            if self.graph is None or numbers != self.numbers:
                self._capture(numbers)
                self._live = live
            else:
                self._feed()
            self.graph.replay()
            self.replays += 1
            # a tensor of this step's own: the graph's output is rewritten by the next replay
            return self.output.clone() if torch.is_tensor(self.output) else self.output
        finally:
            if self.compiled:
                torch.compiler.cudagraph_mark_step_begin()

    def _warm_up(self) -> Any:
        """One eager step on the side stream; the last one under torch's sync debug mode: a host
        read in the step is refused before a capture would record the step without it (the
        first steps may copy what they set up once, such as state, to the device)."""
        if self._side is None:
            self._side = torch.cuda.Stream()
        side, main = self._side, torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            if self.eager_steps == WARMUP_STEPS - 1:
                result = self._checked(self._step)
            else:
                result = self._step()
        main.wait_stream(side)
        self.eager_steps += 1
        return result

    def _checked(self, step: Callable[[], Any]) -> Any:
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step()
        except RuntimeError as error:
            if "synchroniz" not in str(error):
                raise
            raise ConfigError(
                KEY,
                "true, but the engine's step at this level reads a device value on the host "
                f"(precision.opt_level={self.engine.properties.opt_level}: the overflow flag, the "
                "loss scale's update or a step counter), and a CUDA graph cannot hold a host "
                f"read; torch said: {error}",
                "false at this level",
            ) from None
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    def _grads(self) -> list[torch.Tensor]:
        """This step's gradients of the captured step's parameters, which must all have one."""
        grads = [p.grad for p in self.stepped]
        if any(g is None for g in grads):
            missing = sum(g is None for g in grads)
            raise RuntimeError(
                f"cuda_graphs: {missing} parameters that had a gradient when the step was "
                "captured have none at this step; a captured step steps the same parameters "
                "at every step"
            )
        return grads

    def _take_inputs(self) -> None:
        """The graph's gradient tensors, made once from this step's gradients (of the same
        dtype, shape and strides: the foreach copy of `_feed` takes its one fast path)."""
        self.stepped = [p for p in self.params if p.grad is not None]
        self.static = [g.detach().clone() for g in self._grads()]
        missing = len(self.params) - len(self.stepped)
        if missing:  # (the eager step leaves them alone too, as long as they get none)
            log.warning(
                "cuda_graphs: %d parameters have no gradient at the capture; the captured "
                "step leaves them as they are",
                missing,
            )

    def _feed(self) -> None:
        """This step's gradients into the graph's tensors: one foreach copy, the replay's only
        work on the device besides the step it recorded (the tensors stay the same ones, whose
        addresses the graph holds)."""
        torch._foreach_copy_(self.static, self._grads())

    def _capture(self, numbers: tuple) -> None:
        """Capture the step (again when the hyperparameters changed). The capture runs the
        engine's Python once and records its kernels without running them: the replay that
        follows it takes this step."""
        host = _host_state(self.optimizer)
        if host is not None:
            raise ConfigError(
                KEY,
                f"true, but {host} is changed by each step on the host, and a replayed step "
                "would leave it as captured",
                "false with this optimizer and level",
            )
        if self.graph is None:
            self._take_inputs()
        else:
            self._feed()
        for p, g in zip(self.stepped, self.static):  # (what the engine reads while captured)
            p.grad = g
        pool = self.graph.pool() if self.graph is not None else None
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.output = self._step()
        except RuntimeError as error:
            if "captur" not in str(error):
                raise
            raise ConfigError(
                KEY,
                "true, but the engine's step cannot be captured at this level "
                f"(precision.opt_level={self.engine.properties.opt_level}); torch said: {error}",
                "false at this level",
            ) from None
        again = self.captures > 0 and self.replays == self._replays_at_capture + 1
        self.graph, self.numbers = graph, numbers
        self.captures += 1
        self._replays_at_capture = self.replays
        if again:  # (a number that changes at every step: the kernels did not take the step)
            log.warning(
                "cuda_graphs: the step's numbers changed at two steps in a row, and each "
                "capture synchronises; a schedule's learning rate is read from the device only "
                "where the runner's kernels take the step (built, for sgd, adam or adamw)"
            )
        elif self.captures > 1:
            log.info("cuda_graphs: the hyperparameters changed: the step captured again")

    def summary(self) -> str:
        return (
            f"cuda_graphs: {self.eager_steps} eager steps, the optimizer step captured "
            f"{self.captures} time(s) and replayed {self.replays} times"
        )


def step_graph(
    cfg: Any, engine: Any, optimizer: torch.optim.Optimizer, model: torch.nn.Module
) -> Optional[StepGraph]:
    """The trainer's StepGraph for its settings `cfg` (a TrainerConfig); None with
    `trainer.cuda_graphs=false` or `step` (runner.run.whole_step's): eager optimizer steps."""
    if mode(cfg.cuda_graphs) != OPTIMIZER:
        return None
    return StepGraph(
        engine, optimizer, list(model.parameters()), cfg.grad_clip_norm, compiled=cfg.compile
    )
