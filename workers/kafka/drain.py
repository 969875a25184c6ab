"""Time to drain: how long the worker group needs to clear each language's backlog.

An autoscaler should look at this, not at GPU utilization (docs/OPERATIONS.md): a busy GPU
says a kernel ran, not whether the backlog grows; the backlog and the speed at which it
shrinks say exactly that.

Per language, over all partitions of its request topic:

    lag            = sum over partitions of (end offset - the group's committed offset)
    served rate    = the group's committed offsets' advance per second, smoothed (EWMA)
    time to drain  = lag / served rate   (seconds; 0 when lag is 0; +Inf when lag > 0 and
                                          nothing is being served)

Both numbers are read from the broker (the AdminClient's committed and end offsets), not from
the worker's own counters: the committed offsets are the whole group's (a worker commits only
offsets whose answers were delivered, workers/kafka/offsets.py), so every worker of the group
exports
the same lag and rate, a dashboard aggregates them with `max by (lang)`, and adding workers
does not double-count anything. A partition the group never committed counts from its earliest
retained offset (the consumers' `auto.offset.reset=earliest`, workers/kafka/config.py).

The rate is smoothed with a half-life (default 30 s) rather than measured per refresh: commits
arrive in bursts (every 0.5 s or 200 records) and a dead letter being retried holds its
partition's commit point, so a raw per-refresh rate jumps between 0 and a multiple of the true
rate. +Inf is the documented sentinel for "backlog and no progress" (Prometheus exports it as
`+Inf`; an autoscaler reading it scales to its maximum, which is the right call).

Split: `partition_lag`, `RateSmoother`, `time_to_drain` and `DrainMonitor.refresh` are pure
(clock and offset reader injected) and unit-tested; `BrokerOffsetsReader` does the broker reads;
`DrainMonitor.start()` runs `refresh` on a daemon thread every `interval_s`; that thread owns the
reader's clients and releases them itself when it stops (`BrokerOffsetsReader.close`), so the
handles are destroyed while the interpreter lives and never under a call of another thread: left
to the end of the process, the admin client's background thread could deliver a result into an
interpreter being torn down (issue 26).

The committed offsets are read with a Consumer's `committed()` (a consumer carrying the group's
id that never subscribes, so it never joins the group), not with the AdminClient's
`list_consumer_group_offsets`: librdkafka (up to 2.16 at least, confluentinc/librdkafka#5040)
handles an OffsetFetch answer of NOT_COORDINATOR / COORDINATOR_NOT_AVAILABLE by asking the
handle's consumer group to look up its coordinator again, and an AdminClient has none: a NULL
read at 0x58 on librdkafka's `rdk:main` thread that kills the whole worker (the issue's
"segfault at 58 ... in librdkafka"). A broker answers so while the group's coordinator moves or
loads (a fresh broker, a restart, a partition leader change), i.e. exactly when lag matters. A
consumer's own group handles the same answer (a retriable KafkaException, retried below).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "BrokerOffsetsReader",
    "DrainEstimate",
    "DrainMonitor",
    "PartitionOffsets",
    "RateSmoother",
    "partition_lag",
    "start_drain_monitor",
    "time_to_drain",
]

log = logging.getLogger(__name__)

DEFAULT_HALF_LIFE_S = 30.0


@dataclass(frozen=True, slots=True)
class PartitionOffsets:
    """One partition's offsets as the broker reports them for one consumer group."""

    topic: str
    partition: int
    committed: int  # the group's committed offset (next to read); < 0: never committed
    low: int  # earliest retained offset
    high: int  # end offset (the offset the next record will get)

    @property
    def position(self) -> int:
        """Where the group stands: its commit, or the earliest retained offset without one."""
        return max(self.committed, self.low) if self.committed >= 0 else self.low


def partition_lag(p: PartitionOffsets) -> int:
    """Records not yet answered by the group (never negative)."""
    return max(0, p.high - p.position)


def time_to_drain(lag: int, rate_per_s: float) -> float:
    """Seconds to clear `lag` at `rate_per_s`: 0 without lag, +Inf with lag and no rate."""
    if lag <= 0:
        return 0.0
    if rate_per_s <= 0:
        return math.inf
    return lag / rate_per_s


