"""Declared sizes are checked before decoding (schemas/limits.py through schemas/codec.py).

The crafted records are written by hand: a valid single-object header, then an Avro body whose
varints declare sizes far beyond what the record holds or the limits allow. Each must become a
`SchemaError` at once, in little time and memory (tracemalloc's peak), naming the field; records
exactly at the limits must still decode.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest

from schemas.codec import REQUEST, AvroCodec, DecodeLimits, SchemaError, default_codec
from schemas.limits import DEFAULT_LIMITS

TWO_GB = 2 * 1024**3
NOW_MS = 1_764_000_000_000


def zigzag(value: int) -> bytes:
    """An Avro long: zig-zag, then a little-endian base-128 varint."""
    encoded = (value << 1) ^ (value >> 63)
    out = bytearray()
    while encoded > 0x7F:
        out.append((encoded & 0x7F) | 0x80)
        encoded >>= 7
    out.append(encoded)
    return bytes(out)


def avro_string(text: str) -> bytes:
    raw = text.encode()
    return zigzag(len(raw)) + raw


def request_header(codec: AvroCodec) -> bytes:
    return b"\xc3\x01" + codec.fingerprint(REQUEST)


def request_body(*, request_id: bytes | None = None, metadata: bytes | None = None) -> bytes:
    """A TranslationRequest body; `request_id` / `metadata` replace those fields' bytes."""
    return b"".join(
        [
            request_id if request_id is not None else avro_string("req-1"),
            zigzag(0),  # conversation_id: null branch
            avro_string("en"),
            avro_string("de"),
            avro_string("hello"),
            zigzag(NOW_MS),  # created_at
            zigzag(0),  # deadline: null branch
            avro_string("tolk.replies"),
            zigzag(0),  # model_version: null
            metadata if metadata is not None else zigzag(0),  # empty map
        ]
    )


def request(text: str = "hello", metadata: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "request_id": "req-1",
        "source_lang": "en",
        "target_lang": "de",
        "text": text,
        "created_at": NOW_MS,
        "reply_topic": "tolk.replies",
        "metadata": metadata or {},
    }


def rejected_cheaply(decode: Callable[[], Any], match: str) -> SchemaError:
    """Run `decode`, expect a SchemaError matching `match`, in < 0.5 s and < 1 MiB peak."""
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(SchemaError, match=match) as info:
            decode()
        elapsed = time.perf_counter() - started
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 0.5, f"took {elapsed:.3f}s"
    assert peak < 1 << 20, f"peak allocation {peak} bytes"
    return info.value


# ---------------------------------------------------------------------- crafted records


def test_a_declared_2gb_string_is_rejected_without_allocating_it():
    codec = default_codec()
    data = request_header(codec) + request_body(request_id=zigzag(TWO_GB) + b"x" * 16)
    assert len(data) < 100
    error = rejected_cheaply(
        lambda: codec.decode(REQUEST, data), r"rejected tolk\.TranslationRequest body"
    )
    assert "request_id" in str(error)
    assert f"{TWO_GB}-byte string" in str(error)
    assert f"limit of {DEFAULT_LIMITS.max_string_bytes} bytes" in str(error)


def test_a_map_declaring_two_billion_entries_is_rejected_before_any_entry():
    codec = default_codec()
    metadata = zigzag(2**31) + avro_string("k") + avro_string("v")
    data = request_header(codec) + request_body(metadata=metadata)
    error = rejected_cheaply(lambda: codec.decode(REQUEST, data), "map of 2147483648")
    assert "metadata" in str(error)


def test_a_map_block_with_a_byte_size_beyond_the_data_is_malformed():
    codec = default_codec()
    metadata = zigzag(-1) + zigzag(TWO_GB) + avro_string("k") + avro_string("v") + zigzag(0)
    data = request_header(codec) + request_body(metadata=metadata)
    rejected_cheaply(lambda: codec.decode(REQUEST, data), "malformed.*map block")


