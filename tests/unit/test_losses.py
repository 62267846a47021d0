"""The check of a criterion's result in planning (`runner.components.losses.check_criterion`):
what training cannot take is refused naming `loss._target_`; what it can, or what the check cannot
call on class targets, passes."""

from __future__ import annotations

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from runner.components.losses import (
    FunctionLoss,
    build_loss,
    check_criterion,
    check_target,
    loss_function,
)
from runner.errors import ConfigError
from runner.tasks import task_for
from runner.tasks.base import class_indices


class PerItem(nn.Module):
    def forward(self, logits, targets):
        return nn.functional.cross_entropy(logits, targets, reduction="none")


class WithLogs(nn.Module):
    def forward(self, logits, targets):
        loss = nn.functional.cross_entropy(logits, targets)
        return loss, {"ce": loss.detach()}


class Weighted(nn.Module):
    def forward(self, logits, targets, weights):
        return nn.functional.cross_entropy(logits, targets)


class Errors(nn.Module):
    def forward(self, logits, targets):
        return (logits.argmax(-1) != targets).sum()


class Detached(nn.Module):
    def forward(self, logits, targets):
        return nn.functional.cross_entropy(logits, targets).detach()


class FocalLoss(nn.Module):
    def forward(self, logits, targets):
        logp = torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).squeeze(1)
        return (-((1 - logp.exp()) ** 2) * logp).mean()


@pytest.mark.parametrize(
    "criterion,needle",
    [
        (PerItem(), "returns a tensor of shape (4,), not one value"),
        (WithLogs(), "returns a tuple of 2 (the runner takes the loss alone)"),
        (Weighted(), "takes (logits, targets, weights), but the runner calls it as criterion("),
        (Errors(), "returns an int64 tensor (a count, not a loss to descend)"),
        (Detached(), "returns a value without a gradient to the model's outputs"),
    ],
)
def test_a_criterion_whose_result_training_cannot_take_is_refused(criterion, needle):
    with pytest.raises(ConfigError) as bad:
        check_criterion(criterion, "my_pkg.losses.X", task_for("classification"), 10)
    assert bad.value.key == "loss._target_" and needle in str(bad.value)
    assert "my_pkg.losses.X" in str(bad.value)


def test_criteria_training_can_take_pass_and_the_run_s_random_state_is_left_alone():
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    for criterion in (nn.CrossEntropyLoss(label_smoothing=0.1), nn.MultiMarginLoss(), FocalLoss()):
        check_criterion(criterion, "x", task_for("classification"), 10)
    check_criterion(nn.CrossEntropyLoss(), "x", task_for("language_model"), 50)
    # a criterion that wants other targets (one-hot floats) is not judged on class indices
    check_criterion(nn.BCEWithLogitsLoss(), "x", task_for("classification"), 10)
    assert torch.equal(torch.rand(3), expected)


# ---- a loss function as loss._target_ ------------------------------------------------------------
def focal(gamma: float = 2.0):
    """A function that builds a criterion (not a loss function itself)."""
    return FocalLoss()


def loss_cfg(target: str, **kwargs) -> DictConfig:
    return OmegaConf.create({"loss": {"_target_": target, **kwargs}})


def test_a_loss_function_is_a_criterion_with_the_nodes_keys_as_its_arguments():
    cfg = loss_cfg("torch.nn.functional.cross_entropy", label_smoothing=0.1)
    check_target(cfg.loss)
    criterion = build_loss(cfg)
    assert isinstance(criterion, FunctionLoss) and criterion.kwargs == {"label_smoothing": 0.1}
    logits, labels = torch.randn(6, 10), torch.randint(0, 10, (6,))
    expected = nn.CrossEntropyLoss(label_smoothing=0.1)(logits, labels)
    assert torch.equal(criterion(logits, labels), expected)
    check_criterion(criterion, "x", task_for("classification"), 10)
    # the labels are checked against the classes as for torch's own criterion
    assert class_indices(criterion, 10) == (10, -100)
    assert class_indices(
        build_loss(loss_cfg("torch.nn.functional.nll_loss", ignore_index=3)), 7
    ) == (
        7,
        3,
    )
    # a misspelt argument is named as for any _target_
    with pytest.raises(ConfigError) as bad:
        check_target(loss_cfg("torch.nn.functional.cross_entropy", label_smoothin=0.1).loss)
    assert bad.value.key == "loss.label_smoothin" and "did you mean label_smoothing" in str(
        bad.value
    )


def test_a_function_that_builds_a_criterion_is_called_as_before():
    cfg = loss_cfg("tests.unit.test_losses.focal", gamma=3.0)
    check_target(cfg.loss)
    assert loss_function(cfg.loss) is None and isinstance(build_loss(cfg), FocalLoss)
    assert loss_function(loss_cfg("torch.nn.CrossEntropyLoss").loss) is None  # a class
    assert class_indices(build_loss(cfg), 10) is None  # a criterion of the user's
