"""The stage clock (hf_rebasin.run.clock): rebasin.json's timings come from one place."""

from __future__ import annotations

import time

import pytest

from hf_rebasin.run.clock import STAGES, StageClock


def test_stages_accumulate_and_new_ones_come_after_the_four() -> None:
    clock = StageClock()
    assert list(clock.seconds) == list(STAGES) and not any(clock.seconds.values())
    for _ in range(2):
        with clock.stage("align"):
            time.sleep(0.01)
    with clock.stage("train"):
        pass
    assert clock.seconds["align"] >= 0.02
    assert list(clock.seconds) == [*STAGES, "train"]


def test_a_stage_that_raises_is_still_counted() -> None:
    clock = StageClock()
    with pytest.raises(ValueError), clock.stage("evaluate"):
        time.sleep(0.01)
        raise ValueError
    assert clock.seconds["evaluate"] >= 0.01
