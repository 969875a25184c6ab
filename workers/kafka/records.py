"""What the worker holds between reading a record and answering it.

A record remembers the assignment generation of its partition when it was taken
(`OffsetTracker.generation`): a partition revoked and assigned again starts a new generation,
so the worker can tell "still mine, same assignment" from "mine again" from "gone" when the
record's result comes back (`PartitionState.ownership`). An in-flight request counts the engine
runs it had (`attempts`): a failed run (ERROR) is retried up to `Settings.max_attempts`
(workers.kafka.engine_retries).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from schemas.wire import WireRequest
from workers.engine.types import GenerationResult, RequestHandle
from workers.tracing import RequestTrace

__all__ = ["ConsumedRecord", "InFlight", "request_trace"]


@dataclass(slots=True)
class ConsumedRecord:
    """One consumed record the worker owes an answer (a reply or a dead letter)."""

    tp: tuple[str, int]  # (topic, partition)
    offset: int
    key: bytes | None
    value: bytes  # the raw record value (dead letters carry it byte for byte)
    lang: str  # the topic's language: the metric label and the intake bucket
    broker_ts_ms: int  # record timestamp (broker or create time); receive time if absent
    request: WireRequest | None = None  # the decoded TranslationRequest (None: not decoded)
    generation: int = 0  # the partition's assignment generation when the record was taken
    trace_parent: str | None = None  # its W3C traceparent header (read with tracing on)
    taken_ns: int = 0  # epoch ns when the worker took it from the consumer (lags, tracing)

    @property
    def request_id(self) -> str:
        return self.request.request_id if self.request is not None else ""

    @property
    def registry_format(self) -> bool:
        """Written in the Confluent wire format (a Schema Registry serializer's `00` + id)."""
        return self.value[:1] == b"\x00"

    @property
    def reply_topic(self) -> str:
        """Where its reply goes ("" for a record not decoded: it gets a dead letter only)."""
        return self.request.reply_topic if self.request is not None else ""


@dataclass(slots=True)
class InFlight:
    """A request in the engine, and every record waiting for its answer (redeliveries of the
    same request id that arrived meanwhile join it instead of being translated twice)."""

    request_id: str
    lang: str  # the topic's language (intake bucket)
    handle: RequestHandle  # the engine's future
    records: list[ConsumedRecord]  # the first one is answered (and stored) first
    submitted_ms: int  # wall clock when handed to the engine
    submitted_ns: int = 0  # the same instant in epoch ns (the consume-to-schedule lag)
    attempts: int = 1  # engine runs so far (a failed run is retried: workers.kafka.engine_retries)


def request_trace(
    rec: ConsumedRecord, engine: tuple[InFlight, GenerationResult] | None, status: str
) -> RequestTrace:
    """The timestamps of `rec`'s way through the worker, for its spans (workers/tracing.py)."""
    now_ns = time.time_ns()
    req = RequestTrace(
        parent=rec.trace_parent,
        lang=rec.lang,
        request_id=rec.request_id,
        broker_ns=rec.broker_ts_ms * 1_000_000,
        taken_ns=rec.taken_ns or now_ns,
        produced_ns=now_ns,
        status=status,
    )
    if engine is not None:
        inflight, result = engine
        req.submitted_ns = inflight.submitted_ms * 1_000_000
        req.queue_s = result.timings.queue_s
        req.prefill_s = result.timings.prefill_s
        req.decode_s = result.timings.decode_s
        req.completed_ns = now_ns
    return req
