"""Scale-out: the throughput of one worker against two in one consumer group, same machine.

    python -m bench.scale_out --model smollm2-135m --requests 240 --out scale_out.json

Two ways to spend the same CPUs, measured in one run (the anchor is the single worker):

- `1x<all>`: one `tolk worker` process with an OpenMP pool of every CPU;
- `2x<half>`: two `tolk worker` processes in one consumer group, each pinned to half of the
  CPUs (`taskset`) with a pool of that many threads.

Per configuration: fresh topics (4 partitions per language) under a fresh prefix, the workers
started with `TOLK_HEALTH_PORT=auto` and `--metrics-port auto` (two workers on one host cannot
share the default ports; each picks free ones and logs them, `workers/ports.py`), then given
time to settle their assignment (every worker logged `assigned`, answered 200 on its
`/readyz`, and 5 s passed), then a backlog of `--requests` real support turns
(workers/data/support_sample.jsonl, both directions, unique request ids) produced at once;
throughput is requests / (last reply - first send). The translation cache is off
(`TOLK_CACHE=0`): every request runs the model, with the same output cap
(`--max-new-tokens`) and weight for both languages.
Needs the local stack (`bash compose/stack.sh up`). JSON on stdout (and `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench._common import JSON, dump, machine_info, safe_ratio, thread_env, write_json

REPO = Path(__file__).resolve().parents[1]
LANGS = ("de", "en")


def _texts(n: int) -> list[tuple[str, str, str]]:
    """(source, target, text) of the first n support turns, cycling if needed."""
    rows = []
    with open(REPO / "workers" / "data" / "support_sample.jsonl", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r["target_lang"] in LANGS:
                rows.append((r["source_lang"], r["target_lang"], r["text"]))
    return [rows[i % len(rows)] for i in range(n)]


def _start_workers(
    cpus: Sequence[str], args: argparse.Namespace, prefix: str, group: str, logs: Path
) -> list[tuple[subprocess.Popen[bytes], Path]]:
    procs = []
    for k, cpu_list in enumerate(cpus):
        threads = len(cpu_list.split(","))
        env = {
            **os.environ,
            **thread_env(threads),
            "TOLK_BOOTSTRAP": args.bootstrap,
            "TOLK_REDIS_URL": args.redis_url,
            "TOLK_TOPIC_PREFIX": prefix,
            "TOLK_GROUP_ID": group,
            "TOLK_WORKER_ID": f"scale-{k}",
            "TOLK_LANGUAGES": ",".join(LANGS),
            "TOLK_CACHE": "0",
            # weight 1, SLO 60 s, queue 1024, output cap: equal languages, nothing expires
            "TOLK_POLICIES": ",".join(f"{lang}:1:60:1024:{args.max_new_tokens}" for lang in LANGS),
            "TOLK_HEALTH_PORT": "auto",  # each worker its own free port, logged
            "PYTHONUNBUFFERED": "1",
        }
        log = logs / f"worker-{len(cpus)}-{k}.log"
        cmd = ["taskset", "-c", cpu_list, sys.executable, "-m", "workers.cli", "worker"]
        cmd += ["--model", args.model, "--metrics-port", "auto"]
        with log.open("wb") as out:
            procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stderr=out, stdout=out), log))
    return procs


PORT_LINES = {  # what workers/ports.py logs for `auto`
    "health": re.compile(r"health probes \(/readyz, /livez\) on port (\d+)"),
    "metrics": re.compile(r"metrics \(/metrics\) on port (\d+)"),
}


def logged_ports(text: str) -> dict[str, int]:
    """The probe and metrics ports a worker's log says it serves on."""
    found = {what: pattern.search(text) for what, pattern in PORT_LINES.items()}
    return {what: int(m.group(1)) for what, m in found.items() if m is not None}


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _wait_assigned(
    procs: list[tuple[subprocess.Popen[bytes], Path]], timeout: float
) -> list[dict[str, int]]:
    """Wait until every worker is assigned and ready; their ports (health, metrics)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for proc, log in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited {proc.returncode}; see {log}")
        texts = [log.read_text(errors="replace") for _, log in procs]
        ports = [logged_ports(t) for t in texts]
        if all("assigned [" in t for t in texts) and all(
            "health" in p and _ready(p["health"]) for p in ports
        ):
            time.sleep(5.0)  # the group settles (a second member joins after the first)
            return ports
        time.sleep(0.5)
    raise RuntimeError(
        f"workers not assigned within {timeout:.0f} s; see {[str(p[1]) for p in procs]}"
    )


def _measure(args: argparse.Namespace, cpus: Sequence[str], logs: Path) -> JSON:
    from confluent_kafka import Consumer, Producer, TopicPartition

    from schemas.codec import decode_result, encode_request
    from topics.admin import ensure_topics
    from topics.catalog import REPLIES, catalog, request_topic

    prefix = f"scale{uuid.uuid4().hex[:8]}."
    group = f"scale-{uuid.uuid4().hex[:8]}"
    ensure_topics(args.bootstrap, catalog(LANGS, partitions=4, prefix=prefix))
    reply_topic = prefix + REPLIES
    consumer = Consumer({"bootstrap.servers": args.bootstrap, "group.id": f"{group}-reader"})
    # the reply topic has as many partitions as the language topics: read them all
    parts = consumer.list_topics(reply_topic, timeout=10).topics[reply_topic].partitions
    consumer.assign([TopicPartition(reply_topic, p, 0) for p in sorted(parts)])
    procs = _start_workers(cpus, args, prefix, group, logs)
    try:
        ports = _wait_assigned(procs, args.start_timeout_s)
        producer = Producer({"bootstrap.servers": args.bootstrap, "linger.ms": 5})
        rids = set()
        start = time.time()
        for i, (src, tgt, text) in enumerate(_texts(args.requests)):
            rid = f"{prefix}{i}"
            rids.add(rid)
            value = encode_request(
                {
                    "request_id": rid,
                    "conversation_id": None,
                    "source_lang": src,
                    "target_lang": tgt,
                    "text": text,
                    "created_at": int(time.time() * 1000),
                    "deadline": None,
                    "reply_topic": reply_topic,
                    "metadata": {},
                }
            )
            producer.produce(prefix + request_topic(tgt), value=value, key=rid.encode())
        producer.flush(30)
        seen: dict[str, dict[str, Any]] = {}
        end = time.monotonic() + args.timeout_s
        last = start
        while len(seen) < len(rids) and time.monotonic() < end:
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            reply = decode_result(msg.value() or b"")
            if reply["request_id"] in rids and reply["request_id"] not in seen:
                seen[reply["request_id"]] = reply
                last = time.time()
        elapsed = last - start
        by_worker: dict[str, int] = {}
        for r in seen.values():
            by_worker[r["worker_id"]] = by_worker.get(r["worker_id"], 0) + 1
        return {
            "workers": len(cpus),
            "cpus_per_worker": list(cpus),
            "requests": len(rids),
            "answered": len(seen),
            "ok": sum(1 for r in seen.values() if r["status"] == "OK"),
            "elapsed_s": round(elapsed, 2),
            "requests_per_s": round(len(seen) / elapsed, 3) if elapsed > 0 else None,
            "tokens_out": sum(int(r["tokens_out"]) for r in seen.values()),
            "replies_by_worker": by_worker,
            "worker_ports": ports,  # each worker's own probe and metrics ports (auto)
        }
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        consumer.close()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--max-new-tokens", type=int, default=48, help="output cap per request")
    p.add_argument("--bootstrap", default=os.environ.get("TOLK_BOOTSTRAP", "127.0.0.1:9092"))
    p.add_argument(
        "--redis-url", default=os.environ.get("TOLK_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> JSON:
    args = parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    if half < 1:
        raise SystemExit("scale_out needs at least 2 CPUs")
    everything = ",".join(map(str, cpus))
    halves = [",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half : 2 * half]))]
    with tempfile.TemporaryDirectory(prefix="tolk-scale-") as tmp:
        one = _measure(args, [everything], Path(tmp))
        two = _measure(args, halves, Path(tmp))
    result: JSON = {
        "bench": "scale_out",
        "command": "python -m bench.scale_out " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model,
        "machine": machine_info(),
        "one_worker": one,
        "two_workers": two,
        "two_over_one_throughput": safe_ratio(two["requests_per_s"], one["requests_per_s"]),
    }
    print(dump(result))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
