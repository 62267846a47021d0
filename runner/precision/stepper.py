"""`OptimizerStepper`: one prepared optimizer and its round, the gradient work both engines ask of
it (the trainer's `AmpEngine` has one, the Apex facade's `ApexEngine` one per optimizer).

A round runs from the first backward after a step (or `zero_grad`) to the next step. Its stage
(`Stage`) says where the optimizer is; every call of an engine checks it and moves it on. The usual
round is

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

The errors are RuntimeErrors that name the call, the stage and what to do.

The stepper holds the round's gradients: which loss scaler's *scaled* gradients sit in `.grad`,
the fp32 stash of gradients unscaled earlier in the round, and a fused step planned by a lazy clip.
Every call that checks gradients returns the device-side non-finite flag it made (None when
nothing was checked): the engines keep the flags and decide, the trainer's for its one loss, the
facade's per loss and per backward call shared by several optimizers. How each piece runs (the
kernels or torch's ops) is the optimizer's execution path's (`paths.py`).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from torch import nn

from runner.precision import paths
from runner.precision.master import MasterSet, MasterWeights
from runner.precision.scaler import LossScaler


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

# Bumped whenever any module in the process registers a parameter or a submodule (torch's global
# registration hooks, installed with the first stepper): a list of a model's parameters made
# while it stays the same is still whole. (Writes straight into a module's `_parameters` dict go
# around the hooks; torch's own dtype and device conversions keep the Parameter objects.)
_structure = [0]


def _bump(*args: Any) -> None:
    _structure[0] += 1


@functools.cache
def _watch_structure() -> None:
    nn.modules.module.register_module_parameter_registration_hook(_bump)
    nn.modules.module.register_module_module_registration_hook(_bump)


class OptimizerStepper:
    """One prepared optimizer: its execution path, fp32 masters (or None), the models whose grads
    `zero_grad` clears, its stage and the round's gradients."""

    def __init__(self, optimizer: torch.optim.Optimizer, path: paths.ExecutionPath):
        _watch_structure()
        self.optimizer = optimizer
        self.path = path
        self.models: list[nn.Module] = []  # their grads cleared by zero_grad
        self.masters: Optional[MasterWeights] = None
        self.n_groups = len(optimizer.param_groups)
        # (key, tensors): what zero_grad clears, listed once (`grad_holders`)
        self._holders: tuple[Any, list[torch.Tensor]] = ((), [])
        self.new_round(Stage.READY)

    def new_round(self, stage: Stage) -> None:
        """The round's gradients forgotten (after a step, or zero_grad), the stage set."""
        self.stage = stage
        # the scaler of the *scaled* gradients in the stepped .grad; None: none sit there, or
        # several losses' that need no unscaling (the facade's; static scales of 1)
        self.scaler: Optional[LossScaler] = None
        # fp32 sums of gradients unscaled earlier this round: id(stepped param) -> tensor
        self.stash: dict[int, torch.Tensor] = {}
        # a fused step planned from the scaled gradients by a lazy clip (its multiplier set)
        self.planned: Optional[paths.ScaledStep] = None

    # ---- set-up ------------------------------------------------------------------------------
    def add_models(self, models: Iterable[nn.Module], master_set: Optional[MasterSet]) -> None:
        """`models` get their grads cleared by `zero_grad`; with a `master_set` (master weights),
        the optimizer's 16-bit params get fp32 masters, kept in that set (only the new ones where
        the optimizer was prepared before: one optimizer over several models, one by one)."""
        self.models.extend(m for m in models if all(m is not o for o in self.models))
        if master_set is not None:
            if self.masters is None:
                self.masters = MasterWeights(self.optimizer)
                master_set.add(self.masters)
            else:
                self.masters.add_new_half_params()
        self.n_groups = len(self.optimizer.param_groups)

    def sync_param_groups(self) -> int:
        """After `optimizer.add_param_group`: fp32 masters for the new 16-bit params (also done
        at the next unscale). Returns how many masters were added."""
        self.n_groups = len(self.optimizer.param_groups)
        if self.masters is None:
            return 0
        return self.masters.add_new_half_params()

    # ---- the stages' checks ------------------------------------------------------------------
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

    # ---- a round's gradient work -------------------------------------------------------------
    def before_backward(self, scaler: Optional[LossScaler]) -> None:
        """A backward of a loss scaled by `scaler` comes: gradients unscaled earlier this round
        go to the fp32 stash first (the new ones accumulate scaled, unscaled once later)."""
        if self.stage is Stage.UNSCALED:
            self._stash_grads()
        self.scaler = scaler
        self.stage = Stage.ACCUMULATING

    @torch.no_grad()
    def _stash_grads(self) -> None:
        """Move the (unscaled) stepped gradients into the fp32 stash and clear the model's."""
        for p in paths.stepped_params(self.optimizer):
            g = p.grad
            if g is None:
                continue
            buf = self.stash.get(id(p))
            if buf is None:
                self.stash[id(p)] = g.detach().to(torch.float32, copy=True)
            else:
                buf.add_(g)
            p.grad = None
        if self.masters is not None:
            for p in self.masters.model_params:
                p.grad = None
            self.masters.zero_grad()

    def unscale(self) -> Optional[torch.Tensor]:
        """Make the stepped gradients true values, once per round (a no-op until the step): the
        copy into the fp32 masters, the unscale and the check (one kernel pass where the kernels
        serve; a pending lazy clip's coefficient applied), then the stash added back. Returns
        the check's device flag (None: nothing checked)."""
        if self.stage is Stage.UNSCALED or (self.stage is Stage.CLIPPED and self.planned is None):
            return None  # .grad already hold the true values
        if len(self.optimizer.param_groups) != self.n_groups:
            self.sync_param_groups()
        multiplier = self.planned.multiplier if self.planned is not None else None
        flag = self.path.unscale(self.optimizer, self.masters, self.scaler, multiplier)
        self.scaler = None
        self.planned = None
        if self.stash:
            with torch.no_grad():
                for p in paths.stepped_params(self.optimizer):
                    buf = self.stash.get(id(p))
                    if buf is None:
                        continue
                    if p.grad is None:
                        p.grad = buf if buf.dtype == p.dtype else buf.to(p.dtype)
                    else:
                        p.grad.add_(buf)
            self.stash = {}
        if self.stage is not Stage.CLIPPED:
            self.stage = Stage.UNSCALED
        return flag

    def scaled_step(self) -> Optional[paths.ScaledStep]:
        """The step straight from the model's scaled gradients: the one a lazy clip planned, or
        a new plan when one scaler's gradients sit in place with nothing unscaled or stashed and
        the path can plan it (kernels, precision work to fuse, an optimizer they implement)."""
        if self.planned is not None:
            return self.planned
        if self.stash or self.scaler is None:
            return None
        return self.path.plan(self.optimizer, self.masters, self.scaler)

    def check(self, step: paths.ScaledStep) -> Optional[torch.Tensor]:
        """The planned step's read-only check of the scaled gradients (none after a lazy clip,
        whose norm pass checked them)."""
        return self.path.check(step) if step.multiplier is None else None

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Clip the unscaled gradients the optimizer steps; returns the total norm before
        clipping and the device flag of the check it made. On the fused path the gradients are
        not rewritten: the norm comes from the scaled ones (a pass that also flags non-finite
        values) and the clipping coefficient joins the planned step's multiplier."""
        planned = self.scaled_step() if float(norm_type) == 2.0 else None
        if planned is not None:
            total, flag = self.path.clip(planned, max_norm)
            self.planned = planned
        else:
            flag = self.unscale()
            params = [p for p in paths.stepped_params(self.optimizer) if p.grad is not None]
            total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        self.stage = Stage.CLIPPED
        return total, flag

    def apply(
        self,
        planned: Optional[paths.ScaledStep],
        step_fn: Optional[Callable[..., Any]],
        args: tuple,
        kwargs: dict,
        found_inf: Optional[torch.Tensor] = None,
    ) -> None:
        """The update (the `planned` one, or the optimizer's on unscaled `.grad`), masters ->
        model; skipped on the device where `found_inf` (a device flag) is set."""
        self.path.apply(
            self.optimizer, self.masters, planned, step_fn, args, kwargs, found_inf=found_inf
        )

    def zero_grad(self, set_to_none: bool) -> None:
        """Model and master grads cleared (to None by default; the masters' grad buffers are
        kept for reuse). The caller starts the new round."""
        if self.masters is not None:
            self.masters.zero_grad()
        for p in self.grad_holders():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_().requires_grad_(False)
                p.grad.zero_()

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
        if self._holders[0] != key:
            tensors = list(paths.stepped_params(self.optimizer)) + list(paired or ())
            for model in self.models:
                tensors += model.parameters()
            unique = {id(t): t for t in tensors}
            for master in self.masters.masters if self.masters is not None else ():
                unique.pop(id(master), None)
            self._holders = (key, list(unique.values()))
        return self._holders[1]
