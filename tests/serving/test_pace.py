"""The pace hook (workers/serving/pace.py): pure logic on requests, times and SLOs."""

from __future__ import annotations

import pytest

from workers.engine.types import GenerationRequest
from workers.serving.pace import MIXED_STEP_FACTOR, SloPace

SLO = {"de": 2.0, "en": 3.0}
STEP = 0.04  # a decode-only step; a mixed one would cost MIXED_STEP_FACTOR of them


def request(group: str, expected: int, arrival: float) -> GenerationRequest:
    return GenerationRequest(
        f"{group}-{expected}", [1, 2, 3], group=group, arrival=arrival,
        expected_output_tokens=expected,
    )  # fmt: skip


def test_a_long_answer_near_its_slo_holds_the_other_languages() -> None:
    pace = SloPace(SLO, STEP)
    # 53 tokens to go and 2.7 s left: 51 ms a token, under the 80 ms of a mixed step
    assert pace([(request("en", 53, arrival=0.0), 0)], now=0.3) == frozenset({"en"})
    assert pace.held_steps == 1


def test_a_short_answer_with_time_to_spare_holds_nobody() -> None:
    pace = SloPace(SLO, STEP)
    assert pace([(request("en", 11, arrival=0.0), 0)], now=0.3) is None  # 245 ms a token
    # the same long answer, once most of it is generated, no longer needs fast steps
    assert pace([(request("en", 53, arrival=0.0), 45)], now=1.0) is None  # 250 ms a token
    assert pace.held_steps == 0


def test_requests_already_late_or_of_unknown_length_or_slo_hold_nobody() -> None:
    pace = SloPace(SLO, STEP)
    late = request("de", 40, arrival=0.0)  # 2 s SLO, 25 s in the queue
    unknown = request("en", 0, arrival=24.9)
    other = request("xx", 40, arrival=24.9)
    assert pace([(late, 0), (unknown, 0), (other, 0)], now=25.0) is None


def test_the_threshold_is_the_mixed_step() -> None:
    pace = SloPace(SLO, STEP)
    tokens = 10
    just_enough = tokens * MIXED_STEP_FACTOR * STEP
    assert pace([(request("en", tokens, arrival=0.0), 0)], now=3.0 - just_enough - 0.01) is None
    assert pace([(request("en", tokens, arrival=0.0), 0)], now=3.0 - just_enough + 0.01) == {"en"}
    with pytest.raises(ValueError):
        SloPace(SLO, 0.0)


def test_the_step_is_the_running_batchs() -> None:
    """The threshold is a mixed step at the running batch's size: at 1-2 req/s a request runs
    alone, its steps at batch 1, and it does not hold newcomers for the cap's slow steps."""
    steps = {1: 0.02, 8: 0.05, 16: 0.13}
    pace = SloPace(SLO, steps)
    assert pace.step_s(1) == 0.02 and pace.step_s(16) == 0.13 and pace.step_s(32) == 0.13
    assert pace.step_s(4) == pytest.approx(0.02 + (0.05 - 0.02) * 3 / 7)  # linear between
    de = request("de", 20, arrival=0.0)  # 2 s for 20 tokens: 100 ms a token
    assert pace([(de, 0)], now=0.0) is None  # alone: a mixed step ~40 ms
    full = [(de, 0)] + [(request("en", 5, arrival=0.0), 0)] * 15  # a batch of 16: ~260 ms
    assert pace(full, now=0.0) == frozenset({"de"})
    pace.decode_steps = {8: 0.05}  # one size given: the same at every size
    assert pace.step_s(1) == pace.step_s(32) == 0.05
    for bad in ({}, {0: 0.01}, {1: -0.01}):
        with pytest.raises(ValueError):
            SloPace(SLO, bad)
