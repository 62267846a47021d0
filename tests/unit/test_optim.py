"""runner.components.optim.build_optimizer from composed configs: each option builds its own torch
class
with the configured hyperparameters, and Adam's L2 penalty is not confused with AdamW's decoupled
weight decay."""

from __future__ import annotations

import pytest
import torch

from runner.components.optim import build_optimizer, build_scheduler
from tests.helpers.runs import compose_config


def _build(*overrides: str, value: float = 1.0) -> tuple[torch.optim.Optimizer, torch.nn.Parameter]:
    param = torch.nn.Parameter(torch.tensor([value]))
    return build_optimizer(compose_config(*overrides).optimizer, [param]), param


@pytest.mark.parametrize(
    "option, cls",
    [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)],
)
def test_each_option_builds_exactly_its_class(option, cls):
    opt, _ = _build(f"optimizer={option}")
    assert type(opt) is cls  # exact: AdamW subclasses Adam in recent torch


def test_adam_and_adamw_receive_the_configured_hyperparameters():
    for option in ("adam", "adamw"):
        opt, _ = _build(
            f"optimizer={option}",
            "optimizer.lr=0.003",
            "optimizer.betas=[0.8,0.9]",
            "optimizer.eps=1e-6",
            "optimizer.weight_decay=0.05",
            "optimizer.amsgrad=true",
        )
        group = opt.param_groups[0]
        assert (
            group["lr"],
            group["betas"],
            group["eps"],
            group["weight_decay"],
            group["amsgrad"],
        ) == (0.003, (0.8, 0.9), 1e-6, 0.05, True), option


def test_adamw_decays_decoupled_while_adam_adds_an_l2_gradient():
    """One step from w=1 with a zero loss gradient, lr=0.1, weight_decay=0.1:
    AdamW shrinks the weight by lr*wd (w = 0.99) and its Adam update of a zero gradient is 0;
    Adam adds wd*w = 0.1 to the gradient, and its first normalised update is ~lr (w = 0.9)."""
    results = {}
    for option in ("adam", "adamw"):
        opt, w = _build(f"optimizer={option}", "optimizer.lr=0.1", "optimizer.weight_decay=0.1")
        w.grad = torch.zeros_like(w)
        opt.step()
        results[option] = w.item()
    assert results["adamw"] == pytest.approx(0.99, abs=1e-6)
    assert results["adam"] == pytest.approx(0.9, abs=1e-6)


def test_a_step_schedule_that_never_decays_in_the_run_says_so(caplog):
    opt, _ = _build()
    cfg = compose_config("scheduler=step", "scheduler.step_epochs=3").scheduler
    with caplog.at_level("WARNING", logger="runner.components.optim"):
        build_scheduler(cfg, opt, steps_per_epoch=5, max_epochs=4)
    assert "learning rate never decays" not in caplog.text  # it decays after epoch 3
    with caplog.at_level("WARNING", logger="runner.components.optim"):
        scheduler = build_scheduler(cfg, opt, steps_per_epoch=5, max_epochs=3)
    assert (
        "scheduler.step_epochs=3 with trainer.max_epochs=3: the learning rate never decays"
        in caplog.text
    )
    assert scheduler.step_size == 15  # (still the schedule asked for)
