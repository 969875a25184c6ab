"""TranslationResult version 2 added `metadata` (protected-span outcomes, workers/kafka/replies.py):
records written with version 1 (schemas/translation_result.v1.avsc) still decode with every
codec of the built-in schemas, and a version-1 reader still reads version-2 records."""

from __future__ import annotations

import json
from importlib import resources

from schemas.codec import RESULT, AvroCodec, builtin_schemas, decode_result, schema_fingerprint

V1_RECORD = {
    "request_id": "req-1",
    "status": "OK",
    "text": "Hallo",
    "error": None,
    "model_version": "gemma3-270m",
    "source_lang": "en",
    "target_lang": "de",
    "timings": {"queue_ms": 1.0, "prefill_ms": 2.0, "decode_ms": 3.0, "total_ms": 6.0},
    "tokens_in": 4,
    "tokens_out": 2,
    "cached_prefix_tokens": 0,
    "worker_id": "w",
    "completed_at": 1_764_000_000_000,
    "conversation_id": None,
}


def v1_schema() -> dict:
    return json.loads(
        resources.files("schemas").joinpath("translation_result.v1.avsc").read_text("utf-8")
    )


def test_v1_is_the_current_schema_without_metadata() -> None:
    current = builtin_schemas()[RESULT]
    assert [f["name"] for f in current["fields"]] == [f["name"] for f in v1_schema()["fields"]] + [
        "metadata"
    ]
    assert schema_fingerprint(v1_schema()) != schema_fingerprint(current)


def test_records_written_by_v1_decode_with_empty_metadata() -> None:
    old_writer = AvroCodec({RESULT: v1_schema()})
    data = old_writer.encode(RESULT, V1_RECORD)
    assert data[2:10] == schema_fingerprint(v1_schema())
    assert decode_result(data) == {**V1_RECORD, "metadata": {}}  # the default codec
    assert AvroCodec().decode(RESULT, data)["metadata"] == {}  # any built-in codec


def test_v1_reader_reads_v2_records_without_metadata() -> None:
    old_reader = AvroCodec({RESULT: v1_schema()})
    old_reader.register_writer_schema(builtin_schemas()[RESULT])
    data = AvroCodec().encode(RESULT, {**V1_RECORD, "metadata": {"tolk.protected_spans": "x"}})
    assert old_reader.decode(RESULT, data) == V1_RECORD
