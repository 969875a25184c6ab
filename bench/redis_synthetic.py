"""Old and new Redis handling side by side, under the same CPU load (issue 26 item 3).

    python -m bench.redis_synthetic --seconds 120 --out bench/out/redis_synthetic.json

`bench.redis_probe` runs real workers, whose start (model load, backend calibration) takes
minutes on a busy 2-vCPU host. This one isolates what matters for the Redis calls and runs the
two behaviours at the same time, so both see the same load:

* two processes (`old`, `new`; `--pairs N`: N of each), each shaped like a busy worker: an
  engine thread running float32 projections of SmolLM2-135M's sizes (8 x 576 @ 576 x 1536
  and back, torch's default thread count, so the GIL is released inside each op and taken
  between them), a poll thread that every 20 ms looks up 4 new request ids (MGET), stores a
  result for each (SET EX, the delivery path) and reads the L2 cache (GET), and a writer
  thread that writes the L2 (SET);
* through the real classes: `RedisResultStore` in `CircuitBreakerStore`, and
  `RedisTranslationCache` in `CacheBreaker`, 0.3 s socket timeout, 1 s retry_after;
* `old`: patience 0 (a timeout opens the breaker at once, as before) and a failed result write
  is dropped ("not stored"); `new`: patience `--patience-s` (2 s, the default setting) and a
  failed write is kept and written again (`workers.store.unstored.UnstoredResults`).

Each process records every Redis call (`bench.redis_probe.instrument`: wall, thread CPU,
run-queue wait, GIL wait) and counts: results not stored at the first try, results missing at
the end (an MGET of every id after the run), lookups failed, L2 outages (the breaker opening).
The parent samples redis-server's run-queue wait and the host's CPU pressure meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.redis_probe import (
    _redis_info,
    _redis_pid,
    _ServerSampler,
    _summarize_calls,
    instrument,
)

REPO = Path(__file__).resolve().parents[1]


def _engine(stop: threading.Event, steps: list[int]) -> None:
    import torch

    x = torch.randn(8, 576)
    up, down = torch.randn(576, 1536), torch.randn(1536, 576)
    while not stop.is_set():
        for _ in range(30):  # one decode step: 30 layers
            x = torch.nn.functional.silu(x @ up) @ down
            x = x / (x.norm() + 1.0)
        steps[0] += 1


def child(mode: str, seconds: float, url: str, patience_s: float, calls: str) -> dict[str, Any]:
    instrument(calls)
    from workers.cache_ttl import parse_ttl_tiers
    from workers.stages.cache.key import CacheKey
    from workers.stages.cache.redis_l2 import (
        CacheBreaker,
        CacheUnavailable,
        RedisTranslationCache,
    )
    from workers.store.results import CircuitBreakerStore, RedisResultStore, ResultStoreError
    from workers.store.unstored import UnstoredResults

    new = mode == "new"
    prefix = f"tolk:probe:{uuid.uuid4().hex[:8]}:"
    counts = {"not_stored_first_try": 0, "lookups_failed": 0, "l2_outages": 0, "l2_get_failed": 0}
    retries = {"results": 0, "l2": 0}
    store = CircuitBreakerStore(
        RedisResultStore(url, ttl_s=600, key_prefix=prefix + "result:", socket_timeout_s=0.3),
        patience_s=patience_s if new else 0.0,
        on_retry=lambda op: retries.__setitem__("results", retries["results"] + 1),
    )
    l2 = CacheBreaker(
        RedisTranslationCache(
            url, parse_ttl_tiers("*:600"), key_prefix=prefix, socket_timeout_s=0.3
        ),
        patience_s=patience_s if new else 0.0,
        on_state=lambda up: None
        if up
        else counts.__setitem__("l2_outages", counts["l2_outages"] + 1),
        on_retry=lambda op: retries.__setitem__("l2", retries["l2"] + 1),
    )
    kept = UnstoredResults(store.put)
    writes: list[tuple[CacheKey, str]] = []
    writes_lock = threading.Condition()
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set() or writes:
            with writes_lock:
                while not writes and not stop.is_set():
                    writes_lock.wait(0.1)
                batch, writes[:] = list(writes), []
            for key, text in batch:
                with contextlib.suppress(CacheUnavailable):
                    l2.put(key, text)

    steps = [0]
    threads = [
        threading.Thread(target=_engine, args=(stop, steps), name="engine", daemon=True),
        threading.Thread(target=writer, name="l2-writer", daemon=True),
    ]
    for t in threads:
        t.start()
    ids: list[str] = []
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        batch = [f"r{n + i}" for i in range(4)]
        n += 4
        try:
            store.get_many(batch)
        except ResultStoreError:
            counts["lookups_failed"] += 1
        for rid in batch:
            ids.append(rid)
            try:
                store.put(rid, b"x" * 200)
            except ResultStoreError:
                counts["not_stored_first_try"] += 1
                if new:
                    kept.add(rid, b"x" * 200, time.monotonic())
            key = CacheKey("de", f"{n:032x}")
            try:
                l2.get(key)
            except CacheUnavailable:
                counts["l2_get_failed"] += 1
            with writes_lock:
                writes.append((key, "text"))
                writes_lock.notify()
        if new:
            kept.retry_due(time.monotonic())
        time.sleep(0.02)
    stop.set()
    for t in threads:
        t.join(30)
    if new:
        kept.flush()
    time.sleep(0.5)
    import redis

    check = redis.Redis.from_url(url)
    missing = 0
    for i in range(0, len(ids), 500):
        chunk = ids[i : i + 500]
        values: Any = check.mget([prefix + "result:" + r for r in chunk])
        missing += sum(v is None for v in values)
    keys = [prefix + "result:" + r for r in ids]
    for i in range(0, len(keys), 1000):
        check.delete(*keys[i : i + 1000])
    return {
        "mode": mode,
        "results": len(ids),
        "results_missing_at_end": missing,
        "stored_late": kept.stored,
        "dropped": kept.dropped,
        "retries": retries,
        "engine_steps": steps[0],
        **counts,
    }


def _totals(rows: list[dict[str, Any]]) -> dict[str, int]:
    keys = ["results", "results_missing_at_end", "not_stored_first_try", "stored_late"]
    keys += ["dropped", "lookups_failed", "l2_outages", "l2_get_failed"]
    out = {k: sum(int(r[k]) for r in rows) for k in keys}
    out["retries"] = sum(sum(r["retries"].values()) for r in rows)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        _, mode, seconds, url, patience, calls = argv
        print(json.dumps(child(mode, float(seconds), url, float(patience), calls)))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--patience-s", type=float, default=2.0)
    p.add_argument("--pairs", type=int, default=1, help="old/new process pairs")
    p.add_argument(
        "--redis-url", default=os.environ.get("TOLK_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    p.add_argument("--logs", default=None, help="call records (default: a new temp dir)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import redis

    from bench._common import cpu_model, dump, write_json

    logs = Path(args.logs or tempfile.mkdtemp(prefix="tolk-redis-synthetic-"))
    logs.mkdir(parents=True, exist_ok=True)
    client = redis.Redis.from_url(args.redis_url)
    before = _redis_info(client)
    client.slowlog_reset()
    sampler = _ServerSampler(_redis_pid())
    load1 = os.getloadavg()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = {}
    for k in range(args.pairs):
        for mode in ("old", "new"):
            record = logs / f"calls-{mode}{k}.jsonl"
            record.unlink(missing_ok=True)
            cmd = [sys.executable, "-m", "bench.redis_synthetic", "--child", mode]
            cmd += [str(args.seconds), args.redis_url, str(args.patience_s), str(record)]
            procs[f"{mode}{k}"] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE)
    out = {
        m: json.loads(p.communicate()[0].decode().strip().splitlines()[-1])
        for m, p in procs.items()
    }
    load2 = os.getloadavg()
    server = sampler.stop()
    after = _redis_info(client)
    result = {
        "bench": "redis_synthetic",
        "command": "python -m bench.redis_synthetic " + " ".join(argv),
        "cpu": cpu_model(),
        "loadavg_start": load1,
        "loadavg_end": load2,
        "server": {
            **server,
            "commandstats": {
                k: round(
                    (after[k]["usec"] - before.get(k, {"usec": 0})["usec"])
                    / max(1, after[k]["calls"] - before.get(k, {"calls": 0})["calls"]),
                    2,
                )
                for k in after
            },
            "slowlog": [str(s) for s in client.slowlog_get(10)],  # type: ignore[union-attr]
        },
        "totals": {
            m: _totals([v for k, v in out.items() if k.startswith(m)]) for m in ("old", "new")
        },
        "processes": {
            m: {**out[m], "calls": _summarize_calls(logs / f"calls-{m}.jsonl")} for m in out
        },
    }
    print(dump(result))
    write_json(result, args.out)


if __name__ == "__main__":
    main()
