"""Bad records at volume: 10,000 undecodable or invalid records amid valid traffic.

The fault: `N_BAD` bad records (about 1,000 a second) interleaved with a steady 20 valid
requests a second, on the same topics: random bytes, truncated Avro, an unknown target
language, empty text, oversized text (over the worker's `max_text_bytes`), a deadline already
past, and a reply topic that does not exist. Each bad record is keyed `bad-<i>`, which a dead
letter keeps byte for byte, so every outcome is matched to the record that caused it.

Asserted, exactly: each undecodable record (random bytes, truncated Avro) is dead-lettered once
with reason "undecodable" and its original bytes; each request naming a missing reply topic is
dead-lettered once with reason "reply_topic_missing"; each unknown-language, empty or oversized
request gets a REJECTED reply and each expired one an EXPIRED reply, with an error text; the
dead-letter topic holds nothing else; every valid request is answered OK. The valid traffic's
latency (scheduled send to reply read, open loop) is reported: p50 / p99 / max.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import Producer

from schemas.codec import decode_dead_letter, decode_result, encode_request
from tests.faults.harness import (
    KAFKA_LOG,
    LoadGenerator,
    TopicTail,
    WorkerProcess,
    ledger_report,
    new_prefix,
    percentile,
    request_record,
    wait_until,
)
from tests.faults.private_stack import PrivateStack
from tests.workers.fakes import create_prefixed_topics
from topics.catalog import DEAD_LETTERS, REPLIES, request_topic

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.redis, pytest.mark.faults]

LANGS = ("de", "fr")
N_BAD = 10_000
BAD_RATE = 1000.0  # bad records per second
MAX_TEXT_BYTES = 1000

# kind -> (dead-letter reason, None) or (None, reply status)
EXPECTED: dict[str, tuple[str | None, str | None]] = {
    "garbage": ("undecodable", None),
    "truncated": ("undecodable", None),
    "missing_reply_topic": ("reply_topic_missing", None),
    "unknown_language": (None, "REJECTED"),
    "empty_text": (None, "REJECTED"),
    "oversized_text": (None, "REJECTED"),
    "expired_deadline": (None, "EXPIRED"),
}
KINDS = tuple(EXPECTED)


def bad_record(kind: str, rid: str, lang: str, prefix: str, rng: random.Random) -> bytes:
    """The value of one bad record of `kind`."""
    reply_topic = prefix + REPLIES
    if kind == "garbage":  # a leading 0 is never the single-object marker (C3 01)
        return b"\x00" + rng.randbytes(rng.randint(0, 200))
    if kind == "truncated":
        whole = encode_request(request_record(rid, lang, "a text cut short", reply_topic))
        return whole[: rng.randint(1, len(whole) - 1)]
    fields: dict[str, Any] = {}
    target, text = lang, f"valid words for {rid}"
    if kind == "missing_reply_topic":
        reply_topic = prefix + "no-such-replies"
    elif kind == "unknown_language":
        target = "xx"
    elif kind == "empty_text":
        text = ""
    elif kind == "oversized_text":
        text = "w" * (MAX_TEXT_BYTES + 500)
    elif kind == "expired_deadline":
        fields["deadline"] = int(time.time() * 1000) - 60_000
    return encode_request(request_record(rid, target, text, reply_topic, **fields))


def _letter(value: bytes) -> dict[str, Any]:
    return decode_dead_letter(value)


def test_ten_thousand_bad_records_each_get_their_answer(
    stack_up: PrivateStack, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    stack = stack_up
    rng = random.Random(12)
    prefix = new_prefix("bad")
    create_prefixed_topics(stack.bootstrap, prefix, LANGS, partitions=2)
    worker = spawn_worker(
        group=f"g-{uuid.uuid4().hex[:8]}",
        languages=list(LANGS),
        prefix=prefix,
        worker_id="bad-records",
        delay_s=0.02,
        settings={"max_text_bytes": MAX_TEXT_BYTES},
    )
    worker.wait_assigned(60)
    replies = TopicTail(stack.bootstrap, prefix + REPLIES, decode_result)
    letters = TopicTail(stack.bootstrap, prefix + DEAD_LETTERS, _letter)
    load = LoadGenerator(stack.bootstrap, prefix, LANGS, rate=20).start()
    producer = Producer(
        {"bootstrap.servers": stack.bootstrap, "linger.ms": 20, "logger": KAFKA_LOG}
    )
    run = uuid.uuid4().hex[:6]
    bad: dict[str, tuple[str, bytes]] = {}  # key -> (kind, value)
    try:
        time.sleep(1)
        start = time.monotonic()
        for i in range(N_BAD):
            wait = start + i / BAD_RATE - time.monotonic()
            if wait > 0:
                producer.poll(wait)
            kind, lang = KINDS[i % len(KINDS)], LANGS[(i // len(KINDS)) % len(LANGS)]
            key = f"bad-{run}-{i}"
            value = bad_record(kind, key, lang, prefix, rng)
            bad[key] = (kind, value)
            while True:
                try:
                    producer.produce(prefix + request_topic(lang), value=value, key=key.encode())
                    break
                except BufferError:
                    producer.poll(0.05)
        assert producer.flush(60) == 0
        time.sleep(1)
        load.stop()
        sent = load.rids()
        n_letters = sum(1 for kind, _ in bad.values() if EXPECTED[kind][0])
        bad_replies = {key for key, (kind, _) in bad.items() if EXPECTED[kind][1]}
        drain_s = wait_until(
            lambda: len(letters) >= n_letters
            and (sent | bad_replies) <= set(replies.by_request_id()),
            180,
            "an answer to every record",
        )
        time.sleep(2)  # anything extra would show up now
        by_id = replies.by_request_id()
        latencies = [min(s.arrived for s in by_id[rid]) - load.sent[rid].scheduled for rid in sent]
        letters_by_key: dict[str, list[dict[str, Any]]] = {}
        for seen in letters.snapshot():
            key = (seen.decoded.get("key") or b"").decode(errors="replace")
            letters_by_key.setdefault(key, []).append(seen.decoded)
        wrong: list[str] = []
        for key, (kind, value) in bad.items():
            reason, status = EXPECTED[kind]
            if reason is not None:
                found = letters_by_key.get(key, [])
                if len(found) != 1 or found[0]["reason"] != reason or found[0]["original"] != value:
                    wrong.append(f"{kind} {key}: dead letters {[f.get('reason') for f in found]}")
            else:
                got = [s.decoded for s in by_id.get(key, [])]
                if not got or {g["status"] for g in got} != {status} or not got[0]["error"]:
                    wrong.append(f"{kind} {key}: replies {[g.get('status') for g in got]}")
        extra_letters = sum(len(v) for key, v in letters_by_key.items() if key not in bad)
        report = ledger_report(
            "bad_records",
            sent,
            replies,
            bad_records=N_BAD,
            bad_by_kind=dict(Counter(kind for kind, _ in bad.values())),
            dead_letters=len(letters),
            dead_letters_expected=n_letters,
            dead_letter_reasons=dict(Counter(s.decoded.get("reason") for s in letters.snapshot())),
            bad_replies=sum(1 for key in bad_replies if key in by_id),
            bad_replies_expected=len(bad_replies),
            mismatched=len(wrong),
            valid_p50_ms=round(percentile(latencies, 50) * 1000, 1),
            valid_p99_ms=round(percentile(latencies, 99) * 1000, 1),
            valid_max_ms=round(max(latencies) * 1000, 1),
            drain_after_flood_s=round(drain_s, 1),
        )
    finally:
        replies.close()
        letters.close()
    assert not wrong, wrong[:5]
    assert len(letters) == n_letters and extra_letters == 0
    assert report["lost"] == 0
    assert report["statuses"] == {"OK": len(sent)}
    assert worker.alive()
