"""The check of a criterion's result in planning (`runner.components.losses.check_criterion`):
what training cannot take is refused naming `loss._target_`; what it can, or what the check cannot
call on class targets, passes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.components.losses import check_criterion
from runner.errors import ConfigError
from runner.tasks import task_for


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
