"""What the fault tests are built from: worker processes, load, topic readers, a ledger.

The private Kafka + redis they run against is `tests.faults.private_stack.PrivateStack`.

* `WorkerProcess`: a real worker process (`tests/faults/worker_main.py`: the fake engine or a
  real model), so SIGKILL is a real kill.
* `LoadGenerator`: an open-loop producer thread (a fixed schedule, latency measured from the
  scheduled send time, not from when a slow send got out: no coordinated omission) of valid
  Avro requests; it records each request's partition and offset from its delivery report.
* `TopicTail`: reads a topic from the beginning on a thread and keeps every record with its
  partition, offset and arrival time; the replies and the dead letters are read with it.
* `OffsetProbe`: a consumer group's committed offsets and topics' high watermarks, asked of
  the broker while a fault runs.
* `ledger_report()`: sent / answered / lost / duplicates / duplicates with a different text for
  one test, printed as one JSON line (``FAULTS {...}``, visible with ``-s`` and in the captured
  output of a failure).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from schemas.codec import encode_request
from tests.faults.private_stack import REPO, last_lines
from tests.workers.fakes import TopicReader
from topics.catalog import REPLIES, request_topic

# librdkafka's own lines (a refused connection every 50 ms while a broker is down) go to
# Python logging, where pytest keeps them with a failed test's captured log.
KAFKA_LOG = logging.getLogger("tests.faults.kafka")


# -- topics, workers ----------------------------------------------------------------------------


def new_prefix(name: str) -> str:
    """A topic prefix of one test: its own request, reply and dead-letter topics."""
    return f"f{name}{uuid.uuid4().hex[:6]}."


WORKER_MAIN = (sys.executable, "-m", "tests.faults.worker_main")


class WorkerProcess:
    """A worker as a child process: `command` (default `tests/faults/worker_main.py`) with
    `args` as its JSON argument; it prints `READY` once its engine is warm if it was told to hold
    (`hold_until`) and `ASSIGNED` once it owns partitions; stderr goes to `log_path`."""

    def __init__(
        self, args: dict[str, Any], log_path: Path, command: Sequence[str] = WORKER_MAIN
    ) -> None:
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("ab")
        self.ready = threading.Event()
        self.assigned = threading.Event()
        self.proc = subprocess.Popen(
            [*command, json.dumps(args)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(b"READY"):
                self.ready.set()
            elif line.startswith(b"ASSIGNED"):
                self.assigned.set()

    def wait_ready(self, timeout: float = 60) -> None:
        self._wait(self.ready, "ready", timeout)

    def wait_assigned(self, timeout: float = 60) -> None:
        self._wait(self.assigned, "assigned", timeout)

    def _wait(self, event: threading.Event, what: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not event.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise AssertionError(
                    f"worker not {what} (exit {self.proc.poll()}); log {self.log_path}:\n"
                    + last_lines(self.log_path.read_text(errors="replace"))
                )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()

    def terminate(self, timeout: float = 30) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def scrape_metrics(port: int) -> dict[str, float]:
    """The worker's /metrics as {'name{labels}': value} (comments dropped)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


# -- load ----------------------------------------------------------------------------------------


def request_record(
    rid: str, lang: str, text: str, reply_topic: str, **fields: Any
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "request_id": rid,
        "conversation_id": None,
        "source_lang": "en",
        "target_lang": lang,
        "text": text,
        "created_at": int(time.time() * 1000),
        "deadline": None,
        "reply_topic": reply_topic,
        "metadata": {},
    }
    record.update(fields)
    return record


@dataclass
class Sent:
    """One request of a load generator."""

    lang: str
    text: str
    scheduled: float  # time.monotonic() it was due: latency is measured from here
    partition: int = -1  # from the delivery report
    offset: int = -1


class LoadGenerator:
    """Produces valid requests at `rate` per second over `languages` (round robin) on a thread
    until `stop()`; `sent` maps request id -> `Sent`."""

    def __init__(
        self,
        bootstrap: str,
        prefix: str,
        languages: Sequence[str],
        rate: float,
        *,
        partition_of: Callable[[int], int | None] = lambda i: None,
        seed: int = 0,
    ) -> None:
        self.prefix = prefix
        self.languages = tuple(languages)
        self.rate = rate
        self.run_id = uuid.uuid4().hex[:8]
        self.sent: dict[str, Sent] = {}
        self.undelivered: list[str] = []
        self._partition_of = partition_of
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.producer = Producer(
            {"bootstrap.servers": bootstrap, "linger.ms": 5, "logger": KAFKA_LOG}
        )
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)

    def start(self) -> LoadGenerator:
        self._thread.start()
        return self

    def _text(self, i: int) -> str:
        words = ["order", "where", "is", "my", "parcel", "please", "help", "today", "thanks"]
        return f"m{i} " + " ".join(self._rng.choice(words) for _ in range(self._rng.randint(2, 8)))

    def _on_delivery(self, rid: str) -> Callable[[KafkaError | None, Any], None]:
        def done(err: KafkaError | None, msg: Any) -> None:
            with self._lock:
                if err is not None:
                    self.undelivered.append(rid)
                else:
                    self.sent[rid].partition = msg.partition()
                    self.sent[rid].offset = msg.offset()

        return done

    def _run(self) -> None:
        start = time.monotonic()
        i = 0
        while not self._stop.is_set():
            due = start + i / self.rate
            wait = due - time.monotonic()
            if wait > 0:
                self.producer.poll(min(wait, 0.05))
                continue
            lang = self.languages[i % len(self.languages)]
            rid = f"{self.run_id}-{i}"
            text = self._text(i)
            with self._lock:
                self.sent[rid] = Sent(lang, text, due)
            value = encode_request(request_record(rid, lang, text, self.prefix + REPLIES))
            kwargs: dict[str, Any] = {}
            part = self._partition_of(i)
            if part is not None:
                kwargs["partition"] = part
            while True:
                try:
                    self.producer.produce(
                        self.prefix + request_topic(lang),
                        value=value,
                        key=rid.encode(),
                        on_delivery=self._on_delivery(rid),
                        **kwargs,
                    )
                    break
                except BufferError:
                    self.producer.poll(0.05)
            i += 1
        self.producer.poll(0)

    def stop(self, flush_timeout: float = 120) -> None:
        self._stop.set()
        self._thread.join(10)
        left = self.producer.flush(flush_timeout)
        assert left == 0, f"{left} requests still not delivered to the broker"

    def rids(self) -> set[str]:
        with self._lock:
            return set(self.sent)


