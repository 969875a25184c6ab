"""schemas/registry.py and the codec's registry ids, against an in-memory registry that speaks
the same REST API (tests/schemas/fake_registry.py): what a bot's serializer writes decodes, what
the worker writes carries the id the registry holds, a breaking change is refused with the
registry's own reason, an unreachable registry is a clear error."""

from __future__ import annotations

import base64
import copy
import io
import struct
from typing import Any

import fastavro
import pytest

from schemas.codec import REQUEST, AvroCodec, SchemaError, builtin_schemas
from schemas.registry import RegistryError, SchemaRegistry, value_subject
from schemas.wire import WireRequest
from tests.schemas.fake_registry import serve

REQUEST_SCHEMA = builtin_schemas()[REQUEST]
SUBJECT = value_subject("tolk.requests.de")
RECORD = WireRequest(
    request_id="r-1", source_lang="en", target_lang="de", text="Hello", created_at=1,
    reply_topic="tolk.replies",
).to_record()  # fmt: skip


def with_field(schema: Any, field: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(schema))
    out["fields"] = [*out["fields"], field]
    return out


def confluent_value(schema_id: int, schema: Any, record: dict[str, Any]) -> bytes:
    """What a Confluent-format serializer (the bots' libraries) writes: 00, the id, the body."""
    buf = io.BytesIO()
    buf.write(struct.pack(">bI", 0, schema_id))
    fastavro.schemaless_writer(buf, fastavro.parse_schema(copy.deepcopy(schema)), record)
    return buf.getvalue()


def test_register_look_up_and_fetch_by_id() -> None:
    with serve() as (fake, url):
        registry = SchemaRegistry(url)
        assert registry.lookup(SUBJECT, REQUEST_SCHEMA) is None  # nothing registered yet
        registry.set_compatibility(SUBJECT, "BACKWARD")
        schema_id = registry.register(SUBJECT, REQUEST_SCHEMA)
        assert registry.register(SUBJECT, REQUEST_SCHEMA) == schema_id  # idempotent
        assert registry.lookup(SUBJECT, REQUEST_SCHEMA) == schema_id
        assert registry.schema_by_id(schema_id)["name"] == "TranslationRequest"
        assert registry.subjects() == [SUBJECT]
        assert fake.compatibility == {SUBJECT: "BACKWARD"}


def test_a_breaking_change_is_refused_with_the_registrys_reason() -> None:
    breaking = with_field(REQUEST_SCHEMA, {"name": "tenant", "type": "string"})
    optional = with_field(REQUEST_SCHEMA, {"name": "tenant", "type": ["null", "string"],
                                            "default": None})  # fmt: skip
    with serve() as (_, url):
        registry = SchemaRegistry(url)
        registry.register(SUBJECT, REQUEST_SCHEMA)
        (reason,) = registry.check(SUBJECT, breaking)
        assert "tenant" in reason and "default" in reason
        with pytest.raises(RegistryError, match="incompatible with an earlier schema") as err:
            registry.register(SUBJECT, breaking)
        assert err.value.status == 409
        assert registry.check(SUBJECT, optional) == []
        assert registry.register(SUBJECT, optional) != registry.lookup(SUBJECT, REQUEST_SCHEMA)


def test_a_bots_value_decodes_with_one_registry_call_per_new_id() -> None:
    v2 = with_field(REQUEST_SCHEMA, {"name": "tenant", "type": ["null", "string"],
                                     "default": None})  # fmt: skip
    with serve() as (fake, url):
        registry = SchemaRegistry(url)
        v1_id, v2_id = registry.register(SUBJECT, REQUEST_SCHEMA), registry.register(SUBJECT, v2)
        codec = AvroCodec(ids_from=registry)
        old_bot = confluent_value(v1_id, REQUEST_SCHEMA, RECORD)
        new_bot = confluent_value(v2_id, v2, {**RECORD, "tenant": "acme"})
        fake.calls.clear()
        for _ in range(3):
            assert codec.decode(REQUEST, old_bot) == RECORD
            assert codec.decode(REQUEST, new_bot) == RECORD  # resolved to the reader schema
        assert [c for c in fake.calls if c[1].startswith("/schemas/ids/")] == [
            ("GET", f"/schemas/ids/{v1_id}"),
            ("GET", f"/schemas/ids/{v2_id}"),
        ]
        for _ in range(3):  # an id nobody registered: asked for once, then remembered
            with pytest.raises(SchemaError, match="Schema Registry id 99"):
                codec.decode(REQUEST, confluent_value(99, REQUEST_SCHEMA, RECORD))
        assert fake.calls.count(("GET", "/schemas/ids/99")) == 1


def test_the_codec_writes_the_subjects_id_and_never_registers() -> None:
    with serve() as (fake, url):
        registry = SchemaRegistry(url)
        codec = AvroCodec(ids_from=registry)
        with pytest.raises(SchemaError, match="not registered under subject .*topics create"):
            codec.encode(REQUEST, RECORD, subject=SUBJECT)
        assert not any(path.endswith("/versions") for _, path in fake.calls)
        schema_id = registry.register(SUBJECT, REQUEST_SCHEMA)
        data = codec.encode(REQUEST, RECORD, subject=SUBJECT)
        assert data[:5] == struct.pack(">bI", 0, schema_id)
        assert AvroCodec(ids_from=registry).decode(REQUEST, data) == RECORD
        # without a subject the codec writes single-object encoding as before
        assert codec.encode(REQUEST, RECORD)[:2] == b"\xc3\x01"


def test_credentials_are_sent_and_never_shown_and_an_unreachable_registry_says_so() -> None:
    with serve() as (fake, url):
        host = url.removeprefix("http://")
        registry = SchemaRegistry.from_url(f"http://bot:s3cret@{host}")
        registry.subjects()
        assert fake.auth[-1] == "Basic " + base64.b64encode(b"bot:s3cret").decode()
        assert "s3cret" not in registry.shown_url and "s3cret" not in repr(registry)
        with pytest.raises(ValueError, match="from_url"):
            SchemaRegistry(f"http://bot:s3cret@{host}")
    with pytest.raises(RegistryError, match="not reachable") as err:
        SchemaRegistry(url, timeout_s=1.0).subjects()  # the server is gone
    assert err.value.status == 0
    codec = AvroCodec(ids_from=SchemaRegistry(url, timeout_s=1.0))
    with pytest.raises(SchemaError, match="not reachable"):
        codec.decode(REQUEST, confluent_value(7, REQUEST_SCHEMA, RECORD))
    with pytest.raises(SchemaError, match="was not reached"):  # not asked again for a while
        codec.decode(REQUEST, confluent_value(8, REQUEST_SCHEMA, RECORD))
    with pytest.raises(ValueError, match="http"):
        SchemaRegistry("ftp://x")
