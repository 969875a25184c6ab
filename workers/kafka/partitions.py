"""The worker's view of its partitions: which are assigned, which paused, what to commit.

All of it runs on the worker's poll thread (rebalance callbacks are served from `consume()`),
so nothing here locks. The consumer is passed in on each call: it is created in `Worker.run()`
and the rebalance callbacks hand over their own.

* Pauses: the worker decides *which languages* must not take more records (intake quotas, the
  global cap, draining); `reconcile()` turns that into pause/resume calls on exactly the
  partitions whose state changes (librdkafka's `pause()` drops the partition's prefetched
  records, so pausing and resuming on every loop would fetch them again and again).
* Rewinds: records of one consume() batch past a language's quota are given back with
  `seek()` (`rewind()`). A seek that fails must not let the record through (that broke the
  quota) nor skip it (the commit point would pass it later): the partition is *held* (paused
  now, and kept paused whatever the language's quota says), none of its records is taken until
  the seek worked, and `retry_rewinds()` tries it again each iteration. Each failure is logged
  and counted (`tolk_worker_seek_failures_total{lang}`). A new assignment of the partition
  starts from the committed offset anyway, so a revoke clears the pending rewind.
* Commits: an offset is committable once every record below it has its reply or dead letter
  delivered (`OffsetTracker`); `maybe_commit()` commits after `commit_every` completions or
  every `commit_interval_s`, synchronously, and only for partitions still assigned.
* Ownership of an in-flight record when its result comes back (`ownership()`): "owned" (same
  assignment generation), "reassigned" (revoked and assigned back here meanwhile: this worker
  owns it again, so it answers), "committed" (revoked, but the record lies below the offset
  committed before the revoke: nobody reads it again, so it is answered), or "gone" (revoked
  and not committed: the partition's new owner reads and answers it; this result is dropped).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from typing import Any, Literal

from confluent_kafka import KafkaException, TopicPartition

from workers.kafka.offsets import OffsetTracker
from workers.metrics import WorkerMetrics

__all__ = ["Ownership", "PartitionState", "TP"]

log = logging.getLogger(__name__)

TP = tuple[str, int]  # (topic, partition)
Ownership = Literal["owned", "reassigned", "committed", "gone"]


class PartitionState:
    def __init__(
        self,
        topic_lang: Mapping[str, str],
        metrics: WorkerMetrics,
        commit_every: int,
        commit_interval_s: float,
    ) -> None:
        self.topic_lang = topic_lang  # request topic -> its language
        self.metrics = metrics
        self.commit_every = commit_every
        self.commit_interval_s = commit_interval_s
        self.tracker = OffsetTracker()
        self.assigned: set[TP] = set()
        self.paused: set[TP] = set()
        self.held: dict[TP, int] = {}  # partitions paused until a failed rewind works: offset
        self._done_since_commit = 0
        self._last_commit = time.monotonic()

    # -- pauses -------------------------------------------------------------------------------

    def reconcile(self, consumer: Any, paused_langs: Collection[str]) -> None:
        """Pause the assigned partitions of `paused_langs` and the held ones, resume the others."""
        pause = [
            tp
            for tp in self.assigned - self.paused
            if self.topic_lang[tp[0]] in paused_langs or tp in self.held
        ]
        resume = [
            tp
            for tp in self.paused
            if self.topic_lang[tp[0]] not in paused_langs and tp not in self.held
        ]
        if pause:
            try:
                consumer.pause([TopicPartition(t, p) for t, p in pause])
                self.paused.update(pause)
            except KafkaException as exc:
                log.warning("pause failed: %s", exc)
        if resume:
            try:
                consumer.resume([TopicPartition(t, p) for t, p in resume])
                self.paused.difference_update(resume)
            except KafkaException as exc:
                log.warning("resume failed: %s", exc)

    def paused_languages(self) -> set[str]:
        """Languages with at least one assigned partition paused now."""
        return {self.topic_lang[t] for t, _ in self.paused}

    # -- rewinds ------------------------------------------------------------------------------

    def rewind(self, consumer: Any, tp: TP, offset: int) -> bool:
        """Fetch `tp` from `offset` again. False when the seek failed: then the partition is
        held (paused, its records not taken) until `retry_rewinds()` gets the seek through."""
        if self._seek(consumer, tp, offset):
            return True
        self.held[tp] = offset
        try:
            consumer.pause([TopicPartition(*tp)])
            self.paused.add(tp)
        except KafkaException as exc:  # reconcile() pauses it later; its records stay skipped
            log.warning("pause of held %s[%d] failed: %s", tp[0], tp[1], exc)
        return False

    def retry_rewinds(self, consumer: Any) -> None:
        """Try the failed rewinds again; a partition whose seek worked is no longer held (the
        next `reconcile()` resumes it unless its language is paused)."""
        for tp, offset in list(self.held.items()):
            if self._seek(consumer, tp, offset):
                del self.held[tp]
                log.info("rewind of %s[%d] to %d done after a failure", tp[0], tp[1], offset)

    def _seek(self, consumer: Any, tp: TP, offset: int) -> bool:
        try:
            consumer.seek(TopicPartition(tp[0], tp[1], offset))
            return True
        except KafkaException as exc:
            lang = self.topic_lang.get(tp[0], "unknown")
            self.metrics.seek_failures_total.labels(lang=lang).inc()
            log.warning("rewind of %s[%d] to %d failed (held, retried): %s", *tp, offset, exc)
            return False

    # -- ownership ----------------------------------------------------------------------------

    def generation(self, tp: TP) -> int:
        """The current assignment generation of `tp` (0: not assigned)."""
        return self.tracker.generation(tp) or 0

    def ownership(self, tp: TP, generation: int, offset: int) -> Ownership:
        """Who answers a record of `tp` taken under `generation` (see the module notes)."""
        current = self.tracker.generation(tp)
        if current is not None:
            return "owned" if current == generation else "reassigned"
        committed = self.tracker.committed_when_revoked(tp)
        return "committed" if committed is not None and offset < committed else "gone"

    # -- rebalance ----------------------------------------------------------------------------

    def assign(
        self, consumer: Any, partitions: list[TopicPartition], paused_langs: Collection[str]
    ) -> list[TP]:
        """Take `partitions` (incremental assignment, done here so that the ones of a paused
        language are paused before the first fetch)."""
        keys = [(p.topic, p.partition) for p in partitions]
        self.tracker.assign(keys)
        for tp in keys:  # a new assignment starts from the committed offset: nothing to rewind
            self.held.pop(tp, None)
        consumer.incremental_assign(partitions)
        self.assigned.update(keys)
        pause = [p for p in partitions if self.topic_lang.get(p.topic) in paused_langs]
        if pause:
            consumer.pause(pause)
            self.paused.update((p.topic, p.partition) for p in pause)
        return keys

    def forget(self, keys: set[TP]) -> None:
        # In-flight requests of these partitions still finish; when their results come back,
        # `ownership()` says whether they are answered or dropped (the new owner answers).
        self.tracker.revoke(keys)
        self.assigned.difference_update(keys)
        self.paused.difference_update(keys)
        for tp in keys:
            self.held.pop(tp, None)

    # -- commits ------------------------------------------------------------------------------

    def mark_done(self, tp: TP, offset: int) -> None:
        """The record's answer is delivered (or failed for good): its offset may be committed."""
        if self.tracker.done(tp, offset):
            self._done_since_commit += 1

    def maybe_commit(self, consumer: Any) -> None:
        now = time.monotonic()
        if (
            self._done_since_commit >= self.commit_every
            or now - self._last_commit >= self.commit_interval_s
        ):
            self.commit(consumer)

    def commit(self, consumer: Any, only: set[TP] | None = None) -> None:
        self._last_commit = time.monotonic()
        offsets = {
            tp: o
            for tp, o in self.tracker.committable().items()
            if tp in self.assigned and (only is None or tp in only)
        }
        if only is None:
            self._done_since_commit = 0
        if not offsets:
            return
        try:
            result = consumer.commit(
                offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                asynchronous=False,
            )
        except KafkaException as exc:
            self.metrics.commits_total.labels(outcome="failed").inc()
            log.warning("commit of %s failed: %s", offsets, exc)
            return
        ok: dict[TP, int] = {}
        for tp in result or []:
            if tp.error is None:
                ok[(tp.topic, tp.partition)] = tp.offset
            else:
                log.warning("commit of %s[%d] failed: %s", tp.topic, tp.partition, tp.error)
        self.tracker.mark_committed(ok)
        self.metrics.commits_total.labels(outcome="ok" if ok else "failed").inc()
