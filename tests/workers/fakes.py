"""In-memory stand-ins for the worker's collaborators.

* `FakeEngine` implements `TranslationEngine`: it "translates" by prefixing the target language
  and reversing the words (`fake_translation`), resolves handles from its own thread after an
  optional delay, honours deadlines (EXPIRED) and cancel (CANCELLED), fails texts containing
  `FAIL_MARKER` (ERROR, that request alone), and can hold requests (`hold()` / `release()`) to
  test intake quotas. Poison: a request whose text contains `POISON_MARKER` (or that the
  `poison` predicate picks) makes the fake's "step" raise, and like the real engine
  (`Engine.results.fail_all`) every request of that batch then finishes ERROR with the exception's
  text. A marker in the text works from a subprocess too (tests/faults/).
* `FakeBroker` with `FakeConsumer` / `FakeProducer`: just enough of confluent-kafka's API
  (subscribe with rebalance callbacks, consume, pause/resume, seek, commit, produce with
  delivery callbacks, list_topics) for the worker's logic to run without a broker; faults on
  demand (`FakeConsumer.fail_seeks`, rebalances scheduled onto the poll thread with
  `schedule_revoke_all()` / `schedule_assign_all()`). The same worker tests then run against
  the real broker in test_worker_kafka.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from workers.engine.types import (
    FinishReason,
    GenerationResult,
    RequestHandle,
    Timings,
    TranslationRequest,
    UnsupportedLanguage,
)

FAIL_MARKER = "__fail__"
POISON_MARKER = "\u2620poison"  # a skull and "poison": the whole batch fails (see the notes)
POISON_ERROR = "RuntimeError: poisoned batch (fake engine step failed)"


def is_poison(text: str) -> bool:
    return POISON_MARKER in text


FAKE_LANGUAGES = ("en", "de", "fr", "es", "it")


def fake_translation(text: str, target_lang: str) -> str:
    return f"[{target_lang}] " + " ".join(reversed(text.split()))


@dataclass
class _Job:
    request_id: str
    text: str
    target_lang: str
    deadline: float | None
    handle: RequestHandle
    arrival: float = field(default_factory=time.monotonic)


class FakeEngine:
    """A `TranslationEngine` without a model."""

    def __init__(
        self,
        languages: Sequence[str] = FAKE_LANGUAGES,
        model_version: str = "fake-1",
        delay_s: float = 0.0,
        poison: Callable[[str], bool] = is_poison,
    ) -> None:
        self.model_version = model_version
        self.languages = tuple(languages)
        self.delay_s = delay_s
        self.poison = poison  # text -> does it make the engine's step raise?
        self.submitted: list[str] = []  # request ids, in submission order
        self.conversations: dict[str, str | None] = {}  # request id -> its conversation_id
        self._jobs: list[_Job] = []
        self._cancelled: set[str] = set()
        self._cv = threading.Condition()
        self._held = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self.started = 0
        self.stopped = 0

    # -- TranslationEngine --------------------------------------------------------------------

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        request_id, text, deadline = request.request_id, request.text, request.deadline
        source_lang, target_lang = request.source_lang, request.target_lang
        conversation_id = request.conversation_id
        if target_lang not in self.languages:
            raise UnsupportedLanguage(f"no prompt for target language {target_lang!r}")
        if source_lang and source_lang not in self.languages:
            raise UnsupportedLanguage(f"no prompt for source language {source_lang!r}")
        handle = RequestHandle(request_id, self._cancel)
        with self._cv:
            self.submitted.append(request_id)
            self.conversations[request_id] = conversation_id
            self._jobs.append(_Job(request_id, text, target_lang, deadline, handle))
            self._cv.notify_all()
        return handle

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def start(self) -> None:
        self.started += 1
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
            self._thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        self.stopped += 1
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # -- test controls ------------------------------------------------------------------------

    def hold(self) -> None:
        """Keep every request in flight until `release()`."""
        with self._cv:
            self._held = True

    def release(self) -> None:
        with self._cv:
            self._held = False
            self._cv.notify_all()

    def pending(self) -> int:
        with self._cv:
            return len(self._jobs)

    # -- the "model" --------------------------------------------------------------------------

    def _cancel(self, request_id: str) -> None:
        with self._cv:
            self._cancelled.add(request_id)
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._stop:
                        return
                    if self._held:  # only cancelled requests leave while held
                        jobs = [j for j in self._jobs if j.request_id in self._cancelled]
                    else:
                        jobs = list(self._jobs)
                    if jobs:
                        break
                    self._cv.wait(0.05)
                for j in jobs:
                    self._jobs.remove(j)
            if self.delay_s and jobs:
                time.sleep(self.delay_s)
            # one batch: a poison request fails it whole, as Engine.results.fail_all does
            poisoned = any(self.poison(j.text) for j in jobs if j.request_id not in self._cancelled)
            for job in jobs:
                job.handle.set_result(self._failed(job) if poisoned else self._finish(job))

    def _failed(self, job: _Job) -> GenerationResult:
        timings = Timings(total_s=time.monotonic() - job.arrival)
        return GenerationResult(
            job.request_id, [], "", FinishReason.ERROR, timings=timings, error=POISON_ERROR
        )

    def _finish(self, job: _Job) -> GenerationResult:
        now = time.monotonic()
        timings = Timings(queue_s=0.001, prefill_s=0.001, decode_s=0.002, total_s=now - job.arrival)
        if job.request_id in self._cancelled:
            return GenerationResult(
                job.request_id, [], "", FinishReason.CANCELLED, timings=timings, error="cancelled"
            )
        if job.deadline is not None and now > job.deadline:
            return GenerationResult(
                job.request_id,
                [],
                "",
                FinishReason.EXPIRED,
                timings=timings,
                error="deadline passed before prefill",
            )
        if FAIL_MARKER in job.text:
            return GenerationResult(
                job.request_id, [], "", FinishReason.ERROR, timings=timings, error="fake failure"
            )
        out = fake_translation(job.text, job.target_lang)
        n_out = len(out.split())
        return GenerationResult(
            job.request_id,
            list(range(n_out)),
            out,
            FinishReason.STOP,
            tokens_in=len(job.text.split()) + 10,
            tokens_out=n_out,
            cached_tokens=10,
            timings=timings,
        )


# -- an in-memory Kafka -----------------------------------------------------------------------


class FakeMessage:
    def __init__(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        ts: int,
        error: KafkaError | None = None,
    ) -> None:
        self._t, self._p, self._o, self._k, self._v, self._ts = (
            topic,
            partition,
            offset,
            key,
            value,
            ts,
        )
        self._e = error

    def topic(self) -> str:
        return self._t

    def partition(self) -> int:
        return self._p

    def offset(self) -> int:
        return self._o

    def key(self) -> bytes | None:
        return self._k

    def value(self) -> bytes | None:
        return self._v

    def timestamp(self) -> tuple[int, int]:
        return (1, self._ts)

    def error(self) -> KafkaError | None:
        return self._e


class _TopicMeta:
    def __init__(self, error: KafkaError | None) -> None:
        self.error = error


class _ClusterMeta:
    def __init__(self, topics: dict[str, _TopicMeta]) -> None:
        self.topics = topics


class FakeBroker:
    """Topics as lists of partitions of (key, value, timestamp); committed offsets per group."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.topics: dict[str, list[list[tuple[bytes | None, bytes | None, int]]]] = {}
        self.committed: dict[tuple[str, str, int], int] = {}  # (group, topic, part) -> offset
        self.commit_calls = 0

    def create_topic(self, name: str, partitions: int = 1) -> None:
        with self.lock:
            self.topics.setdefault(name, [[] for _ in range(partitions)])

    def append(self, topic: str, key: bytes | None, value: bytes | None, partition: int = 0) -> int:
        with self.lock:
            log = self.topics[topic][partition]
            log.append((key, value, int(time.time() * 1000)))
            return len(log) - 1

    def records(self, topic: str) -> list[tuple[bytes | None, bytes | None]]:
        with self.lock:
            return [(k, v) for part in self.topics.get(topic, []) for k, v, _ in part]

    def metadata(self, topic: str | None) -> _ClusterMeta:
        with self.lock:
            if topic is None:
                return _ClusterMeta({t: _TopicMeta(None) for t in self.topics})
            if topic in self.topics:
                return _ClusterMeta({topic: _TopicMeta(None)})
            err = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
            return _ClusterMeta({topic: _TopicMeta(err)})

    def consumer_factory(self) -> Callable[[dict[str, Any]], FakeConsumer]:
        return lambda conf: FakeConsumer(self, conf)

    def producer_factory(self) -> Callable[[dict[str, Any]], FakeProducer]:
        return lambda conf: FakeProducer(self, conf)


