"""Building the records the worker writes: TranslationResult replies and dead letters.

Pure functions over plain values (no Kafka, no metrics) so the reply's fields are decided in
one place: the engine's `GenerationResult` -> a reply with status, text and timings; a request
answered without the engine (rejected, expired, engine refused it) -> a reply with an empty
text and the reason; a record that cannot be answered at all -> a dead letter that carries the
original bytes.

Timings on a reply are measured from the record's broker timestamp (what the client's clock
and the broker share), not from when this worker happened to read it: `queue_ms` covers time
in Kafka, in the worker and in the engine's waiting queue.

An OK that finished past the request's deadline goes out as EXPIRED (`workers.engine.deadlines`,
the one rule the engine side applies too).
"""

from __future__ import annotations

from collections.abc import Mapping

from schemas.codec import encode_dead_letter
from schemas.wire import ResultTimings, WireResult
from workers import reply_metadata
from workers.engine.deadlines import expired_despite_ok
from workers.engine.types import FinishReason, GenerationResult
from workers.kafka.records import ConsumedRecord, InFlight

__all__ = [
    "FINISH_REASON_KEY",
    "STATUS_OF",
    "dead_letter_value",
    "engine_reply",
    "plain_reply",
    "result_record",
]

# Reply metadata key saying a translation stopped at its token cap (replay.quality reads it).
FINISH_REASON_KEY = reply_metadata.FINISH_REASON

# FinishReason -> ResultStatus symbol on the reply.
STATUS_OF: dict[FinishReason, str] = {
    FinishReason.STOP: "OK",
    FinishReason.LENGTH: "OK",
    FinishReason.EXPIRED: "EXPIRED",
    FinishReason.REJECTED: "REJECTED",
    FinishReason.ERROR: "ERROR",
    FinishReason.CANCELLED: "ERROR",
    FinishReason.WITHHELD: "ERROR",  # workers/stages/faithful/stage.py; the candidate is in
    # metadata
    FinishReason.BELOW: "ERROR",  # a partial answer; the cascade never sends one
}


def broker_to_now_ms(rec: ConsumedRecord, now_ms: int) -> float:
    return float(max(0, now_ms - rec.broker_ts_ms))


def result_record(
    rec: ConsumedRecord,
    *,
    worker_id: str,
    status: str,
    text: str,
    error: str | None,
    model_version: str,
    timings: ResultTimings,
    tokens_in: int,
    tokens_out: int,
    cached: int,
    now_ms: int,
    metadata: Mapping[str, str] | None = None,
) -> WireResult:
    """The TranslationResult answering `rec` (encoded by `schemas.wire.write_result`);
    `metadata`: tags about how it was made (the engine result's `notes`)."""
    req = rec.request
    return WireResult(
        request_id=rec.request_id,
        status=status,
        text=text,
        error=error,
        model_version=model_version,
        source_lang=req.source_lang if req is not None else "",
        target_lang=req.target_lang if req is not None else "",
        timings=timings,
        tokens_in=int(tokens_in),
        tokens_out=int(tokens_out),
        cached_prefix_tokens=int(cached),
        worker_id=worker_id,
        completed_at=now_ms,
        conversation_id=req.conversation_id if req is not None else None,
        metadata={str(k): str(v) for k, v in (metadata or {}).items()},
    )


def engine_reply(
    inflight: InFlight,
    result: GenerationResult,
    *,
    worker_id: str,
    model_version: str,
    now_ms: int,
) -> WireResult:
    """The reply to the first record of `inflight` from the engine's result."""
    status = STATUS_OF.get(result.finish_reason, "ERROR")
    first = inflight.records[0]
    total_ms = broker_to_now_ms(first, now_ms)
    # Broker timestamp -> handed to the engine -> admitted by its scheduler.
    queue_ms = max(0, inflight.submitted_ms - first.broker_ts_ms) + 1e3 * result.timings.queue_s
    error = None
    late_error = expired_despite_ok(first.request.deadline if first.request else None, now_ms)
    if status == "OK" and late_error is not None:
        status, error = "EXPIRED", late_error  # never an OK after the deadline
    elif status != "OK":
        error = result.error or f"engine finished with {result.finish_reason.value}"
    return result_record(
        first,
        worker_id=worker_id,
        status=status,
        text=result.text if status == "OK" else "",
        error=error,
        model_version=model_version,
        timings=ResultTimings(
            queue_ms=float(min(queue_ms, total_ms)),
            prefill_ms=result.timings.prefill_s * 1e3,
            decode_ms=result.timings.decode_s * 1e3,
            total_ms=total_ms,
        ),
        tokens_in=result.tokens_in,
        tokens_out=result.tokens_out,
        cached=result.cached_tokens,
        now_ms=now_ms,
        metadata=_reply_metadata(result),
    )


def _reply_metadata(result: GenerationResult) -> Mapping[str, str]:
    """The result's notes, plus `tolk.finish_reason: length` when generation stopped at its
    token cap: a truncated translation is said so in the reply, never silently. A finer reason
    a stage put in the notes (`length_guard`, workers/stages/faithful/stage.py) is kept."""
    if result.finish_reason is not FinishReason.LENGTH:
        return result.notes
    return {FINISH_REASON_KEY: FinishReason.LENGTH.value, **result.notes}


def plain_reply(
    rec: ConsumedRecord,
    *,
    worker_id: str,
    status: str,
    error: str,
    now_ms: int,
    model_version: str = "",
) -> WireResult:
    """A reply without a translation (REJECTED / EXPIRED / ERROR before the engine ran);
    `model_version` is "" (no engine ran), or `"@<arm>"` from an arm's worker."""
    total = broker_to_now_ms(rec, now_ms)
    return result_record(
        rec,
        worker_id=worker_id,
        status=status,
        text="",
        error=error,
        model_version=model_version,
        timings=ResultTimings(queue_ms=total, total_ms=total),
        tokens_in=0,
        tokens_out=0,
        cached=0,
        now_ms=now_ms,
    )


def dead_letter_value(rec: ConsumedRecord, reason: str, detail: str, now_ms: int) -> bytes:
    """The encoded DeadLetter for `rec`: the original bytes, where they came from, and why."""
    return encode_dead_letter(
        {
            "original": rec.value,
            "topic": rec.tp[0],
            "partition": rec.tp[1],
            "offset": rec.offset,
            "reason": reason,
            "exception": detail,
            "failed_at": now_ms,
            "key": rec.key,
        }
    )
