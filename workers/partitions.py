"""The worker's view of its partitions: which are assigned, which paused, what to commit.

All of it runs on the worker's poll thread (rebalance callbacks are served from `consume()`),
so nothing here locks. The consumer is passed in on each call: it is created in `Worker.run()`
and the rebalance callbacks hand over their own.

* Pauses: the worker decides *which languages* must not take more records (intake quotas, the
  global cap, draining); `reconcile()` turns that into pause/resume calls on exactly the
  partitions whose state changes (PITFALLS: `pause()` drops the prefetch, so no toggling).
* Commits: an offset is committable once every record below it has its reply or dead letter
  delivered (`OffsetTracker`); `maybe_commit()` commits after `commit_every` completions or
  every `commit_interval_s`, synchronously, and only for partitions still assigned.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from typing import Any

from confluent_kafka import KafkaException, TopicPartition

from workers.metrics import WorkerMetrics
from workers.offsets import OffsetTracker

__all__ = ["PartitionState", "TP"]

log = logging.getLogger(__name__)

TP = tuple[str, int]  # (topic, partition)


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
        self._done_since_commit = 0
        self._last_commit = time.monotonic()

    # -- pauses -------------------------------------------------------------------------------

    def reconcile(self, consumer: Any, paused_langs: Collection[str]) -> None:
        """Pause the assigned partitions of `paused_langs`, resume the others."""
        pause = [tp for tp in self.assigned - self.paused if self.topic_lang[tp[0]] in paused_langs]
        resume = [tp for tp in self.paused if self.topic_lang[tp[0]] not in paused_langs]
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

    # -- rebalance ----------------------------------------------------------------------------

    def assign(
        self, consumer: Any, partitions: list[TopicPartition], paused_langs: Collection[str]
    ) -> list[TP]:
        """Take `partitions` (incremental assignment, done here so that the ones of a paused
        language are paused before the first fetch)."""
        keys = [(p.topic, p.partition) for p in partitions]
        self.tracker.assign(keys)
        consumer.incremental_assign(partitions)
        self.assigned.update(keys)
        pause = [p for p in partitions if self.topic_lang.get(p.topic) in paused_langs]
        if pause:
            consumer.pause(pause)
            self.paused.update((p.topic, p.partition) for p in pause)
        return keys

    def forget(self, keys: set[TP]) -> None:
        # In-flight requests of these partitions still finish and are answered (the reply and
        # the stored result help whoever owns the partition now); their offsets are ignored.
        self.tracker.revoke(keys)
        self.assigned.difference_update(keys)
        self.paused.difference_update(keys)

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