class RateSmoother:
    """An exponentially smoothed rate from a monotonically growing total (offsets served).

    `observe(total, now)`: the first call sets the baseline (rate 0); each later call blends the
    rate since the previous call in with weight `1 - 2**(-dt / half_life_s)`, so an observation
    `half_life_s` old counts half as much as a fresh one, whatever the refresh interval. A total
    that goes backwards (an offset reset) restarts the baseline without changing the rate.
    """

    def __init__(self, half_life_s: float = DEFAULT_HALF_LIFE_S) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s!r}")
        self.half_life_s = half_life_s
        self.rate = 0.0  # per second
        self._last: tuple[float, float] | None = None  # (total, time) of the previous call

    def observe(self, total: float, now: float) -> float:
        last = self._last
        self._last = (total, now)
        if last is None or total < last[0]:
            return self.rate
        dt = now - last[1]
        if dt <= 0:
            return self.rate
        instant = (total - last[0]) / dt
        weight = 1.0 - 2.0 ** (-dt / self.half_life_s)
        self.rate += weight * (instant - self.rate)
        return self.rate


@dataclass(frozen=True, slots=True)
class DrainEstimate:
    """One language's figures of one refresh."""

    lag: int  # records
    rate_per_s: float  # smoothed, requests/s served by the whole group
    seconds: float  # time to drain (math.inf: backlog and no progress)


class OffsetsReader(Protocol):
    """lang -> the offsets of every partition of the language's request topic(s)."""

    def __call__(self) -> Mapping[str, Sequence[PartitionOffsets]]: ...


class DrainGauges(Protocol):
    """Where the figures go (workers.metrics.WorkerMetrics.set_drain)."""

    def set_drain(self, lang: str, lag: int, rate_per_s: float, seconds: float) -> None: ...


