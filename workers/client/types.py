"""What `workers.client.TranslationClient` hands its caller: the reply and the errors.

`TranslationReply` is a decoded TranslationResult. The errors all derive from
`TranslationError`: `TranslationTimeout` (no reply in time; says whether the broker ever
acknowledged the request), `TranslationNotDelivered` (the request never reached the broker)
and its `TranslationQueueFull` (the producer's local queue stayed full), and
`TranslationFailed` (the worker answered with a status other than OK). Re-exported by
`workers.client`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from schemas.wire import WireResult
from workers import reply_metadata

__all__ = [
    "TranslationError",
    "TranslationFailed",
    "TranslationNotDelivered",
    "TranslationQueueFull",
    "TranslationReply",
    "TranslationTimeout",
]


class TranslationError(RuntimeError):
    """Base of the client's errors."""


class TranslationTimeout(TranslationError, TimeoutError):
    """No reply arrived in time."""

    def __init__(self, request_id: str, waited_s: float, detail: str = "") -> None:
        self.request_id = request_id
        self.waited_s = waited_s
        super().__init__(
            f"no reply to request {request_id} after {waited_s:.1f}s"
            + (f" ({detail})" if detail else "")
        )


class TranslationNotDelivered(TranslationError):
    """The request never reached the broker: its produce or its delivery failed."""

    def __init__(self, request_id: str, topic: str, cause: str) -> None:
        self.request_id = request_id
        self.topic = topic
        self.cause = cause
        super().__init__(f"request {request_id} not delivered to {topic}: {cause}")


class TranslationQueueFull(TranslationNotDelivered):
    """The producer's local queue stayed full for as long as the request could wait."""

    def __init__(self, request_id: str, topic: str, attempts: int, waited_s: float) -> None:
        self.attempts = attempts
        self.waited_s = waited_s
        super().__init__(
            request_id,
            topic,
            f"the producer's local queue full for {waited_s:.1f}s ({attempts} attempts; "
            "more requests in flight than queue.buffering.max.messages, or the broker is "
            "not taking them)",
        )


class TranslationFailed(TranslationError):
    """The worker answered with a status other than OK."""

    def __init__(self, status: str, error: str | None, reply: TranslationReply | None = None):
        self.status = status
        self.error = error
        self.reply = reply
        rid = f" for request {reply.request_id}" if reply else ""
        super().__init__(f"translation {status}{rid}: {error or 'no reason given'}")


@dataclass(frozen=True, slots=True)
class TranslationReply:
    """A decoded TranslationResult."""

    request_id: str
    status: str  # OK / ERROR / REJECTED / EXPIRED
    text: str
    error: str | None
    model_version: str
    source_lang: str
    target_lang: str
    timings: Mapping[str, float]  # queue_ms, prefill_ms, decode_ms, total_ms
    tokens_in: int
    tokens_out: int
    cached_prefix_tokens: int
    worker_id: str
    completed_at: int  # epoch millis
    conversation_id: str | None
    trace_parent: str | None = None  # the worker's request span (its reply's traceparent)
    # how it was made: tolk.cache, tolk.faithful (retried / flagged / withheld), ...
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def withheld(self) -> str | None:
        """The candidate translation the faithfulness checks withheld (an ERROR reply; the
        error says which checks), else None."""
        if self.metadata.get(reply_metadata.FAITHFUL) != "withheld":
            return None
        return self.metadata.get(reply_metadata.FAITHFUL_CANDIDATE, "")

    @classmethod
    def from_wire(cls, r: WireResult, trace_parent: str | None = None) -> TranslationReply:
        return cls(
            request_id=r.request_id,
            status=r.status,
            text=r.text,
            error=r.error,
            model_version=r.model_version,
            source_lang=r.source_lang,
            target_lang=r.target_lang,
            timings=dataclasses.asdict(r.timings),
            tokens_in=r.tokens_in,
            tokens_out=r.tokens_out,
            cached_prefix_tokens=r.cached_prefix_tokens,
            worker_id=r.worker_id,
            completed_at=r.completed_at,
            conversation_id=r.conversation_id,
            trace_parent=trace_parent,
            metadata=dict(r.metadata),
        )
