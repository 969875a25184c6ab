"""Cache benchmark: BConTrasT dev replayed twice through a worker with the exact-match cache.

    python -m bench.cache --engine fake --rate 150 --out cache.json
    python -m bench.cache --engine gemma3-270m --limit 200 --rate 2   # the real model (slow)

One process holds one worker thread (real Kafka and Redis: the local stack must run,
`bash compose/stack.sh up`) on its own topics (a fresh prefix), with the engine in the stages
`tolk worker` serves by default, as its builder composes them
(`workers.serving.pipeline.build_served_engine`: the faithfulness stage inside the exact-match
cache; with `--engine fake` the cache alone, since the fake's reversed words are no translation
for the faithfulness checks to judge). The cache's fingerprint gets a variant unique to the
run, so entries other runs left in Redis never count.
The replay job (`tolk replay run`, in its own process) sends the dialogues'
turns (both directions: customers de->en, agents en->de) open loop at `--rate`, in log order,
and collects the replies; then it does the same again (the same turns, new request ids).

Per pass and direction (`source->target`, e.g. `de->en` for the customers' turns; grouping
by target language alone once had the two directions' figures reported under each other's
name): how the cache answered each request (the reply's
`tolk.cache` metadata: l1, l2, joined = shared an identical request's run, miss = ran the
engine), the hit rate (l1 + l2 over all), and for the hits the latency on the worker side from
the reply's own timings: `total_ms` (the record's broker timestamp -> the reply produced; so it
includes the hop from the replay's producer through the broker to the worker) and
`in_worker_ms` = `total_ms - queue_ms` (handed to the cache -> the reply produced; whole
milliseconds, the reply's clock), plus the look-up itself from `tolk_cache_hit_seconds`
(the histogram bucket that holds the P99). The targets (issue #15): second pass >= 95 % hits,
hit latency P99 < 5 ms.

`--engine fake` is a model-free engine: each "step" (`--fake-step-ms`, default 40 ms, about a
decode step of the real model on two cores) finishes every request queued before it, with the
words reversed as its "translation". The cache never looks at the text it stores, so the hit
figures do not depend on the engine; only the first pass's misses take longer with a model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench._common import JSON, dump, machine_info, write_json
from workers import reply_metadata

TIERS = ("l1", "l2", "joined", "miss")


class ModelFreeEngine:
    """A `TranslationEngine` without a model: one step per `step_s` answers everything queued
    (module notes)."""

    def __init__(self, languages: Sequence[str], step_s: float) -> None:
        self.model_version = "model-free"
        self.languages = tuple(languages)
        self.step_s = step_s
        self._queue: list[tuple[Any, str, str]] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    def submit_translation(self, request: Any) -> Any:
        from workers.engine.types import RequestHandle

        handle = RequestHandle(request.request_id, lambda _rid: None)
        with self._cv:
            self._queue.append((handle, request.text, request.target_lang))
            self._cv.notify()
        return handle

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="model-free", daemon=True)
        self._thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        from workers.engine.types import FinishReason, GenerationResult, Timings

        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                batch, self._queue = self._queue, []
            t0 = time.monotonic()
            time.sleep(self.step_s)
            for handle, text, target in batch:
                out = f"[{target}] " + " ".join(reversed(text.split()))
                n = len(out.split())
                handle.set_result(
                    GenerationResult(
                        handle.request_id,
                        list(range(n)),
                        out,
                        FinishReason.STOP,
                        tokens_in=len(text.split()),
                        tokens_out=n,
                        timings=Timings(decode_s=self.step_s, total_s=time.monotonic() - t0),
                    )
                )


def read_replies(bootstrap: str, topic: str, expected: int, timeout_s: float = 30.0) -> list[JSON]:
    """Every reply on the run's reply topic, decoded (the replay keeps only part of each)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    from schemas.codec import decode_result

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-cache-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    out: list[JSON] = []
    end = time.monotonic() + timeout_s
    try:
        while len(out) < expected and time.monotonic() < end:
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            out.append(decode_result(msg.value() or b""))
    finally:
        consumer.close()
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return round(float(ordered[int(rank) - 1]), 3)


