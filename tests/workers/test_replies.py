"""workers.kafka.replies: how an engine result becomes a reply record."""

from __future__ import annotations

import pytest

from replay.quality import is_truncated
from schemas.wire import WireRequest, WireResult, read_result, write_result
from workers.engine.types import FinishReason, GenerationResult, RequestHandle
from workers.kafka.records import ConsumedRecord, InFlight
from workers.kafka.replies import FINISH_REASON_KEY, engine_reply

SOURCE = "Please send me the tracking number of my order so I can check it myself."


def _reply(result: GenerationResult) -> WireResult:
    rec = ConsumedRecord(
        tp=("tolk.requests.de", 0),
        offset=1,
        key=b"k",
        value=b"",
        lang="de",
        request=WireRequest(
            request_id=result.request_id,
            source_lang="en",
            target_lang="de",
            text=SOURCE,
            created_at=0,
            reply_topic="tolk.replies",
        ),
        broker_ts_ms=1_000,
    )
    inflight = InFlight(
        request_id=result.request_id,
        lang="de",
        handle=RequestHandle(result.request_id, lambda _rid: None),
        records=[rec],
        submitted_ms=1_000,
    )
    return engine_reply(inflight, result, worker_id="w", model_version="m", now_ms=2_000)


def test_a_translation_cut_at_its_token_cap_says_so_in_the_reply() -> None:
    text = "Bitte senden Sie mir die Sendungsnummer meiner Bestellung, damit ich"
    reply = _reply(GenerationResult("r1", [1, 2], text, FinishReason.LENGTH, notes={"n": "1"}))
    assert reply.status == "OK"
    assert reply.metadata == {"n": "1", FINISH_REASON_KEY: "length"}
    decoded = read_result(write_result(reply))
    assert decoded.metadata[FINISH_REASON_KEY] == "length"
    # The replay report counts it as truncated from that key alone (the text is long enough).
    assert is_truncated(SOURCE, decoded.text, decoded.metadata)


@pytest.mark.parametrize("reason", [FinishReason.STOP, FinishReason.ERROR])
def test_other_endings_add_no_finish_reason(reason: FinishReason) -> None:
    reply = _reply(GenerationResult("r2", [1], "Danke.", reason, notes={"n": "1"}))
    assert reply.metadata == {"n": "1"}
