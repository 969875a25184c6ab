"""What the guard counts (workers/guard/windows.py) and how its core judges a table's windows
(workers/guard/core.py's GuardCore, without faust): bad replies counted and ignored, each
record counted once, percentiles from the histogram."""

from __future__ import annotations

import math
from typing import Any

import pytest

from schemas.wire import WireResult, write_result
from workers.fairness.policy import LanguagePolicy
from workers.guard import core as core_module
from workers.guard.core import GuardConfig, GuardCore
from workers.guard.policy import GuardPolicy, RolloutState
from workers.guard.windows import (
    Ignored,
    Observation,
    add_observation,
    bucket_upper_ms,
    merge_counts,
    observe,
    percentile_ms,
    stats_of,
    window_start_ms,
)

NOW = 1_800_000_000_000


def reply(**over: Any) -> WireResult:
    return WireResult.from_record(
        {
            "request_id": "r1",
            "status": "OK",
            "text": "x",
            "error": None,
            "model_version": "smol@v2",
            "source_lang": "en",
            "target_lang": "de",
            "timings": {"queue_ms": 1.0, "prefill_ms": 1.0, "decode_ms": 1.0, "total_ms": 420.0},
            "tokens_in": 1,
            "tokens_out": 1,
            "cached_prefix_tokens": 0,
            "worker_id": "w",
            "completed_at": NOW,
            "conversation_id": None,
            "metadata": {},
            **over,
        }
    )


def test_a_reply_becomes_an_observation() -> None:
    assert observe(reply(), record_ts_ms=NOW + 5) == Observation("de", "v2", "OK", 420.0)


def test_malformed_no_arm_and_clock_skew_are_ignored_with_a_reason() -> None:
    assert observe(None, record_ts_ms=NOW).reason == "malformed"  # type: ignore[union-attr]
    cases = {
        "malformed": [
            reply(status="MAYBE"),
            reply(target_lang=""),
            reply(model_version="smol@bad name"),
        ],
        "no_arm": [reply(model_version="smol")],
        "clock_skew": [
            reply(timings={"total_ms": -5.0}),
            reply(timings={"total_ms": math.inf}),
            reply(timings={"total_ms": 5e9}),
            reply(completed_at=NOW - 600_000),
        ],
    }
    for reason, replies in cases.items():
        for r in replies:
            out = observe(r, record_ts_ms=NOW)
            assert isinstance(out, Ignored) and out.reason == reason, (r, out)


def test_a_record_is_counted_once_even_when_read_again() -> None:
    obs = Observation("de", "v2", "ERROR", 100.0)
    c1 = add_observation(None, obs, offset=7)
    assert c1 is not None and c1["requests"] == 1 and c1["status"]["ERROR"] == 1
    assert add_observation(c1, obs, offset=7) is None  # read again after a restart
    assert add_observation(c1, obs, offset=3) is None
    c2 = add_observation(c1, obs, offset=8)
    assert c2 is not None and c2["requests"] == 2 and c2["last_offset"] == 8


def test_withheld_and_flagged_answers_are_counted_apart_from_service_errors() -> None:
    """Issue #28: an answer the faithfulness checks withheld is an ERROR reply on the wire, but
    a quality outcome for the guard; one they sent flagged is an OK reply counted as suspect."""
    withheld = reply(status="ERROR", metadata={"tolk.faithful": "withheld"})
    flagged = reply(metadata={"tolk.faithful": "flagged"})
    retried = reply(metadata={"tolk.faithful": "retried"})  # clean after the retry: not suspect
    failed = reply(status="ERROR", error="model crashed")
    obs = [observe(r, record_ts_ms=NOW) for r in (withheld, flagged, retried, failed)]
    assert [o.quality for o in obs if isinstance(o, Observation)] == ["withheld", "flagged", "", ""]
    counts: dict[str, Any] | None = None
    for i, o in enumerate(obs * 2):
        assert isinstance(o, Observation)
        counts = add_observation(counts, o, i)
    merged = merge_counts([counts or {}, counts or {}])
    s = stats_of(merged, lang="de", arm="v2", start_ms=0, window_ms=30_000)
    assert (s.requests, s.errors, s.withheld, s.flagged) == (16, 4, 4, 4)
    assert s.error_rate == 0.25 and s.suspect_rate == 0.5
    figures = s.figures("canary")
    assert figures["canary_withheld_rate"] == 0.25 and figures["canary_flagged_rate"] == 0.25
    # a table value written before these counts existed reads as none withheld
    old = {"requests": 2, "status": {"ERROR": 2}, "hist": {"300": 2}, "last_offset": 5}
    s_old = stats_of(old, lang="de", arm="v2", start_ms=0, window_ms=30_000)
    assert (s_old.errors, s_old.withheld, s_old.flagged) == (2, 0, 0)