def pass_figures(replies: Sequence[JSON]) -> JSON:
    """How the cache answered, per direction (`"de->en"`) and in all, and the hits' latency."""
    by_direction: dict[str, Counter[str]] = {}
    hits_total: list[float] = []
    hits_in_worker: list[float] = []
    hits_queue: list[float] = []
    statuses: Counter[str] = Counter()
    not_cacheable: Counter[str] = Counter()  # why a miss left nothing in the cache
    for r in replies:
        statuses[str(r["status"])] += 1
        direction = f"{r['source_lang']}->{r['target_lang']}"
        how = str((r.get("metadata") or {}).get(reply_metadata.CACHE, "none"))
        by_direction.setdefault(direction, Counter())[how] += 1
        meta = r.get("metadata") or {}
        if r["status"] != "OK":
            not_cacheable[f"status_{r['status']}"] += 1
        elif reply_metadata.FINISH_REASON in meta:
            not_cacheable[f"finish_{meta[reply_metadata.FINISH_REASON]}"] += 1
        elif not r.get("text"):
            not_cacheable["empty"] += 1
        if how in ("l1", "l2"):
            t = r["timings"]
            hits_total.append(float(t["total_ms"]))
            hits_in_worker.append(float(t["total_ms"]) - float(t["queue_ms"]))
            hits_queue.append(float(t["queue_ms"]))

    def rates(counts: Counter[str]) -> JSON:
        n = sum(counts.values())
        return {
            "requests": n,
            **{tier: counts.get(tier, 0) for tier in TIERS},
            "hit_rate": round((counts["l1"] + counts["l2"]) / n, 4) if n else None,
        }

    overall: Counter[str] = Counter()
    for counts in by_direction.values():
        overall.update(counts)
    return {
        "statuses": dict(statuses),
        "not_cacheable": dict(not_cacheable),
        "all": rates(overall),
        "per_direction": {d: rates(c) for d, c in sorted(by_direction.items())},
        "hit_total_ms": {"p50": percentile(hits_total, 50), "p99": percentile(hits_total, 99)},
        "hit_in_worker_ms": {
            "p50": percentile(hits_in_worker, 50),
            "p99": percentile(hits_in_worker, 99),
        },
        # broker timestamp -> handed to the cache: the Kafka hop and the worker's poll loop
        "hit_queue_ms": {"p50": percentile(hits_queue, 50), "p99": percentile(hits_queue, 99)},
    }


def histogram_p99_bound_ms(registry: Any, name: str) -> float | None:
    """Upper bound of the bucket holding the P99 of a histogram, summed over its labels."""
    buckets: Counter[float] = Counter()
    count = 0.0
    for metric in registry.collect():
        if metric.name != name:
            continue
        for s in metric.samples:
            if s.name == f"{name}_bucket":
                buckets[float(s.labels["le"])] += s.value
            elif s.name == f"{name}_count":
                count += s.value
    if not count:
        return None
    for le in sorted(buckets):
        if buckets[le] >= 0.99 * count:
            return le * 1e3
    return None


def replay_in_subprocess(args: argparse.Namespace, prefix: str, run_dir: Path) -> JSON:
    """`tolk replay run` in its own process (so the replay's Python never competes with the
    worker's for the interpreter lock); its JSON summary."""
    cmd = [
        sys.executable, "-m", "workers.cli", "replay", "run", "-b", args.bootstrap,
        "--rate", str(args.rate), "--seed", str(args.seed), "--wait-s", "120",
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    if args.limit is not None:
        cmd += ["--limit", str(args.limit)]
    env = {**os.environ, "TOLK_TOPIC_PREFIX": prefix}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"replay exited {proc.returncode}: {proc.stdout[-2000:]}")
    start = proc.stdout.index("{")
    summary: JSON = json.loads(proc.stdout[start : proc.stdout.rindex("}") + 1])
    return summary


def _at_least(value: float | None, target: float) -> bool:
    return value is not None and value >= target


