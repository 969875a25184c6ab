"""The typed request and result (schemas/wire.py): their fields are the Avro schemas', in order;
they survive the codec both ways; an old writer's record reads with the defaults; a record that
is not one fails as `SchemaError`, the error the worker dead-letters."""

from __future__ import annotations

import dataclasses

import pytest

from schemas.codec import (
    REQUEST,
    RESULT,
    AvroCodec,
    SchemaError,
    builtin_schemas,
    decode_request,
    encode_request,
    encode_result,
)
from schemas.wire import (
    ResultTimings,
    WireRequest,
    WireResult,
    read_request,
    read_result,
    write_request,
    write_result,
)
from tests.schemas.test_result_metadata import V1_RECORD, v1_schema

REQUEST_VALUE = WireRequest(
    request_id="r-1",
    source_lang="en",
    target_lang="de",
    text="Where is my order?",
    created_at=1_764_000_000_000,
    reply_topic="tolk.replies",
    conversation_id="c-9",
    deadline=1_764_000_005_000,
    model_version="gemma3-270m@a",
    metadata={"bot": "support"},
)


def _field_names(name: str) -> list[str]:
    return [f["name"] for f in builtin_schemas()[name]["fields"]]


def test_fields_are_the_schemas_in_order() -> None:
    assert [f.name for f in dataclasses.fields(WireRequest)] == _field_names(REQUEST)
    assert [f.name for f in dataclasses.fields(WireResult)] == _field_names(RESULT)
    timings = next(f for f in builtin_schemas()[RESULT]["fields"] if f["name"] == "timings")
    assert [f.name for f in dataclasses.fields(ResultTimings)] == [
        f["name"] for f in timings["type"]["fields"]
    ]


def test_request_round_trips_and_matches_the_dict_codec() -> None:
    data = write_request(REQUEST_VALUE)
    assert read_request(data) == REQUEST_VALUE
    assert decode_request(data) == REQUEST_VALUE.to_record()
    # a request written by any producer of the dict form reads the same
    assert read_request(encode_request(REQUEST_VALUE.to_record())) == REQUEST_VALUE


def test_request_defaults_apply_to_a_minimal_record() -> None:
    minimal = {
        k: v
        for k, v in REQUEST_VALUE.to_record().items()
        if k not in ("conversation_id", "deadline", "model_version", "metadata")
    }
    got = read_request(encode_request(minimal))
    assert (got.conversation_id, got.deadline, got.model_version, dict(got.metadata)) == (
        None,
        None,
        None,
        {},
    )


def test_result_round_trips_with_nested_timings() -> None:
    result = WireResult.from_record({**V1_RECORD, "metadata": {"tolk.cache": "l1"}})
    assert result.timings == ResultTimings(1.0, 2.0, 3.0, 6.0)
    assert result.ok
    assert read_result(write_result(result)) == result


def test_a_version_1_result_reads_with_empty_metadata() -> None:
    data = AvroCodec({RESULT: v1_schema()}).encode(RESULT, V1_RECORD)
    got = read_result(data)
    assert dict(got.metadata) == {}
    assert got.request_id == V1_RECORD["request_id"]


def test_what_is_not_a_request_or_result_fails_as_schema_error() -> None:
    with pytest.raises(SchemaError):
        read_request(b"\x00garbage")
    with pytest.raises(SchemaError, match="written as tolk.TranslationResult"):
        read_request(encode_result(V1_RECORD | {"metadata": {}}))
    with pytest.raises(SchemaError, match="no 'reply_topic'"):
        WireRequest.from_record({"request_id": "r", "source_lang": "", "target_lang": "de",
                                 "text": "x", "created_at": 1})  # fmt: skip
    with pytest.raises(SchemaError, match="timings"):
        WireResult.from_record({k: v for k, v in V1_RECORD.items() if k != "timings"})
