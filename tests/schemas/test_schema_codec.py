"""Round trips, malformed input, wire formats and schema evolution of schemas/codec.py."""

import copy
import datetime as dt
import struct

import pytest

from schemas.codec import (
    DEAD_LETTER,
    REQUEST,
    RESULT,
    AvroCodec,
    SchemaError,
    SchemaIds,
    builtin_schemas,
    decode_dead_letter,
    decode_request,
    decode_result,
    encode_dead_letter,
    encode_request,
    encode_result,
    schema_fingerprint,
)

NOW_MS = 1_764_000_000_123

REQUEST_RECORD = {
    "request_id": "req-1",
    "conversation_id": "conv-9",
    "source_lang": "",
    "target_lang": "de",
    "text": "Hello, wörld — 你好",
    "created_at": NOW_MS,
    "deadline": NOW_MS + 5_000,
    "reply_topic": "tolk.replies",
    "model_version": "gemma3-270m@b",
    "metadata": {"tenant": "bot-7", "trace": "abc"},
}

RESULT_RECORD = {
    "request_id": "req-1",
    "status": "OK",
    "text": "Hallo, Welt",
    "error": None,
    "model_version": "gemma3-270m@b",
    "source_lang": "en",
    "target_lang": "de",
    "timings": {"queue_ms": 1.5, "prefill_ms": 20.25, "decode_ms": 80.0, "total_ms": 101.75},
    "tokens_in": 42,
    "tokens_out": 7,
    "cached_prefix_tokens": 32,
    "worker_id": "worker-0",
    "completed_at": NOW_MS + 102,
    "conversation_id": "conv-9",
    "metadata": {"tolk.protected_spans": "restored"},
}

DEAD_LETTER_RECORD = {
    "original": b"\x00\xff not avro",
    "topic": "tolk.requests.de",
    "partition": 2,
    "offset": 2**40,
    "reason": "undecodable",
    "exception": "SchemaError('not a tolk Avro value')",
    "failed_at": NOW_MS,
    "key": b"conv-9",
}


# ---------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "encode, decode, record",
    [
        (encode_request, decode_request, REQUEST_RECORD),
        (encode_result, decode_result, RESULT_RECORD),
        (encode_dead_letter, decode_dead_letter, DEAD_LETTER_RECORD),
    ],
    ids=["request", "result", "dead_letter"],
)
def test_round_trip(encode, decode, record):
    data = encode(record)
    assert data[:2] == b"\xc3\x01"
    assert decode(data) == record


@pytest.mark.parametrize("status", ["OK", "ERROR", "REJECTED", "EXPIRED"])
def test_result_statuses(status):
    record = {**RESULT_RECORD, "status": status, "error": None if status == "OK" else "why"}
    assert decode_result(encode_result(record)) == record


def test_defaults_fill_optional_fields():
    minimal = {
        k: REQUEST_RECORD[k]
        for k in ("request_id", "source_lang", "target_lang", "text", "created_at", "reply_topic")
    }
    decoded = decode_request(encode_request(minimal))
    assert decoded["conversation_id"] is None
    assert decoded["deadline"] is None
    assert decoded["model_version"] is None
    assert decoded["metadata"] == {}


def test_names_resolve_in_three_spellings():
    codec = AvroCodec()
    data = codec.encode("translation_request", REQUEST_RECORD)
    assert codec.decode("TranslationRequest", data) == REQUEST_RECORD
    assert codec.decode(REQUEST, data) == REQUEST_RECORD
    assert codec.writer_of(data) == REQUEST
    assert codec.decode_any(data) == (REQUEST, REQUEST_RECORD)
    with pytest.raises(SchemaError, match="unknown schema"):
        codec.encode("nope", REQUEST_RECORD)


def test_timestamps_accept_datetimes_and_decode_as_requested():
    when = dt.datetime.fromtimestamp(NOW_MS / 1000, tz=dt.UTC)
    data = encode_request({**REQUEST_RECORD, "created_at": when})
    assert decode_request(data)["created_at"] == NOW_MS
    as_datetime = AvroCodec(timestamps="datetime").decode(REQUEST, data)
    assert as_datetime["created_at"] == when


def test_schemas_are_parsed_once():
    assert builtin_schemas() is builtin_schemas()
    assert AvroCodec().schema(REQUEST) is AvroCodec().schema(REQUEST)


# ---------------------------------------------------------------------- bad records


def test_encode_rejects_records_that_do_not_fit():
    with pytest.raises(SchemaError, match="TranslationRequest"):
        encode_request({**REQUEST_RECORD, "text": 42})
    with pytest.raises(SchemaError):
        encode_request({k: v for k, v in REQUEST_RECORD.items() if k != "text"})
    with pytest.raises(SchemaError):
        encode_request({**REQUEST_RECORD, "typo_field": "x"})
    with pytest.raises(SchemaError):
        encode_result({**RESULT_RECORD, "status": "MAYBE"})


# ---------------------------------------------------------------------- malformed bytes


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "not a tolk Avro value"),
        (b'{"request_id": "x"}', "not a tolk Avro value"),
        (b"\xc3\x01\x00\x01", "truncated single-object header"),
        (b"\x00\x00\x00", "truncated Confluent"),
    ],
    ids=["empty", "json", "short-header", "short-confluent-header"],
)
def test_not_avro(data, message):
    with pytest.raises(SchemaError, match=message):
        decode_request(data)


