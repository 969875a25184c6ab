"""Pipeline benchmark: what the Kafka path costs on top of the engine, and its latency.

    python -m bench.pipeline --rate 2 --duration 30 --model smollm2-135m --out pipeline.json

One process holds one engine and one worker thread on it (the local stack must run:
`bash compose/stack.sh up`). The engine is the one `tolk worker` serves with:
`build_fair_engine` (weighted fair share over the languages, deadline admission, language
prefixes warmed at start-up, `workers/serving/fair_engine.py`). Every run below gets texts that
no earlier run of the process sent (disjoint slices of one shuffled pool of distinct sentences),
so no run is served from the prompts an earlier run left in the prefix cache; only the language
prefixes are shared, as in production. On that engine:

(a) engine alone at saturation: every request of the mix submitted at once straight to the
    engine (`submit_translation`, as the worker does); requests/s and tokens/s.
(b) the Kafka path at a fixed open-loop rate: a producer thread sends request i at
    t0 + i / rate whatever happened before (open loop), and latency is measured from that
    *scheduled* time to the reply's arrival on the reply topic, so a stall is charged to every
    request it delays (no coordinated omission). Per target language p50/p95/p99/p99.9, the
    achieved throughput, and the backlog (sent minus answered) sampled every 0.25 s.
(c) the Kafka path at saturation: the same mix as (a), produced all at once (a backlog far above
    what the engine finishes in the time it takes to produce it), timed from the first send to
    the last reply; the ratio (c)/(a) is what the Kafka path keeps of the engine's throughput
    (target >= 0.9).

(a) and (c) alternate `--repeats` times (medians reported) so that a noisy neighbour on a shared
machine hits both alike. A warm-up round (its own texts) goes through Kafka and the engine first.
Prints one JSON object; `--out` also writes it to a file. Seeds are fixed.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from bench._common import JSON, dump, machine_info, parse_csv, safe_ratio, summarize, write_json
from workers.engine.types import TranslationRequest

Item = tuple[str, str, str]  # (text, source_lang, target_lang)


# -- the sentence mix ----------------------------------------------------------------------------


def build_mix(n: int, languages: Sequence[str], seed: int = 0) -> list[Item]:
    """`n` distinct requests over `languages` (targets), interleaved: English sources from
    Tatoeba for de/fr/es/it (half of German from the agents' BConTrasT turns), German customer
    turns for en. Short chat-like texts, as support traffic is. Raises when the data has fewer
    distinct texts than asked for."""
    from replay.datasets import bcontrast, tatoeba_pairs

    rng = random.Random(seed)
    pools: dict[str, list[Item]] = {}
    for lang in languages:
        if lang == "en":
            pool = [(u.source, "de", "en") for u in bcontrast("dev") if u.speaker == "customer"]
        else:
            pool = [(en, "en", lang) for en, _ in tatoeba_pairs(lang) if len(en) <= 100]
            if lang == "de":
                agents = [u.source for u in bcontrast("dev") if u.speaker == "agent"]
                pool = [(t, "en", "de") for t in agents if len(t) <= 100] + pool
        pool = list(dict.fromkeys(pool))  # distinct, first occurrence kept
        rng.shuffle(pool)
        pools[lang] = pool
    per_lang = -(-n // len(languages))
    short = {lang: len(p) for lang, p in pools.items() if len(p) < per_lang}
    if short:
        raise ValueError(f"{n} requests need {per_lang} distinct texts per language; have {short}")
    return [pools[languages[i % len(languages)]][i // len(languages)] for i in range(n)]


class FreshTexts:
    """Hands out slices of one mix in order, so no two runs of the benchmark share a text."""

    def __init__(self, mix: Sequence[Item]) -> None:
        self._mix = list(mix)
        self._next = 0

    def take(self, n: int) -> list[Item]:
        if self._next + n > len(self._mix):
            raise ValueError(f"out of fresh texts: {len(self._mix)} in the pool")
        out = self._mix[self._next : self._next + n]
        self._next += n
        return out

    @property
    def used(self) -> int:
        return self._next


def percentiles_ms(values_s: Sequence[float]) -> JSON:
    if not values_s:
        return {"n": 0}
    ms = sorted(v * 1e3 for v in values_s)

    def q(p: float) -> float:
        return round(ms[min(len(ms) - 1, int(p / 100 * len(ms)))], 1)

    return {
        "n": len(ms),
        "p50": round(statistics.median(ms), 1),
        "p95": q(95),
        "p99": q(99),
        "p99_9": q(99.9),
        "max": round(ms[-1], 1),
    }


# -- Kafka plumbing ------------------------------------------------------------------------------


class ReplyCollector:
    """Reads the (fresh, private) reply topic from its start; arrival time per request id."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        self.arrived: dict[str, float] = {}  # rid -> perf_counter at receipt (first reply)
        self.replies: dict[str, dict[str, Any]] = {}
        self.duplicates = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer = Consumer(
            {"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
             "enable.auto.commit": False, "fetch.wait.max.ms": 10}
        )  # fmt: skip
        parts = self._consumer.list_topics(topic=topic, timeout=10).topics[topic].partitions
        self._consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        self._thread = threading.Thread(target=self._run, name="bench-replies", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from schemas.codec import decode_result

        while not self._stop.is_set():
            msgs = self._consumer.consume(num_messages=500, timeout=0.02)
            now = time.perf_counter()
            for msg in msgs:
                if msg.error():
                    continue
                r = decode_result(msg.value() or b"")
                rid = r["request_id"]
                with self._lock:
                    if rid in self.arrived:
                        self.duplicates += 1
                    else:
                        self.arrived[rid] = now
                        self.replies[rid] = r

    def count(self, rids: Sequence[str] | None = None) -> int:
        with self._lock:
            if rids is None:
                return len(self.arrived)
            return sum(1 for r in rids if r in self.arrived)

    def wait(self, rids: Sequence[str], timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.count(rids) == len(rids):
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._consumer.close()


class Sender:
    def __init__(self, bootstrap: str, prefix: str, reply_topic: str) -> None:
        from confluent_kafka import Producer

        self.prefix = prefix
        self.reply_topic = reply_topic
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 1, "acks": "all"})

    def send(self, rid: str, item: Item) -> None:
        from schemas.codec import encode_request
        from topics.catalog import request_topic

        text, src, tgt = item
        value = encode_request(
            {"request_id": rid, "conversation_id": None, "source_lang": src, "target_lang": tgt,
             "text": text, "created_at": int(time.time() * 1000), "deadline": None,
             "reply_topic": self.reply_topic, "metadata": {}}
        )  # fmt: skip
        while True:
            try:
                self.producer.produce(self.prefix + request_topic(tgt), value=value,
                                      key=rid.encode())  # fmt: skip
                break
            except BufferError:
                self.producer.poll(0.01)
        self.producer.poll(0)


# -- the three measurements ----------------------------------------------------------------------


def engine_alone(engine: Any, mix: Sequence[Item], max_new_tokens: int) -> JSON:
    run = uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    handles = [
        engine.submit_translation(
            TranslationRequest(f"eng-{run}-{i}", text, src, tgt, max_new_tokens=max_new_tokens)
        )
        for i, (text, src, tgt) in enumerate(mix)
    ]
    results = [h.result(timeout=1800) for h in handles]
    wall = time.perf_counter() - t0
    tokens = sum(r.tokens_out for r in results)
    return {
        "requests": len(results),
        "ok": sum(1 for r in results if r.ok),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(results) / wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "tokens_out": tokens,
    }


def kafka_saturation(sender: Sender, replies: ReplyCollector, mix: Sequence[Item]) -> JSON:
    run = uuid.uuid4().hex[:8]
    rids = [f"sat-{run}-{i}" for i in range(len(mix))]
    t0 = time.perf_counter()
    for rid, item in zip(rids, mix, strict=True):
        sender.send(rid, item)
    sender.producer.flush(30)
    produced_s = time.perf_counter() - t0
    if not replies.wait(rids, timeout=1800):
        return {"error": f"only {replies.count(rids)}/{len(rids)} replies"}
    last = max(replies.arrived[r] for r in rids)
    wall = last - t0
    got = [replies.replies[r] for r in rids]
    tokens = sum(int(r["tokens_out"]) for r in got)
    return {
        "requests": len(rids),
        "ok": sum(1 for r in got if r["status"] == "OK"),
        "produce_all_s": round(produced_s, 3),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(rids) / wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "tokens_out": tokens,
    }


def open_loop(
    sender: Sender,
    replies: ReplyCollector,
    mix: Sequence[Item],
    rate: float,
    duration_s: float,
    drain_timeout_s: float,
) -> JSON:
    run = uuid.uuid4().hex[:8]
    n = max(1, int(rate * duration_s))
    if n > len(mix):
        raise ValueError(f"open loop needs {n} texts, got {len(mix)}")
    items = list(mix[:n])
    rids = [f"ol-{run}-{i}" for i in range(n)]
    scheduled: dict[str, float] = {}
    late: list[float] = []  # how far behind schedule each send actually went out
    t0 = time.perf_counter() + 0.2

    def produce() -> None:
        for i, (rid, item) in enumerate(zip(rids, items, strict=True)):
            at = t0 + i / rate
            delay = at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            scheduled[rid] = at
            sender.send(rid, item)
            late.append(max(0.0, time.perf_counter() - at))
        sender.producer.flush(30)

    thread = threading.Thread(target=produce, name="bench-open-loop", daemon=True)
    thread.start()
    backlog: list[tuple[float, int]] = []
    while thread.is_alive():
        backlog.append((time.perf_counter() - t0, len(scheduled) - replies.count(rids)))
        time.sleep(0.25)
    thread.join()
    send_end = time.perf_counter()
    backlog_at_end = len(rids) - replies.count(rids)
    complete = replies.wait(rids, drain_timeout_s)
    answered = [r for r in rids if r in replies.arrived]
    lat_by_lang: dict[str, list[float]] = {}
    for rid, (_text, src, tgt) in zip(rids, items, strict=True):
        if rid in replies.arrived:
            lat = replies.arrived[rid] - scheduled[rid]
            lat_by_lang.setdefault(f"{src}->{tgt}", []).append(lat)
    all_lat = [x for v in lat_by_lang.values() for x in v]
    last = max((replies.arrived[r] for r in answered), default=send_end)
    return {
        "offered_rate_per_s": rate,
        "duration_s": duration_s,
        "requests": n,
        "answered": len(answered),
        "complete": complete,
        # (n - 1) gaps between the first and the last scheduled send
        "achieved_send_rate_per_s": round((n - 1) / max(1e-9, send_end - t0), 3) if n > 1 else None,
        "send_lag_ms_max": round(max(late, default=0.0) * 1e3, 1),
        "throughput_per_s": round(len(answered) / max(1e-9, last - t0), 3),
        "latency_ms_from_scheduled_send": {
            "all": percentiles_ms(all_lat),
            **{k: percentiles_ms(v) for k, v in sorted(lat_by_lang.items())},
        },
        "backlog": {
            "max": max((b for _, b in backlog), default=0),
            "at_end_of_sending": backlog_at_end,
            "timeline": [(round(t, 2), b) for t, b in backlog[:: max(1, len(backlog) // 40)]],
        },
    }


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="engine model preset or path")
    p.add_argument("--rate", type=float, default=None,
                   help="open-loop offered load, requests/s (default: half the engine's "
                        "saturated rate measured in (a))")  # fmt: skip
    p.add_argument("--duration", type=float, default=30.0, help="open-loop seconds")
    p.add_argument("--languages", default="de,fr,es,it", help="target languages")
    p.add_argument("--requests", type=int, default=96,
                   help="requests per saturation run, (a) and (c) alike")  # fmt: skip
    p.add_argument("--repeats", type=int, default=2, help="(a)/(c) alternations")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: engine's)")
    p.add_argument("--bootstrap", default="127.0.0.1:9092")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-topics", action="store_true", help="don't delete the bench topics")
    p.add_argument("--out", default=None, help="also write the JSON here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from prometheus_client import CollectorRegistry

    from topics.admin import ensure_topics
    from topics.catalog import REPLIES, catalog
    from workers.engine.engine import EngineConfig
    from workers.fairness.policy import LanguagePolicy
    from workers.serving.fair_engine import build_fair_engine
    from workers.serving.pipeline import ServingOptions, build_served_engine
    from workers.settings import Settings
    from workers.worker import Worker

    def note(msg: str) -> None:
        print(f"[bench.pipeline] {msg}", file=sys.stderr, flush=True)

    langs = tuple(parse_csv(args.languages))
    # warm-up + (a) and (c) per repeat + the open loop (its rate is known only after (a): room
    # for up to 4x the requests of one saturation run)
    texts = FreshTexts(build_mix(16 + (2 * args.repeats + 4) * args.requests, langs, args.seed))
    prefix = f"bench-{uuid.uuid4().hex[:8]}."
    specs = catalog(langs, partitions=3, prefix=prefix)
    ensure_topics(args.bootstrap, specs, timeout=30)

    t_load = time.perf_counter()
    policy = LanguagePolicy(1.0, 10.0, 1024, args.max_new_tokens)
    policies = {lang: policy for lang in langs}
    engine = build_fair_engine(  # as `tolk worker` builds it (workers/cli.py)
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            max_new_tokens=args.max_new_tokens,
            warm_languages=langs,
        ),
        policies,
    )
    note(f"engine {args.model} loaded and warmed in {time.perf_counter() - t_load:.1f}s")
    settings = Settings(
        bootstrap=args.bootstrap, redis_url=args.redis_url, group_id=f"{prefix}workers",
        languages=langs, topic_prefix=prefix, metrics_port=0, worker_id="bench-worker",
        policies=policies,
    )  # fmt: skip
    # the builder with no stage on: the fair engine's own cost (workers/serving/pipeline.py)
    served = build_served_engine(engine, ServingOptions.of(settings, faithful=False))
    worker = Worker(settings, served, registry=CollectorRegistry())
    stop = threading.Event()
    thread = worker.run_in_thread(stop)  # starts the engine's loop thread too
    replies = ReplyCollector(args.bootstrap, prefix + REPLIES)
    sender = Sender(args.bootstrap, prefix, prefix + REPLIES)
    result: JSON = {"bench": "pipeline", "machine": machine_info(), "config": vars(args)}
    try:
        if not worker.assigned_event.wait(60):
            raise RuntimeError("the worker got no partitions")
        warm = texts.take(16)
        kafka_saturation(sender, replies, warm[:8])  # metadata, connections, code paths
        engine_alone(engine, warm[8:], args.max_new_tokens)
        note("warm-up done")

        alone: list[JSON] = []
        via_kafka: list[JSON] = []
        for i in range(args.repeats):
            alone.append(engine_alone(engine, texts.take(args.requests), args.max_new_tokens))
            note(f"(a) engine alone #{i + 1}: {alone[-1]['requests_per_s']} req/s")
            via_kafka.append(kafka_saturation(sender, replies, texts.take(args.requests)))
            note(f"(c) kafka saturated #{i + 1}: {via_kafka[-1].get('requests_per_s')} req/s")
        a_rps = statistics.median(r["requests_per_s"] for r in alone)
        c_rps = statistics.median(r.get("requests_per_s", 0.0) for r in via_kafka)
        rate = args.rate if args.rate is not None else round(a_rps / 2, 3)
        note(f"(b) open loop at {rate} req/s for {args.duration}s")
        n_open = max(1, int(rate * args.duration))
        ol = open_loop(sender, replies, texts.take(n_open), rate, args.duration, 600)

        result["engine_alone"] = {
            "requests_per_s": summarize([r["requests_per_s"] for r in alone]),
            "tokens_per_s": summarize([r["tokens_per_s"] for r in alone]),
            "runs": alone,
        }
        result["kafka_saturation"] = {
            "requests_per_s": summarize([r.get("requests_per_s", 0.0) for r in via_kafka]),
            "tokens_per_s": summarize([r.get("tokens_per_s", 0.0) for r in via_kafka]),
            "runs": via_kafka,
        }
        result["ratio_kafka_over_engine"] = {
            "requests_per_s": safe_ratio(c_rps, a_rps),
            "per_repeat": [
                safe_ratio(c.get("requests_per_s"), a["requests_per_s"])
                for a, c in zip(alone, via_kafka, strict=True)
            ],
            "target": 0.9,
        }
        result["open_loop"] = ol
        result["duplicates"] = replies.duplicates
        result["engine"] = {
            "serving": "build_fair_engine (VTC fair share + deadline admission), as tolk worker",
            "model_version": engine.model_version,
            "config": dataclasses.asdict(engine.engine.config),
            "preemptions": engine.engine.stats.preemptions,
            "fresh_texts_used": texts.used,
        }
    finally:
        stop.set()
        thread.join(60)
        replies.close()
        sender.producer.flush(5)
        if not args.keep_topics:
            _delete_topics(args.bootstrap, [s.name for s in specs])
    print(dump(result))
    write_json(result, args.out)
    return 0


def _delete_topics(bootstrap: str, names: list[str]) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.delete_topics(names, operation_timeout=30).values():
        try:
            fut.result(30)
        except Exception as exc:  # left behind: harmless, named by the run's prefix
            print(f"[bench.pipeline] topic not deleted: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
