"""The request and the reply as typed values: decoded once, at the edge.

A TranslationRequest read off a request topic becomes a `WireRequest`, a TranslationResult
read off a reply topic a `WireResult` (`read_request`, `read_result`); the worker builds its
replies, and the client and the replay job their requests, as these types and encode them with
`write_result` / `write_request`. Outside `schemas/` no product module holds a request or a
result as a dict or reads one of their fields by string key (tests/test_architecture.py checks
it), so renaming a schema field is a type error at every use, not a `KeyError` in production.

The field names of each class are the Avro schema's (`translation_request.avsc`,
`translation_result.avsc`), in its order (keyword-only, so optional fields may sit where the
schema puts them); `tests/schemas/test_wire.py` holds them equal. The
conversion is generic (`dataclasses.fields`): a field added to both is carried without code
here. Timestamps are epoch milliseconds, as the default codec decodes them. Decoding an old
writer's record (a version 1 result without `metadata`) resolves to the current schema first,
so the defaults apply (`schemas/codec.py`).

A record the codec decoded always fits (Avro checked the types); `from_record` still raises
`SchemaError` for a missing field, so a hand-made mapping fails as a bad record would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from schemas.codec import REQUEST, RESULT, AvroCodec, SchemaError, default_codec

__all__ = [
    "ResultTimings",
    "WireRequest",
    "WireResult",
    "read_request",
    "read_result",
    "write_request",
    "write_result",
]

_T = TypeVar("_T")


def _from_record(cls: type[_T], record: Mapping[str, Any]) -> _T:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in record:
            kwargs[f.name] = record[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SchemaError(f"{cls.__name__} record has no {f.name!r}")
    return cls(**kwargs)


@dataclass(frozen=True, slots=True, kw_only=True)
class WireRequest:
    """A TranslationRequest (`translation_request.avsc`; its docs say what each field means)."""

    request_id: str  # "" is refused at intake: no reply could be correlated
    conversation_id: str | None = None
    source_lang: str  # "" = detect
    target_lang: str
    text: str
    created_at: int  # epoch ms
    deadline: int | None = None  # epoch ms; None = none
    reply_topic: str
    model_version: str | None = None  # a wanted model version or A/B arm; None = any
    metadata: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> WireRequest:
        return _from_record(cls, record)

    def to_record(self) -> dict[str, Any]:
        record = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        record["metadata"] = dict(self.metadata)
        return record


@dataclass(frozen=True, slots=True)
class ResultTimings:
    """Milliseconds spent in each phase on the worker (the result's `timings` record)."""

    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    total_ms: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class WireResult:
    """A TranslationResult (`translation_result.avsc`)."""

    request_id: str
    status: str  # OK / ERROR / REJECTED / EXPIRED
    text: str  # "" unless OK
    error: str | None
    model_version: str  # the version (A/B arm) that answered; "" when none ran
    source_lang: str
    target_lang: str
    timings: ResultTimings
    tokens_in: int
    tokens_out: int
    cached_prefix_tokens: int
    worker_id: str
    completed_at: int  # epoch ms
    conversation_id: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> WireResult:
        timings = record.get("timings")
        if not isinstance(timings, Mapping):
            raise SchemaError(f"TranslationResult record has no timings record: {timings!r}")
        return _from_record(cls, {**record, "timings": _from_record(ResultTimings, timings)})

    def to_record(self) -> dict[str, Any]:
        record = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        record["timings"] = dataclasses.asdict(self.timings)
        record["metadata"] = dict(self.metadata)
        return record


def read_request(data: bytes, codec: AvroCodec | None = None) -> WireRequest:
    """Decode a request topic's value (`SchemaError` when it is not a TranslationRequest);
    `codec`: one with a registry's ids (`schemas/codec.py`), default the built-in one."""
    return WireRequest.from_record((codec or default_codec()).decode(REQUEST, data))


def write_request(
    request: WireRequest, codec: AvroCodec | None = None, *, subject: str | None = None
) -> bytes:
    """Encode for a request topic; `subject` (`<topic>-value`, with a registry codec): the
    Confluent wire format with the registry's id, else single-object encoding."""
    return (codec or default_codec()).encode(REQUEST, request.to_record(), subject=subject)


def read_result(data: bytes, codec: AvroCodec | None = None) -> WireResult:
    """Decode a reply topic's value (`SchemaError` when it is not a TranslationResult)."""
    return WireResult.from_record((codec or default_codec()).decode(RESULT, data))


def write_result(
    result: WireResult, codec: AvroCodec | None = None, *, subject: str | None = None
) -> bytes:
    """Encode for a reply topic (`subject`: as `write_request`'s)."""
    return (codec or default_codec()).encode(RESULT, result.to_record(), subject=subject)