class FakeConsumer:
    """One group member that owns every partition of its subscribed topics."""

    def __init__(self, broker: FakeBroker, conf: dict[str, Any]) -> None:
        self.broker = broker
        self.conf = conf
        self.group = conf["group.id"]
        self._topics: list[str] = []
        self._cbs: dict[str, Any] = {}
        self._assignment: list[tuple[str, int]] = []
        self._position: dict[tuple[str, int], int] = {}
        self.paused: set[tuple[str, int]] = set()
        self.pause_calls = 0
        self.seeks: list[tuple[tuple[str, int], int]] = []
        self.fail_seeks = 0  # the next this many seek() calls raise KafkaException
        self.closed = False
        self._assigned = False
        self._scheduled: list[str] = []  # rebalances to run inside the next consume()

    def subscribe(
        self, topics: list[str], on_assign: Any = None, on_revoke: Any = None, on_lost: Any = None
    ) -> None:
        self._topics = list(topics)
        self._cbs = {"assign": on_assign, "revoke": on_revoke, "lost": on_lost}

    def incremental_assign(self, partitions: list[TopicPartition]) -> None:
        for p in partitions:
            tp = (p.topic, p.partition)
            self._assignment.append(tp)
            self._position[tp] = self.broker.committed.get((self.group, *tp), 0)

    def _rebalance(self) -> None:
        self._assigned = True
        with self.broker.lock:
            parts = [
                TopicPartition(t, i)
                for t in self._topics
                for i in range(len(self.broker.topics.get(t, [])))
            ]
        if self._cbs.get("assign"):
            self._cbs["assign"](self, parts)
        if not self._assignment:
            self.incremental_assign(parts)

    def revoke_all(self) -> None:
        """Simulate a cooperative revocation of everything (calls on_revoke)."""
        parts = [TopicPartition(t, p) for t, p in self._assignment]
        if self._cbs.get("revoke"):
            self._cbs["revoke"](self, parts)
        self._assignment.clear()
        self.paused.clear()

    def schedule_revoke_all(self) -> None:
        """Revoke everything inside the next consume() (on the poll thread, as librdkafka)."""
        with self.broker.lock:
            self._scheduled.append("revoke")

    def schedule_assign_all(self) -> None:
        """Assign every partition again inside the next consume() (from the committed
        offsets, as a new owner starts)."""
        with self.broker.lock:
            self._scheduled.append("assign")

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[FakeMessage]:
        if self.closed:
            raise RuntimeError("consumer closed")
        if not self._assigned:
            self._rebalance()
        with self.broker.lock:
            scheduled, self._scheduled = self._scheduled, []
        for event in scheduled:
            if event == "revoke":
                self.revoke_all()
            else:
                self._rebalance()
        out: list[FakeMessage] = []
        with self.broker.lock:
            for tp in self._assignment:
                if tp in self.paused:
                    continue
                log = self.broker.topics[tp[0]][tp[1]]
                pos = self._position[tp]
                while pos < len(log) and len(out) < num_messages:
                    k, v, ts = log[pos]
                    out.append(FakeMessage(tp[0], tp[1], pos, k, v, ts))
                    pos += 1
                self._position[tp] = pos
        if not out and timeout > 0:
            time.sleep(min(timeout, 0.01))
        return out

    def seek(self, partition: TopicPartition) -> None:
        """Fetch this partition from `partition.offset` on (as librdkafka's seek)."""
        tp = (partition.topic, partition.partition)
        if tp not in self._position:
            raise KafkaException(KafkaError(KafkaError._UNKNOWN_PARTITION))
        if self.fail_seeks > 0:
            self.fail_seeks -= 1
            raise KafkaException(KafkaError(KafkaError._STATE, "erroneous state (fake seek)"))
        self.seeks.append((tp, partition.offset))
        with self.broker.lock:
            self._position[tp] = partition.offset

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.pause_calls += 1
        for p in partitions:
            self.paused.add((p.topic, p.partition))

    def resume(self, partitions: list[TopicPartition]) -> None:
        for p in partitions:
            self.paused.discard((p.topic, p.partition))

    def commit(self, offsets: list[TopicPartition], asynchronous: bool = True) -> Any:
        with self.broker.lock:
            self.broker.commit_calls += 1
            for p in offsets:
                self.broker.committed[(self.group, p.topic, p.partition)] = p.offset
        return [TopicPartition(p.topic, p.partition, p.offset) for p in offsets]

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> _ClusterMeta:
        return self.broker.metadata(topic)

    def close(self) -> None:
        if not self.closed and self._assignment:
            self.revoke_all()  # as librdkafka does: the group is left through a revocation
        self.closed = True


