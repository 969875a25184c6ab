"""A worker with a Schema Registry (TOLK_SCHEMA_REGISTRY_URL, issue #45): a request a bot's
registry serializer wrote (the Confluent wire format, the registry's id) is answered in the
same format with the reply subject's id, which the bot's library resolves; a single-object
request is answered as before; a reply whose subject the registry lacks still goes out. The
worker runs on the in-memory Kafka of test_worker_fake_engine.py, the registry is the in-memory
one of tests/schemas/fake_registry.py (the stack's real one: the examples' end-to-end tests)."""

from __future__ import annotations

import struct

from schemas.codec import REQUEST, RESULT, AvroCodec, builtin_schemas
from schemas.registry import SchemaRegistry, value_subject
from schemas.wire import WireRequest, read_result
from tests.schemas.fake_registry import serve
from tests.schemas.test_registry import confluent_value
from tests.workers.fakes import fake_translation
from tests.workers.polling import wait_for
from tests.workers.test_worker_fake_engine import LANGS, make_rig, now_ms, request_bytes
from topics.catalog import REPLIES, catalog
from topics.subjects import register_subjects


def _bot_request(rid: str, schema_id: int) -> bytes:
    record = WireRequest(
        request_id=rid, source_lang="en", target_lang="de", text="where is my parcel",
        created_at=now_ms(), reply_topic=REPLIES,
    ).to_record()  # fmt: skip
    return confluent_value(schema_id, builtin_schemas()[REQUEST], record)


def test_a_bots_request_is_answered_in_its_format_with_the_reply_subjects_id() -> None:
    with serve() as (_, url):
        registry = SchemaRegistry(url)
        register_subjects(registry, catalog(LANGS))
        request_id = registry.lookup(value_subject("tolk.requests.de"), builtin_schemas()[REQUEST])
        reply_id = registry.lookup(value_subject(REPLIES), builtin_schemas()[RESULT])
        assert request_id is not None and reply_id is not None
        rig = make_rig(schema_registry_url=url)
        try:
            rig.send(_bot_request("bot-1", request_id), "de", key=b"bot-1")
            rig.send(request_bytes("plain-1", "where is my parcel"), "de", key=b"plain-1")
            wait_for(lambda: rig.reply_count() == 2, what="2 replies")
        finally:
            rig.worker.stop()
            rig.thread.join(10)
        values = {k: v for k, v in rig.broker.records(REPLIES)}
        bot, plain = values[b"bot-1"], values[b"plain-1"]
        assert bot is not None and plain is not None
        assert bot[:5] == struct.pack(">bI", 0, reply_id)  # as the bot's library reads it
        assert plain[:2] == b"\xc3\x01"  # single-object, as before
        reply = read_result(bot, AvroCodec(ids_from=registry))  # a reader that knows no ids
        assert reply.request_id == "bot-1" and reply.status == "OK"
        assert reply.text == fake_translation("where is my parcel", "de")


def test_a_missing_reply_subject_still_gets_the_answer_out_an_unknown_id_is_a_dead_letter() -> None:
    with serve() as (_, url):
        registry = SchemaRegistry(url)
        # only the request subject: the reply topic's subject is missing
        schema_id = registry.register(value_subject("tolk.requests.de"), builtin_schemas()[REQUEST])
        rig = make_rig(schema_registry_url=url)
        try:
            rig.send(_bot_request("bot-2", schema_id), "de", key=b"bot-2")
            rig.send(_bot_request("bot-3", schema_id + 100), "de", key=b"bot-3")
            wait_for(lambda: rig.reply_count() == 1, what="the reply")
            wait_for(lambda: len(rig.dead_letters()) == 1, what="the dead letter")
            errors = rig.metric("tolk_worker_errors_total", lang="de", reason="registry")
            (dead,) = rig.dead_letters()
        finally:
            rig.worker.stop()
            rig.thread.join(10)
        ((_, value),) = rig.broker.records(REPLIES)
        assert value is not None and value[:2] == b"\xc3\x01"
        assert read_result(value).request_id == "bot-2" and errors == 1
        # a request written with an id the registry does not hold: dead-lettered, with why
        assert dead["reason"] == "undecodable"
        assert f"Schema Registry id {schema_id + 100}" in dead["exception"]
