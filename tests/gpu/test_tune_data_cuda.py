"""trainer.tune's pinned-memory candidate on a GPU: the loader measured pinned and not, each
batch copied to the device, and the decision in the run's config."""

from __future__ import annotations

import pytest
import torch

from runner.run import tune_data
from runner.run.distributed import Comm
from runner.run.measured import measured_plan
from runner.run.plan import make_plan
from runner.run.recorded import Launch
from tests.helpers.runs import FAST, compose_config

W, PIN = tune_data.WORKERS, tune_data.PIN


@pytest.mark.gpu
def test_pinned_memory_is_measured_on_a_gpu():
    overrides = [*FAST, "trainer.tune=on", "trainer.device=cuda"]  # (FAST gives 0 workers)
    given = make_plan(compose_config(*overrides))
    plan, tuning = measured_plan(given, Comm(), torch.device("cuda"), Launch(tuple(overrides)))
    assert [r.settings for r in tuning.loader] == [{W: 0}, {W: 0, PIN: False}]
    assert all(r.steady_ms > 0 and not r.note for r in tuning.loader)
    assert tuning.reasons[W] == "kept: given"
    assert tuning.reasons[PIN].startswith(("tuned: ", "kept: pinned measured as fast"))
    assert plan.cfg.trainer.pin_memory is tuning.settings[PIN]  # null (pinned) or false
    assert tuning.settings[PIN] in (None, False)
    assert "| loader | ms/batch | start-up s | chosen |" in tuning.table()