def test_percentiles_from_the_histogram_are_within_two_percent() -> None:
    counts: dict[str, Any] | None = None
    for i, ms in enumerate(range(10, 1010, 10)):  # 10 .. 1000 ms, 100 values
        counts = add_observation(counts, Observation("de", "v2", "OK", float(ms)), i)
    assert counts is not None
    p95, p99 = percentile_ms(counts["hist"], 0.95), percentile_ms(counts["hist"], 0.99)
    assert 950 <= p95 <= 950 * 1.02 and 990 <= p99 <= 990 * 1.02
    assert math.isnan(percentile_ms({}, 0.99)) and bucket_upper_ms(0) == 1.0


def test_partitions_are_summed_per_window() -> None:
    a = add_observation(None, Observation("de", "v2", "OK", 100.0), 0)
    b = add_observation(None, Observation("de", "v2", "EXPIRED", 5000.0), 0)
    assert a is not None and b is not None
    s = stats_of(merge_counts([a, b]), lang="de", arm="v2", start_ms=0, window_ms=30_000)
    assert (s.requests, s.expired, s.expired_rate, s.window_end_ms) == (2, 1, 0.5, 30_000)
    assert s.p99_ms >= 5000 and s.p95_ms >= 5000
    assert window_start_ms(61_234, 30_000) == 60_000


