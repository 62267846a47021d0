"""Each prepared optimizer's place in its round: `Stage`, the round's data (`Round`) and what the
engine keeps per optimizer (`Prepared`), with the calls each stage refuses.

Every call of the engine checks the optimizer's stage and moves it on. The usual round is

    READY --backward--> ACCUMULATING [--unscale_--> UNSCALED] [--clip_grad_norm_--> CLIPPED]
          --step--> STEPPED --zero_grad--> READY

and in full (rows: the stage; columns: the call; entries: the next stage):

    stage         backward        unscale_, settle   clip_grad_norm_   step      zero_grad
    READY         ACCUMULATING    UNSCALED           CLIPPED           STEPPED   READY
    ACCUMULATING  ACCUMULATING    UNSCALED           CLIPPED           STEPPED   READY
    UNSCALED      ACCUMULATING 1  (no-op) 2          CLIPPED           STEPPED   READY
    CLIPPED       error           (no-op) 3          CLIPPED           STEPPED   READY
    STEPPED       ACCUMULATING 4  error              error             error     READY

    1 the unscaled gradients go to the fp32 stash; the new ones accumulate scaled
    2 as torch's GradScaler: unscale_ twice is a no-op (settle only re-reads the verdict)
    3 unscale_ applies a planned fused step's multiplier to .grad, else does nothing
    4 a new round; .grad is kept as it is, as plain torch keeps it without zero_grad

The errors are RuntimeErrors that name the call, the stage and what to do. How the stages serve
several losses and several optimizers: README.md beside this file.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from runner.precision import paths
from runner.precision.master import MasterWeights


class Stage(enum.Enum):
    """Where one optimizer is in its round (see the module docstring for the transitions)."""

    READY = "ready"  # no gradients of this round yet (prepared, or zero_grad)
    ACCUMULATING = "accumulating"  # scaled gradients of one or more backward calls
    UNSCALED = "unscaled"  # the stepped .grad hold true values (unscale_, settle)
    CLIPPED = "clipped"  # clipped: true values in .grad, or a planned fused step
    # holds the clipping coefficient in its multiplier
    STEPPED = "stepped"  # stepped or skipped; the next backward starts a new round


# The calls refused after the step (stage STEPPED): what happened, why it is wrong, what to do.
_AFTER_STEP = {
    "step": (
        "step() called twice without a backward in between",
        "this round's gradients were already stepped (or the step skipped), and stepping "
        "them again would apply them twice",
        "Run the next round's backward (after zero_grad) before stepping again.",
    ),
    "clip_grad_norm_": (
        "clip_grad_norm_() called after step()",
        "the step has already used the gradients, so clipping them now changes nothing",
        "Clip between backward and step: backward, clip_grad_norm_, step, zero_grad.",
    ),
    "unscale_": (
        "unscale_() called after step()",
        "the step has already used the gradients",
        "Call unscale_ between backward and step (step unscales by itself when nobody did).",
    ),
    "settle": (
        "settle() called after step()",
        "the step has already used the gradients",
        "Settle between backward and step (the Apex facade does so at the end of scale_loss).",
    ),
}

_BACKWARD_AFTER_CLIP = (
    "backward after clip_grad_norm_ and before step: the clipped gradients "
    "would be mixed with new ones"
)


@dataclass
class Round:
    """One optimizer's data between its first backward and its step (or zero_grad)."""

    # loss ids whose *scaled* gradients sit in the model's .grad (accumulated, one scale)
    scaled_ids: set[int] = field(default_factory=set)
    # every loss id that contributed gradients this round (their scalers update at the step)
    loss_ids: set[int] = field(default_factory=set)
    # fp32 sums of already unscaled gradients of earlier losses: id(stepped param) -> tensor
    stash: dict[int, torch.Tensor] = field(default_factory=dict)
    flags: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # device flags per loss
    found: dict[int, bool] = field(default_factory=dict)  # resolved flags per loss
    # a fused step planned from the scaled gradients by a lazy clip (its multiplier set)
    planned: Optional[paths.ScaledStep] = None
    # backward calls shared with other optimizers (one scale_loss over several): call -> loss id
    shared: dict[int, int] = field(default_factory=dict)
    scaled_calls: set[int] = field(default_factory=set)  # shared calls whose grads sit scaled
    call_flags: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    call_found: dict[int, bool] = field(default_factory=dict)  # resolved flags per shared call

    def record(self, flag: Optional[torch.Tensor]) -> None:
        """A device-side non-finite flag counts against every loss (and shared backward call)
        whose gradients it covers."""
        if flag is not None:
            for i in self.scaled_ids:
                self.flags.setdefault(i, []).append(flag)
            for call in self.scaled_calls:
                self.call_flags.setdefault(call, []).append(flag)

    def verdicts(self, flag_reducer: Optional[Callable[[torch.Tensor], Any]]) -> dict[int, bool]:
        """The per-loss overflow verdicts of this round (and those of the shared backward calls,
        in `call_found`): at most one host sync per call."""
        pending = [(self.found, i, flags) for i, flags in self.flags.items() if flags]
        pending += [(self.call_found, c, flags) for c, flags in self.call_flags.items() if flags]
        if pending:
            sums = []
            for _, _, flags in pending:
                f = flags[0]
                for o in flags[1:]:
                    f = f + o.to(f.device)
                sums.append(f)
            if len(sums) == 1 and flag_reducer is None:
                values = [sums[0].item()]
            else:
                dev = sums[0].device
                combined = torch.cat([s.to(dev).reshape(1) for s in sums])
                if flag_reducer is not None:
                    flag_reducer(combined)
                values = combined.tolist()
            for (table, key, flags), v in zip(pending, values):
                table[key] = table.get(key, False) or v != 0
                flags.clear()
        return self.found

    def device_flags(
        self, flag_reducer: Optional[Callable[[torch.Tensor], Any]]
    ) -> dict[int, torch.Tensor]:
        """The per-loss overflow flags of this round as device tensors (non-zero: overflowed),
        summed over the passes that recorded them (and over the ranks by `flag_reducer`), with
        no host read. Losses whose flags were resolved on the host already keep those."""
        pending = [(i, flags) for i, flags in self.flags.items() if flags]
        sums = []
        for _, flags in pending:
            f = flags[0]
            for o in flags[1:]:
                f = f + o.to(f.device)
            sums.append(f.reshape(1))
            flags.clear()
        if sums and flag_reducer is not None:
            dev = sums[0].device
            combined = torch.cat([s.to(dev) for s in sums])
            flag_reducer(combined)
            sums = list(combined.split(1))
        out = {i: s for (i, _), s in zip(pending, sums)}
        for i, found in self.found.items():
            if i not in out:
                out[i] = torch.tensor([float(found)])
        return out