class FakeProducer:
    """Appends to the broker at once; delivery callbacks are served by poll()/flush()."""

    def __init__(self, broker: FakeBroker, conf: dict[str, Any]) -> None:
        self.broker = broker
        self.conf = conf
        self._reports: list[tuple[Any, KafkaError | None, FakeMessage | None]] = []
        self.fail_next: dict[str, KafkaError] = {}  # topic -> error for its next produce

    def produce(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        on_delivery: Any = None,
        headers: Any = None,
    ) -> None:
        err = self.fail_next.pop(topic, None)
        if err is None and topic not in self.broker.topics:
            err = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
        msg = None
        if err is None:
            offset = self.broker.append(topic, key, value)
            msg = FakeMessage(topic, 0, offset, key, value, 0)
        self._reports.append((on_delivery, err, msg))

    def poll(self, timeout: float = 0) -> int:
        reports, self._reports = self._reports, []
        for cb, err, msg in reports:
            if cb is not None:
                cb(err, msg)
        return len(reports)

    def flush(self, timeout: float = -1) -> int:
        while self._reports:
            self.poll(0)
        return 0

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> _ClusterMeta:
        return self.broker.metadata(topic)


# -- helpers for the tests against the real broker ---------------------------------------------


def create_prefixed_topics(
    bootstrap: str, prefix: str, languages: Sequence[str], partitions: int = 2
) -> None:
    """The catalog's topics for `languages`, each name prefixed (one test's private set)."""
    import dataclasses

    from topics.admin import ensure_topics
    from topics.catalog import catalog

    specs = [
        dataclasses.replace(s, name=prefix + s.name, partitions=partitions)
        for s in catalog(languages)
    ]
    ensure_topics(bootstrap, specs, timeout=30)


class TopicReader:
    """Reads every partition of a topic from the beginning on a thread (no group commits);
    `records` holds what `_record` makes of each message: (key, value) here."""

    def __init__(self, bootstrap: str, topic: str, **consumer_conf: Any) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer

        self.topic = topic
        self.records: list[Any] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"reader-{time.monotonic_ns()}",
                "enable.auto.commit": False,
                **consumer_conf,
            }
        )
        md = self._consumer.list_topics(topic=topic, timeout=10)
        parts = md.topics[topic].partitions
        self._consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        self._thread = threading.Thread(target=self._run, name=f"reader-{topic}", daemon=True)
        self._thread.start()

    def _record(self, msg: Any) -> Any:
        return (msg.key(), msg.value() or b"")

    def _run(self) -> None:
        while not self._stop.is_set():
            msg = self._consumer.poll(0.05)
            if msg is None or msg.error():
                continue
            record = self._record(msg)
            with self._lock:
                self.records.append(record)

    def snapshot(self) -> list[Any]:
        with self._lock:
            return list(self.records)

    def values(self) -> list[bytes]:
        return [v for _k, v in self.snapshot()]

    def __len__(self) -> int:
        with self._lock:
            return len(self.records)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._consumer.close()