def _below(value: float | None, target: float) -> bool:
    return value is not None and value < target


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engine", default="fake", help="'fake' (model-free) or a model preset")
    p.add_argument("--fake-step-ms", type=float, default=40.0)
    p.add_argument("--rate", type=float, default=150.0, help="requests per second (open loop)")
    p.add_argument("--limit", type=int, default=None, help="turns per pass (default: all)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--poll-timeout-ms",
        type=float,
        default=50.0,
        help="the worker's consume() wait (Settings.poll_timeout_s; 50 ms as shipped)",
    )
    p.add_argument("--bootstrap", default="127.0.0.1:9092")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from prometheus_client import CollectorRegistry

    from topics.admin import ensure_topics
    from topics.catalog import catalog
    from workers.serving.pipeline import ServingOptions, build_served_engine
    from workers.settings import Settings
    from workers.worker import Worker

    def note(msg: str) -> None:
        print(f"[bench.cache] {msg}", file=sys.stderr, flush=True)

    langs = ("de", "en")  # BConTrasT: customers de->en, agents en->de
    run = uuid.uuid4().hex[:8]
    prefix = f"bench-cache-{run}."
    ensure_topics(args.bootstrap, catalog(langs, partitions=3, prefix=prefix), timeout=30)
    settings = Settings(
        bootstrap=args.bootstrap,
        redis_url=args.redis_url,
        group_id=f"{prefix}workers",
        languages=langs,
        topic_prefix=prefix,
        metrics_port=0,
        worker_id="bench-cache",
        poll_timeout_s=args.poll_timeout_ms / 1e3,
    )
    engine: Any
    if args.engine == "fake":
        engine = ModelFreeEngine(langs, args.fake_step_ms / 1e3)
    else:
        from workers.engine.engine import EngineConfig
        from workers.serving.fair_engine import build_fair_engine

        policies = {k: v for k, v in settings.policies.items() if k in langs}
        engine = build_fair_engine(EngineConfig(model=args.engine, warm_languages=langs), policies)
    caps = [p.max_new_tokens for k, p in settings.policies.items() if k in langs]
    options = ServingOptions.of(
        settings,
        faithful=args.engine != "fake",
        max_new_tokens=max(caps, default=256),  # as tolk worker sets the guard's default
        cache=True,
        cache_variant=f"bench={run}",
    )
    served = build_served_engine(engine, options)
    registry = CollectorRegistry()
    worker = Worker(settings, served, registry=registry)
    stop = threading.Event()
    thread = worker.run_in_thread(stop)
    result: JSON = {
        "bench": "cache",
        "machine": machine_info(),
        "config": vars(args),
        "command": "python -m bench.cache " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    try:
        if not worker.assigned_event.wait(60):
            raise RuntimeError("the worker got no partitions")
        passes = []
        with tempfile.TemporaryDirectory() as runs_root:
            for i in (1, 2):
                t0 = time.perf_counter()
                summary = replay_in_subprocess(args, prefix, Path(runs_root) / f"pass{i}")
                replies = read_replies(args.bootstrap, summary["reply_topic"], summary["sent"])
                figures = pass_figures(replies)
                figures.update(
                    sent=summary["sent"],
                    replies=len(replies),
                    unanswered=summary["sent"] - len({r["request_id"] for r in replies}),
                    wall_s=round(time.perf_counter() - t0, 1),
                    send_lag_p99_ms=summary["send_lag_p99_ms"],
                )
                note(f"pass {i}: {dump(figures['all'])}")
                passes.append(figures)
        result["passes"] = passes
        result["lookup_p99_bound_ms"] = histogram_p99_bound_ms(registry, "tolk_cache_hit_seconds")
        second = passes[1]
        result["targets"] = {
            "second_pass_hit_rate": second["all"]["hit_rate"],
            "second_pass_hit_rate_ok": _at_least(second["all"]["hit_rate"], 0.95),
            "hit_in_worker_p99_ms": second["hit_in_worker_ms"]["p99"],
            "hit_total_p99_ms": second["hit_total_ms"]["p99"],
            "hit_in_worker_p99_ok": _below(second["hit_in_worker_ms"]["p99"], 5.0),
            "hit_total_p99_ok": _below(second["hit_total_ms"]["p99"], 5.0),
            "first_pass_hit_rate_per_direction": {
                d: f["hit_rate"] for d, f in passes[0]["per_direction"].items()
            },
        }
    finally:
        stop.set()
        thread.join(30)
    print(dump(result))
    write_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
