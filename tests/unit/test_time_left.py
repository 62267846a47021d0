"""How long a run has left, on each epoch's line: the pace of an epoch, said as a person says a
duration, and the line of a real (tiny) fit."""

from __future__ import annotations

import logging
import math
import re
import time

import pytest

from runner.run.time_left import duration, epoch_seconds, time_left, took
from tests.helpers.trainer import make_trainer


@pytest.mark.parametrize(
    "seconds,said",
    [
        (0.4, "0 s"),
        (40, "40 s"),
        (89, "89 s"),
        (95, "2 min"),
        (42 * 60 + 10, "42 min"),
        (89 * 60, "89 min"),
        (3 * 3600 + 5 * 60, "3 h 05 min"),
        (47 * 3600 + 59 * 60, "47 h 59 min"),
        (2 * 86400 + 4 * 3600, "2 d 4 h"),
        (-3, "0 s"),
    ],
)
def test_a_duration_is_said_in_the_unit_a_person_would_use(seconds, said):
    assert duration(seconds) == said


def test_the_run_s_last_line_says_a_long_run_s_time_in_hours():
    assert took(10.44) == "10.4 s"
    assert took(3 * 3600 + 5 * 60 + 2) == "3 h 05 min"  # (not "11102.0 s")


def test_an_epoch_resumed_in_its_middle_is_scaled_up_to_a_whole_one():
    # 30 s for the last 25 of 100 batches: 120 s of training a whole epoch, then validation
    # and the checkpoint as they were
    assert epoch_seconds(30.0, 5.0, 1.0, 25, 100) == pytest.approx(126.0)
    assert epoch_seconds(30.0, 5.0, 1.0, 100, 100) == pytest.approx(36.0)
    assert math.isnan(epoch_seconds(0.0, 5.0, 0.0, 0, 100))  # no batch trained: no pace


def test_the_time_left_is_the_epochs_to_go_at_the_last_one_s_pace():
    now = time.mktime((2026, 11, 29, 13, 0, 0, 0, 0, -1))
    assert time_left(600.0, 3, now) == "  about 30 min left, until 13:30"
    assert time_left(20.0, 2, now) == "  about 40 s left"  # (no clock for seconds)
    # past midnight: the date too
    assert time_left(3600.0, 12, now) == "  about 12 h 00 min left, until 2026-11-30 01:00"
    for per_epoch, left in ((600.0, 0), (math.nan, 3), (0.0, 3)):
        assert time_left(per_epoch, left, now) == ""


def test_each_epoch_line_but_the_last_says_how_long_the_run_has_left(caplog):
    trainer, _ = make_trainer("O0", {}, max_epochs=3)
    with caplog.at_level(logging.INFO, logger="runner.run.trainer"):
        trainer.fit()
    lines = [r.getMessage() for r in caplog.records if re.match(r"epoch \d/3:", r.getMessage())]
    assert len(lines) == 3, lines
    for line in lines[:2]:
        # (milliseconds here; a clock where a loaded machine takes a minute and a half)
        assert re.search(r"skipped \d+  about \d+ (s|min) left(, until \d\d:\d\d)?$", line), line
    assert re.search(r"skipped \d+$", lines[2]), lines[2]  # the last: nothing left