# -- reading topics ------------------------------------------------------------------------------


@dataclass
class Seen:
    """One record read from a topic."""

    partition: int
    offset: int
    arrived: float  # time.monotonic() when read
    value: bytes
    decoded: dict[str, Any] = field(default_factory=dict)


class TopicTail(TopicReader):
    """A `TopicReader` whose records are `Seen` (partition, offset, arrival time, value);
    `decode` turns a value into a dict (its exceptions leave `decoded` empty)."""

    def __init__(
        self, bootstrap: str, topic: str, decode: Callable[[bytes], dict[str, Any]]
    ) -> None:
        self._decode = decode
        super().__init__(bootstrap, topic, **{"fetch.wait.max.ms": 20, "logger": KAFKA_LOG})

    def _record(self, msg: Any) -> Seen:
        value = msg.value() or b""
        seen = Seen(msg.partition() or 0, msg.offset() or 0, time.monotonic(), value)
        with contextlib.suppress(Exception):
            seen.decoded = self._decode(value)
        return seen

    def by_request_id(self) -> dict[str, list[Seen]]:
        out: dict[str, list[Seen]] = {}
        for seen in self.snapshot():
            out.setdefault(str(seen.decoded.get("request_id", "")), []).append(seen)
        return out


def wait_until(pred: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll `pred` every 0.1 s; the seconds it took, or AssertionError after `timeout`."""
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - start


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, int(-(-q * len(ordered) // 100)))
    return ordered[min(rank, len(ordered)) - 1]


def ledger_report(test: str, sent: set[str], replies: TopicTail, **extra: Any) -> dict[str, Any]:
    """Sent / answered / lost / duplicates of the requests `sent`, printed as one JSON line."""
    by_id = replies.by_request_id()
    answered = sent & set(by_id)
    dup_ids = [rid for rid in answered if len(by_id[rid]) > 1]
    different = [rid for rid in dup_ids if len({s.decoded.get("text") for s in by_id[rid]}) > 1]
    statuses: dict[str, int] = {}
    for rid in answered:
        status = str(by_id[rid][0].decoded.get("status"))
        statuses[status] = statuses.get(status, 0) + 1
    report = {
        "test": test,
        "sent": len(sent),
        "answered": len(answered),
        "lost": len(sent - answered),
        "duplicates": sum(len(by_id[rid]) - 1 for rid in dup_ids),
        "duplicate_ids": len(dup_ids),
        "duplicates_different_text": len(different),
        "statuses": statuses,
        "lost_sample": sorted(sent - answered)[:5],
        **extra,
    }
    print("FAULTS " + json.dumps(report, sort_keys=False), flush=True)
    return report


# -- offsets -------------------------------------------------------------------------------------


class OffsetProbe:
    """Committed offsets of a consumer group and high watermarks of topics, asked of the broker
    (a Consumer's committed() with the group's id, never subscribing; a Consumer's
    get_watermark_offsets). Not AdminClient.list_consumer_group_offsets: librdkafka crashes
    the process when the broker answers it NOT_COORDINATOR (workers/kafka/drain.py's notes), which a
    broker restart of these tests can provoke."""

    def __init__(self, bootstrap: str) -> None:
        self._bootstrap = bootstrap
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"probe-{uuid.uuid4().hex}",
                "logger": KAFKA_LOG,
            }
        )

    def committed(self, group: str, tps: Sequence[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """(topic, partition) -> committed offset (-1001 when none yet)."""
        reader = Consumer(
            {
                "bootstrap.servers": self._bootstrap,
                "group.id": group,  # reads the group's offsets; never subscribes or commits
                "enable.auto.commit": False,
                "logger": KAFKA_LOG,
            }
        )
        try:
            parts = reader.committed([TopicPartition(t, p) for t, p in tps], timeout=15)
        finally:
            reader.close()
        return {(tp.topic, tp.partition): tp.offset for tp in parts}

    def high_watermarks(self, tps: Sequence[tuple[str, int]]) -> dict[tuple[str, int], int]:
        out = {}
        for topic, part in tps:
            _low, high = self._consumer.get_watermark_offsets(
                TopicPartition(topic, part), timeout=10, cached=False
            )
            out[(topic, part)] = int(high)
        return out

    def close(self) -> None:
        self._consumer.close()
