"""Intake hysteresis (exact pause/resume sets) and the language policies it reads."""

from __future__ import annotations

import pytest

from workers.fairness.intake import IntakeController
from workers.fairness.policy import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MAX_QUEUE,
    DEFAULT_POLICIES,
    LanguagePolicy,
    parse_policies,
    weights_of,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def enqueue(c: IntakeController, lang: str, n: int) -> None:
    for _ in range(n):
        c.on_enqueued(lang)


def done(c: IntakeController, lang: str, n: int) -> None:
    for _ in range(n):
        c.on_done(lang)


def test_pause_at_high_resume_only_at_low() -> None:
    c = IntakeController({"de": 4}, low_water_ratio=0.5)  # high 4, low 2
    assert (c.high_water("de"), c.low_water("de")) == (4, 2)
    enqueue(c, "de", 3)
    assert c.to_pause() == set()
    c.on_enqueued("de")  # 4 = high water
    assert c.to_pause() == {"de"}
    assert c.to_pause() == set()  # already paused: no second pause
    assert c.paused() == {"de"}
    c.on_enqueued("de")  # prefetched record still arrives: 5
    done(c, "de", 2)  # 3: below high but above low
    assert c.to_resume() == set()
    assert c.to_pause() == set()
    c.on_done("de")  # 2 = low water
    assert c.to_resume() == {"de"}
    assert c.to_resume() == set()
    assert c.paused() == set()
    enqueue(c, "de", 1)  # 3: no flapping back into pause
    assert c.to_pause() == set()
    enqueue(c, "de", 1)  # 4 again
    assert c.to_pause() == {"de"}


def test_languages_are_independent() -> None:
    c = IntakeController({"de": 2, "fr": 4, "it": 10})  # lows 1, 2, 5
    enqueue(c, "de", 2)
    enqueue(c, "fr", 4)
    enqueue(c, "it", 9)
    assert c.to_pause() == {"de", "fr"}
    c.on_done("de")  # de 1 (low)
    done(c, "fr", 1)  # fr 3
    assert c.to_resume() == {"de"}
    done(c, "fr", 1)  # fr 2 (low)
    c.on_enqueued("it")  # it 10
    assert c.to_pause() == {"it"}
    assert c.to_resume() == {"fr"}
    assert c.paused() == {"it"}
    assert c.depths() == {"de": 1, "fr": 2, "it": 10}


def test_min_paused_time_holds_a_pause() -> None:
    clock = FakeClock()
    c = IntakeController({"es": 2}, min_paused_s=1.0, clock=clock)
    enqueue(c, "es", 2)
    assert c.to_pause() == {"es"}
    done(c, "es", 2)
    clock.now = 0.5
    assert c.to_resume() == set()
    clock.now = 1.0
    assert c.to_resume() == {"es"}


def test_unknown_languages_use_the_default_or_are_never_paused() -> None:
    c = IntakeController({"de": 2})
    enqueue(c, "xx", 1000)
    assert c.to_pause() == set() and c.high_water("xx") is None
    c2 = IntakeController({}, default_high_water=3, low_water_ratio=0.0)  # resume when empty
    enqueue(c2, "xx", 3)
    assert c2.to_pause() == {"xx"}
    done(c2, "xx", 2)
    assert c2.to_resume() == set()
    c2.on_done("xx")
    assert c2.to_resume() == {"xx"}


def test_from_policies_and_forget() -> None:
    c = IntakeController.from_policies(DEFAULT_POLICIES)
    assert c.high_water("de") == DEFAULT_POLICIES["de"].max_queue
    enqueue(c, "de", DEFAULT_POLICIES["de"].max_queue)
    assert c.to_pause() == {"de"}
    c.forget("de")
    assert c.paused() == set() and c.depth("de") == 0


def test_bad_arguments() -> None:
    c = IntakeController({"de": 2})
    with pytest.raises(ValueError, match="without a matching"):
        c.on_done("de")
    with pytest.raises(ValueError):
        IntakeController({"de": 0})
    with pytest.raises(ValueError):
        IntakeController({"de": 2}, low_water_ratio=1.0)


# -- policies ----------------------------------------------------------------------------------


def test_default_policies_give_tighter_slos_higher_weights() -> None:
    assert set(DEFAULT_POLICIES) == {"en", "de", "fr", "es", "it"}
    by_slo = sorted(DEFAULT_POLICIES.values(), key=lambda p: p.slo_p99_s)
    weights = [p.weight for p in by_slo]
    assert weights == sorted(weights, reverse=True)
    assert weights_of(DEFAULT_POLICIES)["de"] == 4.0


def test_parse_policies() -> None:
    got = parse_policies(" de:4:2.0, fr:3:3.0:100 ,xx:1.5:8:10:64,")
    assert got == {
        "de": LanguagePolicy(4.0, 2.0, DEFAULT_POLICIES["de"].max_queue, 256),
        "fr": LanguagePolicy(3.0, 3.0, 100, DEFAULT_POLICIES["fr"].max_new_tokens),
        "xx": LanguagePolicy(1.5, 8.0, 10, 64),
    }
    assert parse_policies("yy:1:1") == {
        "yy": LanguagePolicy(1.0, 1.0, DEFAULT_MAX_QUEUE, DEFAULT_MAX_NEW_TOKENS)
    }
    assert parse_policies("") == {}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("de:4", "expected lang:weight:slo_s"),
        ("de:4:2:1:1:1", "got 6 field"),
        ("de:x:2", "weight 'x' is not a number"),
        ("de:0:2", "weight must be > 0"),
        ("de:4:-1", "slo_s must be > 0"),
        ("de:4:inf", "slo_s must be > 0"),
        ("de:4:2:1.5", "max_queue '1.5' is not an integer"),
        ("de:4:2:0", "max_queue must be >= 1"),
        ("de:4:2:10:0", "max_new_tokens must be >= 1"),
        ("de:4:2,de:1:1", "given twice"),
        ("1x:4:2", "not a language code"),
    ],
)
def test_parse_policies_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_policies(spec)


def test_policy_validation() -> None:
    with pytest.raises(ValueError):
        LanguagePolicy(weight=0.0, slo_p99_s=1.0, max_queue=1, max_new_tokens=1)
    with pytest.raises(ValueError):
        LanguagePolicy(weight=1.0, slo_p99_s=1.0, max_queue=0, max_new_tokens=1)
