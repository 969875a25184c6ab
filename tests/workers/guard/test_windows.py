"""What the guard counts (workers/guard/windows.py) and how its core judges a table's windows
(workers/guard/core.py's GuardCore, without faust): bad replies counted and ignored, each
record counted once, percentiles from the histogram."""

from __future__ import annotations

import math
from typing import Any

from schemas.codec import encode_result
from workers.fairness.policy import LanguagePolicy
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


def reply(**over: Any) -> dict[str, Any]:
    return {
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


def test_a_reply_becomes_an_observation() -> None:
    assert observe(reply(), record_ts_ms=NOW + 5) == Observation("de", "v2", "OK", 420.0)


def test_malformed_no_arm_and_clock_skew_are_ignored_with_a_reason() -> None:
    assert observe(None, record_ts_ms=NOW).reason == "malformed"  # type: ignore[union-attr]
    cases = {
        "malformed": [
            reply(status="MAYBE"),
            reply(target_lang=""),
            reply(timings={}),
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
        policy=GuardPolicy(window_s=window_s, min_requests=3, bad_windows_to_rollback=1),
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
        feed(encode_result(reply(timings=slow(5000.0))), i)  # canary, slow
        feed(encode_result(reply(model_version="smol@stable", timings=slow(300.0))), i, partition=1)
    feed(encode_result(reply(model_version="smol@v3")), 10)  # an arm of no rollout
    feed(b"\x00not avro", 11)
    feed(encode_result(reply(completed_at=NOW - 3_600_000)), 12)
    feed(encode_result(reply(timings=slow(5000.0))), 3)  # offset 3 again: not counted
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