class _Writer:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.shares: list[dict[str, float]] = []

    def write_event(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def write_shares(self, state: RolloutState, *, updated_by: str) -> None:
        self.shares.append(state.shares())


def _core(window_s: float = 2.0) -> tuple[GuardCore, _Writer]:
    config = GuardConfig(
        bootstrap="unused",
        kafka_config={},
        replies_topic="r",
        events_topic="e",
        control_topic="c",
        policy=GuardPolicy(
            decision="windows", window_s=window_s, min_requests=3, bad_windows_to_rollback=1
        ),
        slos={"de": LanguagePolicy(1.0, 2.0, 10, 10)},
        grace_s=1.0,
    )
    writer = _Writer()
    core = GuardCore(config, writer=writer)
    core.book.states["de"] = RolloutState("r1", "de", "stable", "v2", 5.0, judge_from_ms=NOW)
    return core, writer


def slow(ms: float) -> dict[str, float]:
    return {"queue_ms": 1.0, "prefill_ms": 1.0, "decode_ms": 1.0, "total_ms": ms}


def test_core_counts_judges_and_ignores_unknown_arms_and_bad_records() -> None:
    core, writer = _core()
    table: dict[tuple[str, tuple[float, float]], dict[str, Any]] = {}
    window = (NOW / 1000, NOW / 1000 + 1.9)

    def feed(value: bytes | None, offset: int, partition: int = 0) -> None:
        out = core.on_reply(
            value,
            partition=partition,
            offset=offset,
            ts_ms=NOW + 10,
            current=lambda key: table.get((key, window), {}),
        )
        if out is not None:
            table[(out[0], window)] = out[1]

    for i in range(4):
        feed(write_result(reply(timings=slow(5000.0))), i)  # canary, slow
        feed(write_result(reply(model_version="smol@stable", timings=slow(300.0))), i, partition=1)
    feed(write_result(reply(model_version="smol@v3")), 10)  # an arm of no rollout
    feed(b"\x00not avro", 11)
    feed(write_result(reply(completed_at=NOW - 3_600_000)), 12)
    feed(write_result(reply(timings=slow(5000.0))), 3)  # offset 3 again: not counted
    assert core.ignored == {"malformed": 1, "clock_skew": 1}
    # the window is not due until its end + grace and every partition is read past it
    assert core.tick(list(table.items()), {0: 13, 1: 4}, now_ms=NOW + 2500) == 0
    assert core.tick(list(table.items()), {0: 14, 1: 4}, now_ms=NOW + 3100) == 0  # behind
    assert core.tick(list(table.items()), {0: 13, 1: 4}, now_ms=NOW + 3100) == 1
    assert core.ignored["unknown_arm"] == 1
    [event] = writer.events
    assert event["action"] == "ROLLBACK" and event["figures"]["canary_requests"] == 4
    assert event["figures"]["stable_requests"] == 4 and writer.shares == [
        {"stable": 100.0, "v2": 0.0}
    ]
    assert core.tick(list(table.items()), {0: 13, 1: 4}, now_ms=NOW + 9000) == 0  # rolled back


@pytest.mark.parametrize("lost_at_seek", [False, True], ids=["seek", "first-record-lost"])
def test_a_committed_offset_past_the_restored_counts_is_read_again_and_counted_once(
    lost_at_seek: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faust committed offset 6 of partition 0 while the changelog held the counts up to offset
    2 (a SIGKILL lost the rest): `rewind` sends partition 0 back to 3 (less `REREAD_MARGIN`, 2
    here), no window is judged before those replies are read again, and the window's counts end
    up as if never killed; also when the first record after the seek never reaches the guard
    (seen once in CI): the margin's records are counted already."""
    monkeypatch.setattr(core_module, "REREAD_MARGIN", 2)
    window = (NOW / 1000, NOW / 1000 + 1.9)
    records = [
        (p, off, write_result(reply(timings=slow(400.0 + off))))
        for p, n in ((0, 6), (1, 4))
        for off in range(n)
    ]

    def feed(core: GuardCore, table: dict[Any, dict[str, Any]], p: int, off: int, v: bytes) -> None:
        out = core.on_reply(
            v, partition=p, offset=off, ts_ms=NOW + 10, current=lambda k: table.get((k, window), {})
        )
        if out is not None:
            table[(out[0], window)] = out[1]

    uninterrupted, _ = _core()
    whole: dict[Any, dict[str, Any]] = {}
    for p, off, v in records:
        feed(uninterrupted, whole, p, off, v)

    killed, _ = _core()
    restored: dict[Any, dict[str, Any]] = {}
    for p, off, v in records:
        if (p, off) in ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (1, 3)):
            feed(killed, restored, p, off, v)  # the updates that reached the changelog
    restarted, _ = _core()
    restarted.read_upto.update({0: 6, 1: 4})  # the committed offsets, as build_app sets them
    back = restarted.rewind(list(restored.items()), {0: 6, 1: 4})
    assert back == {0: 1}  # 3 less the margin; partition 1 reaches its committed offset
    assert restarted.read_upto == {0: 1, 1: 4}
    # not caught up on partition 0 until offsets 1..5 are read again
    assert not restarted.caught_up(NOW + 2000, {0: 6, 1: 4})
    start = {0: 6, 1: 4} | back  # where faust seeks: the committed offsets, as moved back
    for p, off, v in records:
        if off >= start[p] and not (lost_at_seek and (p, off) == (0, start[0])):
            feed(restarted, restored, p, off, v)
    assert restarted.caught_up(NOW + 2000, {0: 6, 1: 4})
    assert restarted.window_counts(list(restored.items()), NOW) == uninterrupted.window_counts(
        list(whole.items()), NOW
    )
    assert restarted.window_counts(list(restored.items()), NOW)[("de", "v2")]["requests"] == 10
    # a table whose counts are at or past the committed offsets: nothing to read again
    assert restarted.rewind(list(restored.items()), {0: 6, 1: 3}) == {}
