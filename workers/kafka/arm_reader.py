"""The control-topic reader each arm worker runs: the arms' share table, followed live.

Split out of workers/kafka/arm_control.py (issue 27: no product file over 400 lines), body
unchanged; the topic, its values and the writer are described there. `ArmControlReader`:

* reads the topic from the beginning with a consumer of no group (`assign()`, never
  `subscribe()`, never a commit): every worker sees the whole table, and a restart rebuilds it;
* `start()` catches up to the end of the topic before it returns (bounded by
  `catch_up_timeout_s`), so the worker routes its first request with the table as it stands,
  not with an empty one (which would make every arm answer everything); it never raises for a
  broker that is slow to answer (the worker subscribes after it: an exception here would end
  the worker before it joined its group), it warns and the poll thread reads on;
* then a daemon thread keeps polling (`poll_timeout_s`, fetches wait at most 100 ms on the
  broker) and swaps in a new immutable `ShareTable` per change, logging each one: a change is
  applied well inside the 5 s the contract allows (measured in tests/workers/test_arms_kafka.py);
* a missing control topic is a warning, not a failure: the table stays empty (every arm serves
  every request, `workers.arms` rule 4) and the reader tries to assign it again every
  `retry_assign_s` until it exists;
* a value that cannot be decoded or whose shares are invalid is logged and ignored: the entry
  keeps its previous shares.
* one thread at a time uses the consumer, and that thread closes it (`stop()`): the reader
  thread once started, the caller before; a `close()` racing a `consume()` frees the handle
  under the call (issue 26).

`table_at(ts_ms)` routes a record by the entries in force at its timestamp (each entry takes
effect at its `updated_at`, a tombstone at its record time), so arms that read one request at
different moments around a change still route it alike (workers/kafka/arm_control.py's notes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from schemas.codec import SchemaError, decode_arm_shares
from workers.arms import ShareTable, describe_shares, validate_shares

__all__ = ["ArmControlReader"]

log = logging.getLogger("workers.kafka.arm_control")  # the name it logged under before the split

_METADATA_TIMEOUT_S = 5.0


class ArmControlReader:
    """Reads the control topic into a `ShareTable` (see the module docstring)."""

    def __init__(
        self,
        kafka_config: Mapping[str, Any],
        topic: str,
        *,
        consumer_factory: Callable[[dict[str, Any]], Any] = Consumer,
        catch_up_timeout_s: float = 10.0,
        poll_timeout_s: float = 0.1,
        retry_assign_s: float = 2.0,
    ) -> None:
        self.topic = topic
        self._conf: dict[str, Any] = {
            **kafka_config,
            "group.id": "tolk.arm-control.unused",  # required by the client; never joined
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": 100,  # a change reaches a worker in about this much
            "logger": logging.getLogger("tolk.kafka.arm-control"),
        }
        self._consumer_factory = consumer_factory
        self.catch_up_timeout_s = catch_up_timeout_s
        self.poll_timeout_s = poll_timeout_s
        self.retry_assign_s = retry_assign_s
        self._table = ShareTable()
        self._consumer: Any = None
        self._assigned = False
        self._partitions: list[int] = []
        self._next_assign = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._close_lock = threading.Lock()  # the consumer is closed once, by one thread
        self.changes = 0  # entries changed since start (the catch-up included)
        # language -> ((effective at, shares or None), ...) in effect order; swapped whole
        self._history: dict[str, tuple[tuple[int, dict[str, float] | None], ...]] = {}
        self._latest_effective = 0  # the latest effective time of any entry
        self._at_cache: dict[tuple[int, ...], ShareTable] = {}
        self.last_change_monotonic: float | None = None
        # language -> (record time of the write that set the current entry, its shares)
        self._written_at: dict[str, tuple[int, dict[str, float] | None]] = {}
        self.caught_up = False  # the last `read_to_end` reached the end it saw

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Read the topic to its end (bounded), then keep following it on a daemon thread."""
        self.read_to_end()
        if self._table:
            for lang in sorted(self._table.entries):
                log.info("arm shares %s: %s", lang, describe_shares(self._table.entries[lang]))
        else:
            log.warning(
                "arm shares: nothing configured in %s: every arm serves every request (mirror)",
                self.topic,
            )
        self._thread = threading.Thread(target=self._run, name="tolk-arm-control", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop following the topic. The consumer is closed by the thread that uses it: the
        reader thread when it leaves its loop, or here when none was started. A reader thread
        still inside a Kafka call after `timeout_s` (a GIL-starved process, a metadata request
        waiting on the broker) keeps its consumer until that call returns: closing it from here
        meanwhile would free the handle under the call (librdkafka: no call may race
        `close()`; issue 26)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning(
                    "arm control reader still in a Kafka call after %.1f s: it closes its "
                    "consumer when the call returns",
                    timeout_s,
                )
            return  # the thread closed (or will close) the consumer
        self._close_consumer()

    def _close_consumer(self) -> None:
        with self._close_lock:
            consumer, self._consumer = self._consumer, None
        if consumer is not None:
            try:
                consumer.close()
            except Exception:
                log.debug("arm control consumer close failed", exc_info=True)

    def table(self) -> ShareTable:
        """The current table (immutable; swapped whole on each change)."""
        return self._table

    def table_at(self, ts_ms: int) -> ShareTable:
        """The table in force at `ts_ms` (see the module docstring); the current one for a
        time after every entry's effective time."""
        history, table = self._history, self._table
        if ts_ms >= self._latest_effective:
            return table
        picks = tuple(
            sum(1 for effective, _ in entries if effective <= ts_ms)
            for _, entries in sorted(history.items())
        )
        cache = self._at_cache
        cached = cache.get(picks)
        if cached is None:
            at = ShareTable()
            for (lang, entries), n in zip(sorted(history.items()), picks, strict=True):
                if n and entries[n - 1][1] is not None:
                    at = at.with_entry(lang, entries[n - 1][1])
            cached = cache[picks] = at
        return cached

    def entries_since(self) -> dict[str, tuple[int, dict[str, float] | None]]:
        """Each language's entry as (when it was written: the record time, ms; its shares, None
        after a tombstone): since when the entry has stood (`tolk guard` checks it at start)."""
        return dict(self._written_at)

    def read_to_end(self) -> bool:
        """Assign the topic and read it to the end seen now (bounded by `catch_up_timeout_s`);
        False when the topic is not available."""
        if self._consumer is None:
            self._consumer = self._consumer_factory(self._conf)
        if not self._assigned:
            self._try_assign()
        if self._assigned:
            self._catch_up()
        return self._assigned

    # -- reading ------------------------------------------------------------------------------

    def _run(self) -> None:
        """The reader thread: it owns the consumer from `start()` on and closes it itself."""
        try:
            while not self._stop.is_set():
                try:
                    if not self._assigned:
                        if time.monotonic() >= self._next_assign:
                            self._try_assign()
                        self._stop.wait(self.poll_timeout_s)
                        continue
                    self.poll_once(self.poll_timeout_s)
                except Exception:
                    log.exception("arm control reader (continuing)")
                    self._stop.wait(0.5)
        finally:
            self._close_consumer()

    def _try_assign(self) -> None:
        self._next_assign = time.monotonic() + self.retry_assign_s
        try:
            meta = self._consumer.list_topics(topic=self.topic, timeout=_METADATA_TIMEOUT_S)
            topic_meta = meta.topics.get(self.topic)
        except Exception as exc:
            log.warning("arm control topic %s: metadata failed: %s", self.topic, exc)
            return
        if topic_meta is None or topic_meta.error is not None or not topic_meta.partitions:
            why = topic_meta.error if topic_meta is not None else "not in metadata"
            log.warning(
                "arm control topic %s not available (%s): no shares, every arm serves every "
                "request; retrying every %.0f s",
                self.topic,
                why,
                self.retry_assign_s,
            )
            return
        parts = sorted(topic_meta.partitions)
        self._consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in parts])
        self._partitions = parts
        self._assigned = True

    def _catch_up(self) -> None:
        """Poll until every partition's position reaches the high watermark seen at start.
        A watermark the broker does not give in time (a loaded broker, a partition whose leader
        this client does not know yet) ends the catch-up with a warning instead of raising:
        raised, it ended `Worker.run` before its consumer subscribed (the worker thread gone,
        never assigned); the poll thread reads the rest."""
        self.caught_up = False
        ends: dict[int, int] = {}
        for p in self._partitions:
            try:
                low, high = self._consumer.get_watermark_offsets(
                    TopicPartition(self.topic, p), timeout=_METADATA_TIMEOUT_S
                )
            except KafkaException as exc:
                log.warning(
                    "arm control topic %s: no watermarks for partition %d (%s); routing with "
                    "what is read, the rest follows",
                    self.topic,
                    p,
                    exc,
                )
                return
            if high > low:
                ends[p] = high
        positions: dict[int, int] = {}
        deadline = time.monotonic() + self.catch_up_timeout_s
        while any(positions.get(p, -1) < end for p, end in ends.items()):
            if time.monotonic() >= deadline:
                log.warning(
                    "arm control topic %s: not read to its end within %.0f s; routing with "
                    "what was read, the rest follows",
                    self.topic,
                    self.catch_up_timeout_s,
                )
                return
            for msg in self._consumer.consume(num_messages=500, timeout=self.poll_timeout_s):
                if msg.error() is None:
                    positions[msg.partition()] = msg.offset() + 1
                self._apply(msg)
        self.caught_up = True

    def poll_once(self, timeout_s: float) -> int:
        """Apply what arrived within `timeout_s`; returns how many entries changed."""
        before = self.changes
        for msg in self._consumer.consume(num_messages=500, timeout=timeout_s):
            self._apply(msg)
        return self.changes - before

    def _apply(self, msg: Any) -> None:
        err = msg.error()
        if err is not None:
            if err.code() != KafkaError._PARTITION_EOF:
                log.warning("arm control topic %s: %s", self.topic, err)
            return
        raw_key = msg.key()
        value = msg.value()
        try:
            if value is None:  # a tombstone: the language's entry goes
                if not raw_key:
                    raise ValueError("tombstone without a key")
                lang, shares, by = raw_key.decode("utf-8"), None, "tombstone"
            else:
                record = decode_arm_shares(value)
                lang = raw_key.decode("utf-8") if raw_key else str(record["language"])
                shares = validate_shares(record["shares"])
                by = str(record.get("updated_by", ""))
        except (SchemaError, ValueError, UnicodeDecodeError) as exc:
            log.warning(
                "arm control %s@%d ignored (entry unchanged): %s", self.topic, msg.offset(), exc
            )
            return
        old = self._table.entries.get(lang)
        if (None if old is None else dict(old)) == shares:
            return
        # when the entry takes effect: its updated_at; a tombstone's record time
        effective = int(msg.timestamp()[1] if value is None else record["updated_at"])
        self._remember(lang, effective, shares)
        self._written_at[lang] = (int(msg.timestamp()[1]), shares)
        self._table = self._table.with_entry(lang, shares)
        self.changes += 1
        self.last_change_monotonic = time.monotonic()
        log.info(
            "arm shares %s: %s -> %s (by %s)",
            lang,
            describe_shares(old),
            describe_shares(shares),
            by,
        )

    def _remember(self, lang: str, effective: int, shares: dict[str, float] | None) -> None:
        """Add an entry to the language's history (copy on write: the poll thread reads it)."""
        entries = sorted((*self._history.get(lang, ()), (effective, shares)), key=lambda e: e[0])
        history = dict(self._history)
        history[lang] = tuple(entries[-64:])  # enough for any request still in flight
        self._history = history
        self._latest_effective = max(self._latest_effective, effective)
        self._at_cache = {}