class DrainMonitor:
    """Refreshes lag, served rate and time to drain per language from an offsets reader."""

    def __init__(
        self,
        read_offsets: OffsetsReader,
        gauges: DrainGauges | None = None,
        *,
        interval_s: float = 5.0,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.read_offsets = read_offsets
        self.gauges = gauges
        self.interval_s = interval_s
        self.half_life_s = half_life_s
        self.clock = clock
        self.estimates: dict[str, DrainEstimate] = {}  # the last refresh's (readers: any thread)
        self._smoothers: dict[str, RateSmoother] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def refresh(self) -> dict[str, DrainEstimate]:
        """Read the offsets once, update the smoothers and the gauges; returns the estimates."""
        offsets = self.read_offsets()
        now = self.clock()
        out: dict[str, DrainEstimate] = {}
        for lang, parts in offsets.items():
            smoother = self._smoothers.setdefault(lang, RateSmoother(self.half_life_s))
            rate = smoother.observe(sum(p.position for p in parts), now)
            lag = sum(partition_lag(p) for p in parts)
            out[lang] = DrainEstimate(lag, rate, time_to_drain(lag, rate))
            if self.gauges is not None:
                self.gauges.set_drain(lang, lag, rate, out[lang].seconds)
        self.estimates = out
        return out

    # -- the background thread ------------------------------------------------------------------

    def start(self) -> DrainMonitor:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="tolk-drain", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop refreshing; the thread releases the reader (its AdminClient) as it ends. A
        refresh still waiting on the broker after `timeout` releases it when it returns."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("time to drain: a refresh still running after %.1f s", timeout)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s if self.estimates else 1.0):
                try:
                    self.refresh()
                    if self._failing:
                        log.info("time to drain: broker offsets readable again")
                    self._failing = False
                except Exception as exc:  # the broker may be down: keep the last values, retry
                    if not self._failing:
                        log.warning("time to drain: reading offsets failed (retrying): %s", exc)
                    self._failing = True
        finally:
            close = getattr(self.read_offsets, "close", None)
            if callable(close):
                close()


class BrokerOffsetsReader:
    """Reads one consumer group's committed offsets and the topics' watermarks from the broker.

    `topics`: lang -> request topic names. Partitions are listed on every read (a topic may
    gain partitions) and the earliest and end offsets come from `list_offsets` (an AdminClient);
    committed offsets from `committed()` of a consumer with the group's id that never subscribes
    (no member joins the group; never the AdminClient's `list_consumer_group_offsets`, which
    crashes the process on a NOT_COORDINATOR answer: see the module notes).
    """

    RETRIES = 3  # of a read that failed with a retriable error

    def __init__(
        self,
        kafka_conf: Mapping[str, Any],
        group: str,
        topics: Mapping[str, Sequence[str]],
        timeout_s: float = 5.0,
    ) -> None:
        from confluent_kafka import Consumer
        from confluent_kafka.admin import AdminClient

        self.group = group
        self.topics = {lang: tuple(names) for lang, names in topics.items()}
        self.timeout_s = timeout_s
        self._admin: Any = AdminClient(dict(kafka_conf))
        self._committed: Any = Consumer(  # reads the group's offsets; never subscribes
            {**kafka_conf, "group.id": group, "enable.auto.commit": False}
        )

    def close(self) -> None:
        """Destroy both clients now (on the calling thread, the one that used them); a read
        after this raises."""
        admin, self._admin = self._admin, None
        consumer, self._committed = self._committed, None
        if consumer is not None:
            consumer.close()  # never joined: nothing to leave, nothing to commit
        del admin  # the last reference: rd_kafka_destroy joins librdkafka's threads here

    def __call__(self) -> dict[str, list[PartitionOffsets]]:
        """One read; a retriable broker error (a group coordinator still loading, a partition
        leader moving) is retried up to `RETRIES` times, 0.2 s apart, before it is raised."""
        from confluent_kafka import KafkaException

        if self._admin is None:
            raise RuntimeError("offsets reader closed")
        for attempt in range(self.RETRIES + 1):
            try:
                return self._read()
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if attempt == self.RETRIES or not getattr(err, "retriable", lambda: False)():
                    raise
                time.sleep(0.2)
        raise AssertionError("unreachable")

    def _read(self) -> dict[str, list[PartitionOffsets]]:
        from confluent_kafka import TopicPartition
        from confluent_kafka.admin import OffsetSpec

        meta = self._admin.list_topics(timeout=self.timeout_s)
        tps = [
            TopicPartition(name, p)
            for names in self.topics.values()
            for name in names
            if name in meta.topics and meta.topics[name].error is None
            for p in sorted(meta.topics[name].partitions)
        ]
        if not tps:
            return {lang: [] for lang in self.topics}
        committed = {  # not list_consumer_group_offsets: see the module notes
            (tp.topic, tp.partition): tp.offset
            for tp in self._committed.committed(tps, timeout=self.timeout_s)
        }
        low = self._watermarks(tps, OffsetSpec.earliest())
        high = self._watermarks(tps, OffsetSpec.latest())
        out: dict[str, list[PartitionOffsets]] = {}
        for lang, names in self.topics.items():
            out[lang] = [
                PartitionOffsets(
                    tp.topic,
                    tp.partition,
                    committed.get((tp.topic, tp.partition), -1),
                    low[(tp.topic, tp.partition)],
                    high[(tp.topic, tp.partition)],
                )
                for tp in tps
                if tp.topic in names
            ]
        return out

    def _watermarks(self, tps: Sequence[Any], spec: Any) -> dict[tuple[str, int], int]:
        futures = self._admin.list_offsets({tp: spec for tp in tps}, request_timeout=self.timeout_s)
        return {
            (tp.topic, tp.partition): fut.result(self.timeout_s).offset
            for tp, fut in futures.items()
        }


def start_drain_monitor(
    settings: Any, topic_lang: Mapping[str, str], gauges: DrainGauges
) -> DrainMonitor | None:
    """The worker's monitor (`workers.settings.Settings`: `drain_refresh_s`, 0 = none; the
    group and the broker's security settings), over `topic_lang` (request topic -> language),
    refreshing on its own thread."""
    if settings.drain_refresh_s <= 0:
        return None
    topics: dict[str, list[str]] = {}
    for topic, lang in topic_lang.items():
        topics.setdefault(lang, []).append(topic)
    try:
        reader = BrokerOffsetsReader(settings.kafka_common(), settings.consumer_group(), topics)
    except Exception as exc:  # a client config the AdminClient refuses: run without the gauges
        log.error("time to drain off: no admin client: %s", exc)
        return None
    return DrainMonitor(reader, gauges, interval_s=settings.drain_refresh_s).start()
