"""Soak: worker processes under steady load and injected faults; counts native crashes,
unanswered requests and duplicate replies (issue 26: a worker died in librdkafka silently).

    python -m bench.soak --minutes 30 --out soak.json       # the full soak (defaults)
    python -m bench.soak --minutes 5 --rate 0.3 --stall-every-s 30 --restart-every-s 100 \
        --rebalance-every-s 120 --extra-hold-s 40 --quiet-tail-s 60   # a harness check

All on loopback, all started and ended by the harness: a private `redis-server` on a free port
(`--redis-url`: an existing one, which the stalls then hit for everyone); `--workers` (2) `tolk
worker` processes (`python -m workers.cli worker`: the real CLI, faulthandler on) in one group
on fresh topics (4 partitions per language), `--model` smollm2-135m, output cap
`--max-new-tokens` (16), one OpenMP thread each, cache off; an open-loop load of real support
turns (de, en) at `--rate` req/s (4: about half of what two workers served from a backlog on a
quiet 2-vCPU machine, `bench/scale_out.py`; restarts take a worker out), unique request ids, no
deadline (every request must be answered). Faults on a schedule: a Redis stall (`DEBUG SLEEP
--stall-s`) every `--stall-every-s`; a rebalance every `--rebalance-every-s` (a third worker
joins, leaves by SIGTERM `--extra-hold-s` after its first assignment); a SIGTERM restart of one
base worker (round robin, only while every base worker is assigned) every `--restart-every-s`.
No restart or join starts in the last `--quiet-tail-s` of the load.

After the load, up to `--drain-s` for the last replies; then SIGTERM to every worker (SIGKILL
after `--term-timeout-s`), redis stopped, topics deleted. The JSON (stdout, `--out`): native
crashes (a worker ended by SIGSEGV/SIGBUS/SIGABRT/SIGILL/SIGFPE or with "Fatal Python error" on
its stderr; the dump's first lines kept), other unexpected exits, workers SIGKILLed, requests
sent / answered / unanswered, duplicate replies (records beyond the first per request id),
statuses, latency, faults injected, a timeline. Logs stay in `--log-dir` (default: a temporary
directory). Every loop is bounded in time. The counting is `bench/soak_report.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench._common import JSON, dump, machine_info, thread_env, write_json
from bench.soak_report import Tally, classify_exit, report

REPO = Path(__file__).resolve().parents[1]
LANGS = ("de", "en")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class Incarnation:
    """One worker process."""

    name: str  # slot#n
    proc: subprocess.Popen[bytes]
    log: Path
    started: float
    ready_at: float | None = None  # when its log first said "assigned ["
    term_at: float | None = None  # when the harness sent SIGTERM
    killed: bool = False  # the harness had to SIGKILL it
    exit_code: int | None = None


def _texts() -> list[tuple[str, str, str]]:
    rows = []
    with open(REPO / "workers" / "data" / "support_sample.jsonl", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r["target_lang"] in LANGS:
                rows.append((r["source_lang"], r["target_lang"], r["text"]))
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check_loopback(bootstrap: str, redis_url: str | None) -> None:
    hosts = [b.rsplit(":", 1)[0].strip("[]") for b in bootstrap.split(",")]
    if redis_url:
        hosts.append(urlsplit(redis_url).hostname or "")
    bad = [h for h in hosts if h not in LOOPBACK]
    if bad:
        raise SystemExit(f"soak runs on loopback only, not on {bad}")


class Harness:
    def __init__(self, args: argparse.Namespace, logs: Path) -> None:
        self.args = args
        self.logs = logs
        self.prefix = f"soak{uuid.uuid4().hex[:8]}."
        self.group = f"soak-{uuid.uuid4().hex[:8]}"
        self.tally = Tally()
        self.slots: dict[str, Incarnation | None] = {}
        self.counts: dict[str, int] = {}
        self.redis_proc: subprocess.Popen[bytes] | None = None
        self.redis_port = 0
        self.redis_url = args.redis_url
        self.stallers: list[subprocess.Popen[bytes]] = []
        self.t0 = time.monotonic()

    # -- processes --------------------------------------------------------------------------

    def start_redis(self) -> None:
        if self.redis_url:
            self.redis_port = urlsplit(self.redis_url).port or 6379
            return
        self.redis_port = _free_port()
        cmd = ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1"]
        cmd += ["--save", "", "--appendonly", "no", "--enable-debug-command", "local"]
        out = (self.logs / "redis.log").open("wb")
        self.redis_proc = subprocess.Popen(cmd, stdout=out, stderr=out)
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        end = time.monotonic() + 20
        while time.monotonic() < end:
            if self._redis_cli("PING").strip() == b"PONG":
                return
            time.sleep(0.2)
        raise RuntimeError("private redis-server did not answer within 20 s")

    def _redis_cli(self, *cmd: str) -> bytes:
        run = subprocess.run(
            ["redis-cli", "-p", str(self.redis_port), *cmd], capture_output=True, timeout=10
        )
        return run.stdout

    def stall_redis(self) -> None:
        self.stallers = [p for p in self.stallers if p.poll() is None]
        cmd = ["redis-cli", "-p", str(self.redis_port), "DEBUG", "SLEEP", str(self.args.stall_s)]
        self.stallers.append(
            subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
        self.tally.faults["redis_stalls"] += 1
        self.event(f"redis DEBUG SLEEP {self.args.stall_s:g}")

    def start_worker(self, slot: str) -> Incarnation:
        a = self.args
        n = self.counts[slot] = self.counts.get(slot, 0) + 1
        name = f"{slot}#{n}"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
        env |= {
            **thread_env(1),
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            "TOLK_BOOTSTRAP": a.bootstrap,
            "TOLK_REDIS_URL": self.redis_url or "",
            "TOLK_TOPIC_PREFIX": self.prefix,
            "TOLK_GROUP_ID": self.group,
            "TOLK_WORKER_ID": f"soak-{slot}-{n}",
            "TOLK_LANGUAGES": ",".join(LANGS),
            "TOLK_CACHE": "0",
            "TOLK_POLICIES": ",".join(f"{lang}:1:600:4096:{a.max_new_tokens}" for lang in LANGS),
            "TOLK_HEALTH_PORT": "0",
        }
        log = self.logs / f"worker-{slot}-{n}.log"
        cmd = [sys.executable, "-m", "workers.cli", "worker", "--model", a.model]
        cmd += ["--metrics-port", "0"]
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=out)
        inc = Incarnation(name, proc, log, time.monotonic())
        self.slots[slot] = inc
        return inc

    def terminate(self, inc: Incarnation) -> None:
        if inc.term_at is None and inc.proc.poll() is None:
            inc.proc.send_signal(signal.SIGTERM)
            inc.term_at = time.monotonic()

    def reap(self, slot: str, now: float) -> Incarnation | None:
        """The slot's process if it ended (recorded), else None; SIGKILL past the timeout."""
        inc = self.slots.get(slot)
        if inc is None:
            return None
        rc = inc.proc.poll()
        if rc is None:
            if inc.term_at is not None and now - inc.term_at > self.args.term_timeout_s:
                inc.proc.kill()
                inc.killed = True
            return None
        inc.exit_code = rc
        self.tally.exits.append(self._classify(inc))
        self.slots[slot] = None
        return inc

    def _classify(self, inc: Incarnation) -> JSON:
        out = classify_exit(inc.exit_code, inc.log.read_text(errors="replace"))
        out |= {"worker": inc.name, "asked_to_stop": inc.term_at is not None}
        out |= {"killed_by_harness": inc.killed, "ran_s": round(time.monotonic() - inc.started, 1)}
        return out

    def wait_ready(self, incs: Sequence[Incarnation], timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for inc in incs:
                if inc.proc.poll() is not None:
                    raise RuntimeError(f"worker {inc.name} exited at start; see {inc.log}")
            if all("assigned [" in inc.log.read_text(errors="replace") for inc in incs):
                return
            time.sleep(0.5)
        raise RuntimeError(f"workers not assigned within {timeout:.0f} s; logs in {self.logs}")

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> JSON:
        from confluent_kafka import Consumer, Producer, TopicPartition

        from topics.admin import ensure_topics
        from topics.catalog import REPLIES, catalog

        a = self.args
        specs = catalog(LANGS, partitions=4, prefix=self.prefix)
        ensure_topics(a.bootstrap, specs)
        reply_topic = self.prefix + REPLIES
        consumer = Consumer({"bootstrap.servers": a.bootstrap, "group.id": f"{self.group}-r"})
        parts = consumer.list_topics(reply_topic, timeout=10).topics[reply_topic].partitions
        consumer.assign([TopicPartition(reply_topic, p, 0) for p in sorted(parts)])
        producer = Producer({"bootstrap.servers": a.bootstrap, "linger.ms": 5})
        error = None
        try:
            self.start_redis()
            base = [f"w{k}" for k in range(a.workers)]
            self.wait_ready([self.start_worker(s) for s in base], a.start_timeout_s)
            self._loop(consumer, producer, reply_topic, base)
        except RuntimeError as exc:  # no start: the figures of nothing, and why
            error = str(exc)
        finally:
            self._shutdown(consumer, producer, [s.name for s in specs])
        return {"error": error, **self._report()} if error else self._report()

    def _loop(self, consumer: Any, producer: Any, reply_topic: str, base: list[str]) -> None:
        a = self.args
        texts = _texts()
        start = time.monotonic()
        load_end = start + a.minutes * 60
        faults_end = load_end - a.quiet_tail_s  # no restart / join starts after this
        hard_end = load_end + a.drain_s
        next_send = start
        next_stall = start + a.stall_every_s / 2
        next_restart = start + a.restart_every_s
        next_join = start + a.rebalance_every_s * 0.75
        restart_turn = 0
        seq = 0
        while True:
            now = time.monotonic()
            while now < load_end and next_send <= now:  # open loop: the schedule, not replies
                self._send(producer, reply_topic, texts[seq % len(texts)], seq)
                seq += 1
                next_send += 1.0 / a.rate
            producer.poll(0)
            for msg in consumer.consume(num_messages=500, timeout=0.05):
                self._take_reply(msg)
            if a.stall_every_s > 0 and now < load_end and now >= next_stall:
                self.stall_redis()
                next_stall += a.stall_every_s
            if a.restart_every_s > 0 and faults_end > now >= next_restart:
                # only while every base worker serves: a restart never leaves the group empty
                if all(self.ready(self.slots.get(b)) for b in base):
                    inc = self.slots[base[restart_turn % len(base)]]
                    assert inc is not None
                    self.terminate(inc)
                    self.event(f"SIGTERM {inc.name} (restart)")
                    self.tally.faults["restarts"] += 1
                    restart_turn += 1
                    next_restart += a.restart_every_s
                else:
                    next_restart += 5.0
            if a.rebalance_every_s > 0 and faults_end > now >= next_join:
                if self.slots.get("x") is None:
                    self.event(f"start {self.start_worker('x').name} (join)")
                next_join += a.rebalance_every_s
            self._extra_leaves(now)
            for slot in [*base, "x"]:
                ended = self.reap(slot, now)
                if ended is not None:
                    self.event(f"{ended.name} exited {ended.exit_code}")
                    if slot in base and now < hard_end - 60:  # a restart, or an unplanned exit
                        self.event(f"start {self.start_worker(slot).name}")
            if now >= load_end and (
                now >= hard_end or all(rid in self.tally.replies for rid in self.tally.sent)
            ):
                return

    def _extra_leaves(self, now: float) -> None:
        """The extra worker leaves `--extra-hold-s` after it joined the group (got its first
        assignment); one that never joins within `--start-timeout-s` is stopped as well."""
        extra = self.slots.get("x")
        if extra is None or extra.term_at is not None:
            return
        if self.ready(extra):
            assert extra.ready_at is not None
            if now >= extra.ready_at + self.args.extra_hold_s:
                self.terminate(extra)
                self.event(f"SIGTERM {extra.name} (leave)")
                self.tally.faults["leaves"] += 1
        elif now - extra.started > self.args.start_timeout_s:
            self.terminate(extra)

    def ready(self, inc: Incarnation | None) -> bool:
        """The worker got its first assignment (its log says "assigned [")."""
        if inc is None or inc.proc.poll() is not None or inc.term_at is not None:
            return False
        if inc.ready_at is None and "assigned [" in inc.log.read_text(errors="replace"):
            inc.ready_at = time.monotonic()
            if inc.name.startswith("x#"):
                self.tally.faults["joins"] += 1
                self.event(f"{inc.name} joined")
        return inc.ready_at is not None

    def event(self, what: str) -> None:
        if len(self.tally.events) < 2000:
            self.tally.events.append((round(time.monotonic() - self.t0, 1), what))

    def _send(self, producer: Any, reply_topic: str, row: tuple[str, str, str], i: int) -> None:
        from schemas.codec import encode_request
        from topics.catalog import request_topic

        src, tgt, text = row
        rid = f"{self.prefix}{i}"
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
        for _ in range(100):  # a full local queue: serve delivery reports, try again
            try:
                producer.produce(self.prefix + request_topic(tgt), value=value, key=rid.encode())
                break
            except BufferError:
                producer.poll(0.05)
        self.tally.sent[rid] = time.time()

    def _take_reply(self, msg: Any) -> None:
        from schemas.codec import SchemaError, decode_result

        if msg.error() is not None:
            return
        try:
            reply = decode_result(msg.value() or b"")
        except SchemaError:
            return
        rid = str(reply.get("request_id"))
        if rid not in self.tally.sent:
            return
        seen = self.tally.replies.setdefault(rid, [])
        if not seen:
            self.tally.latency_s.append(time.time() - self.tally.sent[rid])
        seen.append((str(reply.get("worker_id")), str(reply.get("status"))))
        if reply.get("status") != "OK":
            why = str(reply.get("error") or "")[:120]
            self.tally.errors[why] = self.tally.errors.get(why, 0) + 1

    def _shutdown(self, consumer: Any, producer: Any, topics: list[str]) -> None:
        live = [inc for inc in self.slots.values() if inc is not None]
        for inc in live:
            self.terminate(inc)
        end = time.monotonic() + self.args.term_timeout_s + 15
        while any(self.slots.values()) and time.monotonic() < end:
            for slot in list(self.slots):
                self.reap(slot, time.monotonic())
            time.sleep(0.2)
        for left in self.slots.values():  # still there after the kill: give up waiting
            if left is not None and left.proc.poll() is None:
                left.proc.kill()
        for p in self.stallers:
            if p.poll() is None:
                p.kill()
        if self.redis_proc is not None:
            self.redis_proc.terminate()
            try:
                self.redis_proc.wait(10)
            except subprocess.TimeoutExpired:
                self.redis_proc.kill()
        producer.flush(5)
        consumer.close()
        try:
            from confluent_kafka.admin import AdminClient

            admin = AdminClient({"bootstrap.servers": self.args.bootstrap})
            for fut in admin.delete_topics(topics, operation_timeout=10).values():
                fut.result(15)
        except Exception as exc:  # leftover topics under a unique prefix are harmless
            print(f"soak: topics not deleted: {exc}", file=sys.stderr)

    def _report(self) -> JSON:
        return report(self.tally)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="minutes of load")
    p.add_argument("--workers", type=int, default=2, help="base workers (a third joins/leaves)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-new-tokens", type=int, default=16, help="output cap per request")
    p.add_argument("--rate", type=float, default=4.0, help="requests/s, open loop")
    p.add_argument("--stall-every-s", type=float, default=60.0, help="0 = no redis stalls")
    p.add_argument("--stall-s", type=float, default=2.0, help="length of one redis stall")
    p.add_argument("--rebalance-every-s", type=float, default=240.0, help="0 = no extra worker")
    p.add_argument("--extra-hold-s", type=float, default=90.0, help="the extra worker's stay")
    p.add_argument("--restart-every-s", type=float, default=180.0, help="0 = no restarts")
    p.add_argument("--quiet-tail-s", type=float, default=120.0, help="no restart/join this late")
    p.add_argument("--drain-s", type=float, default=300.0, help="wait for the last replies")
    p.add_argument("--term-timeout-s", type=float, default=60.0, help="SIGTERM, then SIGKILL")
    p.add_argument("--start-timeout-s", type=float, default=1200.0, help="model load + join")
    p.add_argument("--bootstrap", default=os.environ.get("TOLK_BOOTSTRAP", "127.0.0.1:9092"))
    p.add_argument("--redis-url", default=None, help="default: a private redis-server")
    p.add_argument("--log-dir", default=None, help="keep the worker logs here")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.rate <= 0 or args.minutes <= 0 or args.workers < 1:
        p.error("--rate and --minutes must be > 0, --workers >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> JSON:
    args = parse_args(argv)
    _check_loopback(args.bootstrap, args.redis_url)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="tolk-soak-") as tmp:
        logs = Path(args.log_dir) if args.log_dir else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        harness = Harness(args, logs)
        figures = harness.run()
    result: JSON = {
        "bench": "soak",
        "command": "python -m bench.soak " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "log_dir")},
        "wall_s": round(time.time() - started, 1),
        "machine": machine_info(),
        **figures,
    }
    print(dump(result))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