# Bumped whenever any module in the process registers a parameter or a submodule (torch's global
# registration hooks, installed with the first `Prepared`): a list of a model's parameters made
# while it stays the same is still whole. (Writes straight into a module's `_parameters` dict go
# around the hooks; torch's own dtype and device conversions keep the Parameter objects.)
_structure = [0]


def _bump(*args: Any) -> None:
    _structure[0] += 1


@functools.cache
def _watch_structure() -> None:
    nn.modules.module.register_module_parameter_registration_hook(_bump)
    nn.modules.module.register_module_module_registration_hook(_bump)


@dataclass
class Prepared:
    """What the engine keeps per prepared optimizer."""

    optimizer: torch.optim.Optimizer
    path: paths.ExecutionPath
    models: list[nn.Module] = field(default_factory=list)  # their grads cleared by zero_grad
    masters: Optional[MasterWeights] = None
    n_groups: int = 0
    stage: Stage = Stage.READY
    round: Round = field(default_factory=Round)
    # (key, tensors): what zero_grad clears, listed once (`grad_holders`)
    holders: tuple[Any, list[torch.Tensor]] = ((), [])

    def __post_init__(self) -> None:
        _watch_structure()

    def grad_holders(self) -> list[torch.Tensor]:
        """Every tensor whose `.grad` zero_grad clears, each once: what the optimizer steps, the
        16-bit params paired with masters and the models' params, less the fp32 masters (their
        grads are `MasterWeights.zero_grad`'s, which keeps the buffers). Listed once and again
        only when the optimizer's groups or the masters change, or any module registered a
        parameter or a submodule since: a step's zero_grad walks no module tree."""
        paired = self.masters.model_params if self.masters is not None else None
        key = (
            _structure[0],
            self.models and tuple(map(id, self.models)),
            paired is not None and (id(paired), len(paired)),
            *((id(g["params"]), len(g["params"])) for g in self.optimizer.param_groups),
        )
        if self.holders[0] != key:
            tensors = list(paths.stepped_params(self.optimizer)) + list(paired or ())
            for model in self.models:
                tensors += model.parameters()
            unique = {id(t): t for t in tensors}
            for master in self.masters.masters if self.masters is not None else ():
                unique.pop(id(master), None)
            self.holders = (key, list(unique.values()))
        return self.holders[1]

    def refuse_after_step(self, call: str) -> None:
        """`call` (a key of `_AFTER_STEP`) is refused in stage STEPPED."""
        if self.stage is Stage.STEPPED:
            what, why, fix = _AFTER_STEP[call]
            raise RuntimeError(
                f"{what} (this optimizer's stage: '{self.stage.value}'): {why}. {fix}"
            )

    def refuse_backward(self) -> None:
        """A backward is refused in stage CLIPPED."""
        if self.stage is Stage.CLIPPED:
            raise RuntimeError(
                f"{_BACKWARD_AFTER_CLIP} (this optimizer's stage: "
                f"'{self.stage.value}'). Call step() (or zero_grad()) first."
            )

    def new_round(self, stage: Stage) -> None:
        self.stage = stage
        self.round = Round()
