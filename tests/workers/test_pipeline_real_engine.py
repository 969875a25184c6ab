"""The whole path with the real engine: Kafka -> worker -> SmolLM2 -> reply topic.

160 requests across de, fr, es, it (English sources from Tatoeba and the agents' turns of
BConTrasT) go through a worker thread on the real broker; each must be answered exactly once,
and each reply's text must equal what the same engine produces for the same input when driven
directly (`engine.generate`, after the worker stopped).

Numerics: the worker's replies come from continuous batches whose composition depends on
arrival timing; the direct pass uses fixed batches. A batched GEMM can differ from another
batch shape in the last bits, so greedy decoding may in principle diverge at a near-tie. The
test asserts exact equality (it held on every run here: 400/400 when the test sent 400, until
2026-12-02; 160 still make batches of 32 and more on the worker's side, in four languages, for
40 % of the tokens); if it ever fails, the message
lists the mismatches and the batch-1 output of each, which says whether it is a near-tie (the
batch-1 text agrees with one of the two) or a real bug.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from confluent_kafka import Producer
from prometheus_client import CollectorRegistry

from replay.datasets import bcontrast, tatoeba_pairs
from schemas.codec import decode_result, encode_request
from tests.workers.fakes import TopicReader, create_prefixed_topics
from tests.workers.polling import wait_for
from topics.catalog import REPLIES, request_topic
from workers.engine.engine import Engine, EngineConfig
from workers.fairness.policy import LanguagePolicy
from workers.settings import Settings
from workers.worker import Worker

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.redis]

LANGS = ("de", "fr", "es", "it")
PER_LANG = 40
N_REQUESTS = PER_LANG * len(LANGS)
MAX_NEW_TOKENS = 24


def english_inputs(lang: str, n: int) -> list[str]:
    """`n` distinct short English sources for target `lang` from the repository's data/."""
    texts = [en for en, _ in tatoeba_pairs(lang) if len(en) <= 80]
    if lang == "de":  # agents' chat turns (English -> German) for half of German
        agents = [u.source for u in bcontrast("dev") if u.speaker == "agent" and len(u.source) < 80]
        texts = agents[: n // 2] + texts
    out: list[str] = []
    for t in texts:
        if t not in out:
            out.append(t)
        if len(out) == n:
            break
    return out


def policies(max_new_tokens: int) -> dict[str, LanguagePolicy]:
    return {lang: LanguagePolicy(1.0, 10.0, 256, max_new_tokens) for lang in LANGS}


def test_requests_answered_once_with_the_engines_own_output(
    smollm2: Any, kafka_bootstrap: str, redis_url: str
) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    create_prefixed_topics(kafka_bootstrap, prefix, LANGS, partitions=2)
    engine = Engine(smollm2, EngineConfig(kv_cache_tokens=8192, max_new_tokens=MAX_NEW_TOKENS))
    engine.warm(LANGS)
    settings = Settings(
        bootstrap=kafka_bootstrap,
        redis_url=redis_url,
        group_id=f"tolk-test-{uuid.uuid4().hex[:10]}",
        languages=LANGS,
        topic_prefix=prefix,
        metrics_port=0,
        worker_id="pipeline-test",
        policies=policies(MAX_NEW_TOKENS),
        drain_timeout_s=10.0,
    )
    worker = Worker(settings, engine, registry=CollectorRegistry())
    thread = worker.run_in_thread()
    replies = TopicReader(kafka_bootstrap, prefix + REPLIES)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
    run = uuid.uuid4().hex[:8]
    inputs: dict[str, tuple[str, str]] = {}  # rid -> (text, target)
    try:
        assert worker.assigned_event.wait(30), "worker got no assignment"
        per_lang = {lang: english_inputs(lang, PER_LANG) for lang in LANGS}
        for i in range(PER_LANG):  # interleaved, as mixed traffic arrives
            for lang in LANGS:
                rid = f"{run}-{lang}-{i}"
                text = per_lang[lang][i]
                inputs[rid] = (text, lang)
                value = encode_request(
                    {
                        "request_id": rid,
                        "conversation_id": None,
                        "source_lang": "en",
                        "target_lang": lang,
                        "text": text,
                        "created_at": int(time.time() * 1000),
                        "deadline": None,
                        "reply_topic": prefix + REPLIES,
                        "metadata": {},
                    }
                )
                producer.produce(prefix + request_topic(lang), value=value, key=rid.encode())
                producer.poll(0)
        assert producer.flush(30) == 0
        assert len(inputs) == N_REQUESTS
        wait_for(lambda: len(replies) >= N_REQUESTS, timeout=900, what=f"{N_REQUESTS} replies")
        time.sleep(2.0)  # a duplicate would show up now
        got: dict[str, list[dict[str, Any]]] = {}
        for v in replies.values():
            r = decode_result(v)
            got.setdefault(r["request_id"], []).append(r)
        assert len(replies) == N_REQUESTS
        assert set(got) == set(inputs)
        assert all(len(v) == 1 for v in got.values())
        bad = {rid: v[0] for rid, v in got.items() if v[0]["status"] != "OK"}
        assert not bad, list(bad.items())[:3]
        assert worker.registry.get_sample_value("tolk_worker_duplicates_total") == 0
    finally:
        worker.stop()
        thread.join(60)
        replies.close()
    assert not thread.is_alive()

    # The engine's direct output for the same inputs (its loop thread stopped with the worker:
    # generate() drives it synchronously here), in fixed batches of 32.
    rids = list(inputs)
    direct: dict[str, str] = {}
    for start in range(0, len(rids), 32):
        batch = rids[start : start + 32]
        reqs = [
            engine.translation_request(
                inputs[rid][0], "en", inputs[rid][1], max_new_tokens=MAX_NEW_TOKENS
            )
            for rid in batch
        ]
        for rid, res in zip(batch, engine.generate(reqs), strict=True):
            assert res.ok, res
            direct[rid] = res.text
    mismatched = [rid for rid in rids if got[rid][0]["text"] != direct[rid]]
    if mismatched:
        detail = []
        for rid in mismatched[:10]:
            text, lang = inputs[rid]
            (alone,) = engine.generate(
                [engine.translation_request(text, "en", lang, max_new_tokens=MAX_NEW_TOKENS)]
            )
            detail.append(
                f"{rid}: kafka={got[rid][0]['text']!r} batched={direct[rid]!r} "
                f"batch1={alone.text!r}"
            )
        pytest.fail(f"{len(mismatched)}/{N_REQUESTS} texts differ:\n" + "\n".join(detail))
