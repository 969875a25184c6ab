"""The guard's events, `RolloutEvent` (schemas/rollout_event.avsc): round trip of an operator's
and a guard's event, the codec's checks, evolution both ways."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from schemas.codec import (
    ROLLOUT_EVENT,
    AvroCodec,
    SchemaError,
    builtin_schemas,
    decode_rollout_event,
    encode_rollout_event,
)
from workers.guard.events import operator_event

DECISION: dict[str, Any] = {
    "event_id": "v2-1/de/1767225600000",
    "rollout_id": "v2-1",
    "language": "de",
    "action": "ROLLBACK",
    "stable_arm": "stable",
    "canary_arm": "v2",
    "share_before": 5.0,
    "share_after": 0.0,
    "steps": [5.0, 25.0, 50.0, 100.0],
    "window_start": 1_767_225_600_000,
    "window_end": 1_767_225_630_000,
    "verdict": "bad",
    "good_streak": 0,
    "bad_streak": 3,
    "reasons": ["P99 5089 ms > SLO 2000 ms; stable 306 ms"],
    "figures": {"canary_requests": 12.0, "canary_p99_ms": 5089.49},
    "decided_at": 1_767_225_632_100,
    "decided_by": "tolk-guard@host",
}


def test_round_trip_of_a_decision_and_an_operator_event():
    data = encode_rollout_event(DECISION)
    assert data[:2] == b"\xc3\x01"
    assert decode_rollout_event(data) == DECISION
    start = operator_event(
        "START",
        rollout_id="v2-1",
        lang="fr",
        stable="stable",
        canary="v2",
        share_before=0,
        share_after=5,
        steps=(5, 100),
        decided_by="op",
        now_ms=1_767_225_600_000,
    )
    assert decode_rollout_event(encode_rollout_event(start)) == start
    assert start["window_start"] is None and start["event_id"].startswith("v2-1/fr/start-")


def test_records_that_do_not_fit_are_schema_errors():
    with pytest.raises(SchemaError):
        encode_rollout_event({**DECISION, "action": "MAYBE"})
    with pytest.raises(SchemaError):
        encode_rollout_event({k: v for k, v in DECISION.items() if k != "decided_at"})


def _with_note_field() -> dict[str, Any]:
    v2 = copy.deepcopy(dict(builtin_schemas()[ROLLOUT_EVENT]))
    v2["fields"].append({"name": "note", "type": ["null", "string"], "default": None})
    return v2


def test_new_reader_reads_old_records_and_old_reader_new_ones():
    new = AvroCodec({ROLLOUT_EVENT: _with_note_field()})
    new.register_writer_schema(builtin_schemas()[ROLLOUT_EVENT])
    assert new.decode(ROLLOUT_EVENT, encode_rollout_event(DECISION)) == {**DECISION, "note": None}
    old = AvroCodec()
    old.register_writer_schema(_with_note_field())
    data = new.encode(ROLLOUT_EVENT, {**DECISION, "note": "x"})
    assert old.decode(ROLLOUT_EVENT, data) == DECISION