def test_truncated_body():
    data = encode_request(REQUEST_RECORD)
    for cut in (11, len(data) // 2, len(data) - 1):
        with pytest.raises(SchemaError, match="malformed tolk.TranslationRequest") as info:
            decode_request(data[:cut])
        assert info.value.__cause__ is not None  # raised from the size check or fastavro


def test_trailing_garbage():
    with pytest.raises(SchemaError, match="trailing bytes"):
        decode_request(encode_request(REQUEST_RECORD) + b"\x00junk")


def test_unknown_fingerprint():
    data = bytearray(encode_request(REQUEST_RECORD))
    data[2:10] = b"\x01" * 8
    with pytest.raises(SchemaError, match="unknown writer schema fingerprint 0101010101010101"):
        decode_request(bytes(data))


def test_wrong_schema_for_the_bytes():
    with pytest.raises(SchemaError, match="written as tolk.DeadLetter, expected"):
        decode_request(encode_dead_letter(DEAD_LETTER_RECORD))


def test_not_bytes():
    with pytest.raises(SchemaError, match="expected bytes"):
        decode_request("text")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- fingerprints


def _crc64_avro(data: bytes) -> int:
    """CRC-64-AVRO as the Avro specification writes it out."""
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for byte in data:
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    return fp


def test_fingerprint_matches_the_spec():
    assert schema_fingerprint("int") == _crc64_avro(b'"int"').to_bytes(8, "little")
    data = encode_request(REQUEST_RECORD)
    assert data[2:10] == AvroCodec().fingerprint(REQUEST)


def test_fingerprint_ignores_docs_and_defaults_but_not_fields():
    raw = copy.deepcopy(dict(builtin_schemas()[REQUEST]))
    same = copy.deepcopy(raw)
    same["doc"] = "changed doc"
    assert schema_fingerprint(same) == schema_fingerprint(raw)
    changed = copy.deepcopy(raw)
    changed["fields"].append({"name": "x", "type": "int", "default": 0})
    assert schema_fingerprint(changed) != schema_fingerprint(raw)


# ---------------------------------------------------------------------- Confluent format


def test_confluent_wire_format():
    codec = AvroCodec(registry=SchemaIds({REQUEST: 41, RESULT: 42}))
    data = codec.encode(REQUEST, REQUEST_RECORD)
    assert data[:5] == struct.pack(">bI", 0, 41)
    assert codec.decode(REQUEST, data) == REQUEST_RECORD
    # A codec without ids still reads single-object values, but not registry ids.
    assert codec.decode(REQUEST, encode_request(REQUEST_RECORD)) == REQUEST_RECORD
    with pytest.raises(SchemaError, match="unknown Schema Registry id 41"):
        decode_request(data)
    # No id for the dead letter schema: the codec refuses rather than registering one.
    with pytest.raises(SchemaError, match="no Schema Registry id"):
        codec.encode(DEAD_LETTER, DEAD_LETTER_RECORD)


# ---------------------------------------------------------------------- evolution


def _with_added_field() -> dict:
    """TranslationRequest v2: a new optional field with a default."""
    v2 = copy.deepcopy(dict(builtin_schemas()[REQUEST]))
    v2["fields"].append(
        {"name": "priority", "type": ["null", "int"], "default": None, "doc": "new in v2"}
    )
    return v2


def test_new_reader_reads_old_records():
    v2 = _with_added_field()
    old_writer = AvroCodec()  # writes v1, the current schema
    new_reader = AvroCodec({REQUEST: v2})
    new_reader.register_writer_schema(builtin_schemas()[REQUEST])  # v1 is a known writer

    decoded = new_reader.decode(REQUEST, old_writer.encode(REQUEST, REQUEST_RECORD))

    assert decoded == {**REQUEST_RECORD, "priority": None}


def test_old_reader_reads_new_records():
    v2 = _with_added_field()
    new_writer = AvroCodec({REQUEST: v2})
    old_reader = AvroCodec()
    old_reader.register_writer_schema(v2)

    decoded = old_reader.decode(
        REQUEST, new_writer.encode(REQUEST, {**REQUEST_RECORD, "priority": 3})
    )

    assert decoded == REQUEST_RECORD  # the new field is dropped


def test_encode_with_a_raw_writer_schema_registers_it():
    v2 = _with_added_field()
    codec = AvroCodec()
    data = codec.encode(v2, {**REQUEST_RECORD, "priority": 1})
    assert data[2:10] == schema_fingerprint(v2)
    assert codec.decode(REQUEST, data) == REQUEST_RECORD
    # Another process that never saw v2 cannot tell how to read it.
    with pytest.raises(SchemaError, match="unknown writer schema fingerprint"):
        decode_request(data)


def test_old_version_by_registry_id():
    v2 = _with_added_field()
    writer = AvroCodec({REQUEST: v2}, registry=SchemaIds({REQUEST: 7}))
    reader = AvroCodec(registry=SchemaIds({REQUEST: 5}))
    reader.register_writer_schema(v2, schema_id=7)
    assert reader.decode(REQUEST, writer.encode(REQUEST, REQUEST_RECORD)) == REQUEST_RECORD
    with pytest.raises(SchemaError, match="already taken"):
        reader.register_writer_schema(builtin_schemas()[RESULT], schema_id=7)


def test_incompatible_change_is_a_schema_error():
    # A required field without a default cannot be filled from old records.
    v3 = copy.deepcopy(dict(builtin_schemas()[REQUEST]))
    v3["fields"].append({"name": "tenant", "type": "string"})
    reader = AvroCodec({REQUEST: v3})
    reader.register_writer_schema(builtin_schemas()[REQUEST])
    with pytest.raises(SchemaError):
        reader.decode(REQUEST, encode_request(REQUEST_RECORD))