def test_an_array_of_nulls_is_bounded_by_the_item_limit():
    # Items that take no bytes: only the count limit stops a decoder from building 2**30 Nones.
    schema = {
        "type": "record",
        "name": "Nulls",
        "namespace": "test",
        "fields": [{"name": "items", "type": {"type": "array", "items": "null"}}],
    }
    codec = AvroCodec({"test.Nulls": schema})
    header = b"\xc3\x01" + codec.fingerprint("test.Nulls")
    error = rejected_cheaply(
        lambda: codec.decode("test.Nulls", header + zigzag(2**30) + zigzag(0)),
        "array of 1073741824",
    )
    assert "items" in str(error)
    # ... and within the limit the same shape decodes.
    ok = codec.decode("test.Nulls", header + zigzag(3) + zigzag(0))
    assert ok == {"items": [None, None, None]}


def test_negative_lengths_and_bad_union_branches_are_malformed():
    codec = default_codec()
    header = request_header(codec)
    negative = header + request_body(request_id=zigzag(-5))
    with pytest.raises(SchemaError, match="malformed.*request_id: a negative length"):
        codec.decode(REQUEST, negative)
    bad_branch = header + avro_string("req-1") + zigzag(7) + request_body()[7:]
    with pytest.raises(SchemaError, match=r"conversation_id: union branch 7 out of range"):
        codec.decode(REQUEST, bad_branch)


def test_recursion_is_bounded_by_the_depth_limit():
    schema = {
        "type": "record",
        "name": "Node",
        "namespace": "test",
        "fields": [{"name": "next", "type": ["null", "Node"]}],
    }
    codec = AvroCodec({"test.Node": schema}, limits=DecodeLimits(max_depth=8))
    header = b"\xc3\x01" + codec.fingerprint("test.Node")

    def chain(links: int) -> bytes:  # `links` nested nodes, then null
        return header + zigzag(1) * links + zigzag(0)

    assert codec.decode("test.Node", chain(3)) == {"next": {"next": {"next": {"next": None}}}}
    with pytest.raises(SchemaError, match="nested deeper than 8 levels"):
        codec.decode("test.Node", chain(50))


# ---------------------------------------------------------------------- at the limits


def test_a_record_exactly_at_the_limits_decodes_and_one_more_is_rejected():
    limits = DecodeLimits(max_string_bytes=1000, max_collection_items=5)
    codec = AvroCodec(limits=limits)
    at_limit_text = "ü" * 500  # 1000 bytes of UTF-8: the limit counts bytes
    at_limit_meta = {f"k{i}": "v" for i in range(5)}
    record = request(at_limit_text, at_limit_meta)
    decoded = codec.decode(REQUEST, codec.encode(REQUEST, record))
    assert decoded["text"] == at_limit_text and decoded["metadata"] == at_limit_meta

    with pytest.raises(SchemaError, match="text: declares a 1001-byte string"):
        codec.decode(REQUEST, codec.encode(REQUEST, request(at_limit_text + "x", at_limit_meta)))
    too_many = {**at_limit_meta, "k5": "v"}
    with pytest.raises(SchemaError, match="metadata: declares a map of 6"):
        codec.decode(REQUEST, codec.encode(REQUEST, request("hi", too_many)))


def test_the_default_limits_pass_a_max_size_text():
    codec = default_codec()
    text = "a" * DEFAULT_LIMITS.max_string_bytes
    decoded = codec.decode(REQUEST, codec.encode(REQUEST, request(text)))
    assert len(decoded["text"]) == DEFAULT_LIMITS.max_string_bytes
    with pytest.raises(SchemaError, match="over the limit"):
        codec.decode(REQUEST, codec.encode(REQUEST, request(text + "a")))


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_string_bytes must be >= 1"):
        DecodeLimits(max_string_bytes=0)
    assert AvroCodec(limits=DecodeLimits(max_depth=4)).limits.max_depth == 4
