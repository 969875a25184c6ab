"""`workers.engine.deadlines`: the request deadline on the engine's clock, and the EXPIRED rules.

Every expected value is written out or computed another way (datetimes, the Avro codec), never
with the formula under test, so a conversion off by a factor of 1000, with the sign flipped or
ignoring the field fails here. The boundaries are pinned: a deadline exactly now, 1 ms past and
1 ms ahead.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from schemas.codec import decode_request, encode_request
from workers.engine.deadlines import (
    DeadlineWatch,
    engine_deadline,
    expire_if_late,
    expired,
    expired_despite_ok,
    late_by,
    ms_past_deadline_at_intake,
    would_miss,
)
from workers.engine.types import FinishReason, GenerationResult, Timings

NOW_MS = 1_700_000_000_000  # 2023-11-14T22:13:20Z
MONO = 5_000.0  # the engine's monotonic clock at the same moment (seconds)


@pytest.mark.parametrize(
    ("deadline_ms", "expected"),
    [
        (NOW_MS + 2_500, 5_002.5),  # 2.5 s ahead
        (NOW_MS + 1, 5_000.001),  # just ahead
        (NOW_MS, 5_000.0),  # exactly now
        (NOW_MS - 1, 4_999.999),  # just past
        (NOW_MS - 60_000, 4_940.0),  # a minute past: the monotonic past
        (NOW_MS + 3_600_000, 8_600.0),  # an hour ahead
    ],
)
def test_engine_deadline_exact_values(deadline_ms: int, expected: float) -> None:
    got = engine_deadline(deadline_ms, now_ms=NOW_MS, now_monotonic=MONO)
    assert got == pytest.approx(expected, abs=1e-9)


def test_no_deadline_stays_none() -> None:
    assert engine_deadline(None, now_ms=NOW_MS, now_monotonic=MONO) is None


def test_engine_deadline_of_the_avro_field_matches_datetime_arithmetic() -> None:
    """The field as a client writes it (an aware datetime, or epoch millis), decoded by the
    worker's codec, lands on the engine's clock exactly as far ahead as datetimes say."""
    now = datetime.fromtimestamp(NOW_MS / 1000, tz=UTC)
    for ahead in (timedelta(milliseconds=1), timedelta(seconds=7.25), timedelta(minutes=3)):
        request: dict[str, Any] = {
            "request_id": "r",
            "conversation_id": None,
            "source_lang": "en",
            "target_lang": "de",
            "text": "hi",
            "created_at": now,
            "deadline": now + ahead,
            "reply_topic": "tolk.replies",
            "metadata": {},
        }
        deadline_ms = decode_request(encode_request(request))["deadline"]
        got = engine_deadline(deadline_ms, now_ms=NOW_MS, now_monotonic=MONO)
        assert got == pytest.approx(MONO + ahead.total_seconds(), abs=1e-9)


@pytest.mark.parametrize(
    ("deadline_ms", "expected"),
    [
        (NOW_MS, 0),  # exactly now: no time left to translate in
        (NOW_MS - 1, 1),  # just past
        (NOW_MS - 5_000, 5_000),
        (NOW_MS + 1, None),  # just ahead: may still be translated
        (None, None),  # no deadline
    ],
)
def test_intake_rule(deadline_ms: int | None, expected: int | None) -> None:
    assert ms_past_deadline_at_intake(deadline_ms, NOW_MS) == expected


@pytest.mark.parametrize(
    ("deadline", "finished_at", "expected"),
    [
        (100.0, 100.0, None),  # at the deadline: in time
        (100.0, 100.001, 0.001),  # just past
        (100.0, 99.999, None),  # just ahead
        (None, 1e12, None),  # no deadline
        (NOW_MS, NOW_MS + 1, 1),  # epoch millis work the same
    ],
)
def test_late_by(deadline: float | None, finished_at: float, expected: float | None) -> None:
    got = late_by(deadline, finished_at)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected, abs=1e-9)


def test_ok_past_the_deadline_goes_out_expired() -> None:
    assert expired_despite_ok(NOW_MS - 250, NOW_MS) == (
        "translated 250 ms after the request's deadline"
    )
    assert expired_despite_ok(NOW_MS - 1, NOW_MS) == "translated 1 ms after the request's deadline"
    assert expired_despite_ok(NOW_MS, NOW_MS) is None  # finished at the deadline: OK
    assert expired_despite_ok(NOW_MS + 1, NOW_MS) is None
    assert expired_despite_ok(None, NOW_MS) is None


@pytest.mark.parametrize(
    ("deadline", "now", "expected"),
    [
        (100.0, 99.999, False),  # time left
        (100.0, 100.0, True),  # exactly now: no time left
        (100.0, 100.001, True),
        (None, 1e12, False),  # no deadline never expires
    ],
)
def test_expired_is_no_time_left(deadline: float | None, now: float, expected: bool) -> None:
    assert expired(deadline, now) is expected


@pytest.mark.parametrize(
    ("deadline", "now", "needed", "expected"),
    [
        (10.0, 8.0, 2.0, False),  # finishes exactly at the deadline: in time
        (10.0, 8.0, 2.001, True),  # just past
        (10.0, 8.0, 0.5, False),
        (10.0, 10.0, 0.0, False),  # no work at the deadline: in time (expired() says no time)
        (None, 8.0, 1e9, False),
    ],
)
def test_would_miss(deadline: float | None, now: float, needed: float, expected: bool) -> None:
    assert would_miss(deadline, now, needed) is expected


def _result(reason: FinishReason, text: str = "Hallo", tokens_out: int = 3) -> GenerationResult:
    return GenerationResult(
        request_id="r",
        token_ids=[1] * tokens_out,
        tokens_out=tokens_out,
        text=text,
        finish_reason=reason,
        tokens_in=5,
        timings=Timings(),
    )


def test_a_late_ok_becomes_expired_on_the_engine_clock() -> None:
    late = expire_if_late(_result(FinishReason.STOP), deadline=10.0, finished_at=10.25)
    assert (late.finish_reason, late.text) == (FinishReason.EXPIRED, "")
    assert late.error == "finished 250 ms after its deadline"
    length = expire_if_late(_result(FinishReason.LENGTH), deadline=10.0, finished_at=10.001)
    assert length.finish_reason is FinishReason.EXPIRED


def test_an_ok_at_or_before_the_deadline_stays_ok() -> None:
    for finished in (9.0, 10.0):
        kept = expire_if_late(_result(FinishReason.STOP), deadline=10.0, finished_at=finished)
        assert (kept.finish_reason, kept.text, kept.error) == (FinishReason.STOP, "Hallo", "")
    free = expire_if_late(_result(FinishReason.STOP), deadline=None, finished_at=1e9)
    assert free.finish_reason is FinishReason.STOP


def test_a_cancel_at_the_deadline_is_expired_one_before_stays_cancelled() -> None:
    at = expire_if_late(_result(FinishReason.CANCELLED), deadline=10.0, finished_at=10.0)
    assert at.finish_reason is FinishReason.EXPIRED
    assert at.error == "deadline passed while running; stopped after 3 tokens"
    before = expire_if_late(_result(FinishReason.CANCELLED), deadline=10.0, finished_at=9.5)
    assert before.finish_reason is FinishReason.CANCELLED and before.text == "Hallo"
    failed = expire_if_late(_result(FinishReason.ERROR), deadline=10.0, finished_at=11.0)
    assert failed.finish_reason is FinishReason.ERROR  # only OK and CANCELLED are rewritten


def test_deadline_watch_names_each_overdue_live_request_once() -> None:
    watch = DeadlineWatch()
    watch.watch("late", 5.0)
    watch.watch("soon", 7.0)
    watch.watch("done", 4.0)
    watch.finished("done")  # finished before its deadline: never due
    assert watch.due(4.999) == []
    assert watch.due(5.0) == ["late"]  # at its deadline: due (no time left)
    assert watch.due(6.0) == []  # once only
    assert watch.due(100.0) == ["soon"]


def test_the_same_boundary_on_every_clock() -> None:
    """At intake (epoch ms), at admission (monotonic s) and after the run, `deadline == now`
    is the one boundary: no time left to start, but a result finished then is in time."""
    assert ms_past_deadline_at_intake(NOW_MS, NOW_MS) == 0  # expired at intake
    assert expired(MONO, MONO)  # expired at admission
    assert expired_despite_ok(NOW_MS, NOW_MS) is None  # a reply at the deadline: OK
    assert late_by(MONO, MONO) is None
