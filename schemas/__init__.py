"""Avro schemas of tolk's Kafka values (``*.avsc``, parsed once) and their codec."""

from schemas.codec import (
    DEAD_LETTER,
    REQUEST,
    RESULT,
    AvroCodec,
    SchemaError,
    SchemaIds,
    decode_dead_letter,
    decode_request,
    decode_result,
    default_codec,
    encode_dead_letter,
    encode_request,
    encode_result,
)

__all__ = [
    "DEAD_LETTER",
    "REQUEST",
    "RESULT",
    "AvroCodec",
    "SchemaError",
    "SchemaIds",
    "decode_dead_letter",
    "decode_request",
    "decode_result",
    "default_codec",
    "encode_dead_letter",
    "encode_request",
    "encode_result",
]
