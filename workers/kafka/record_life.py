"""One owner of a consumed record's life, and the outcomes the worker's steps return.

A record read from a request topic lives from `consume()` until its offset is committed. Its
whole state is held by one object, `RecordLife`, on the worker's poll thread:

* **offsets** (`workers.kafka.partitions.PartitionState` over
`workers.kafka.offsets.OffsetTracker`): the
  record is tracked when taken, done only when its answer (reply or dead letter) is delivered,
  and the commit point never passes a record not done; assignment, revoke, rewinds, pauses and
  commits of its partition;
* **quotas** (`workers.fairness.intake.IntakeController`, and the global cap
  `Settings.max_in_flight`): whether one more record of a language may be taken, and which
  languages' partitions are paused (hysteresis; all of them while draining);
* **the in-flight request**: the request id -> `InFlight` map of what is in the engine, which
  redeliveries of the same request join, and whether a record whose partition was revoked
  meanwhile is still this worker's to answer (`owned_records`).

Nothing else keeps a reference to these: the steps ask the owner. The steps themselves decide,
and return what to do as small values (`Outcome`), which the worker's loop acts on
(`Worker._act`):

    consume -> RecordIntake.take()      -> Submit | AnswerNow | Resend | DeadLetter | Skip
    Submit  -> EngineRuns.submit()      -> nothing (in the engine) | AnswerNow (refused)
    results -> EngineRuns.drain_done()  -> Answer | DeadLetter(reply_error=True) | AnswerNow
    each    -> ReplyPublisher (produce; on delivery: store, then RecordLife.done(tp, offset))

Steps are generators, and the loop acts on each outcome before the next one is decided, so a
record later in a batch sees what an earlier one did (a duplicate joins the request its twin
just submitted). What a step knows (the record's data: `ConsumedRecord`, `InFlight`) is in
`workers.kafka.records`.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import TopicPartition

from workers.engine.types import GenerationResult, RequestHandle
from workers.fairness.intake import IntakeController
from workers.kafka.partitions import TP, PartitionState
from workers.kafka.records import ConsumedRecord, InFlight
from workers.metrics import WorkerMetrics
from workers.settings import Settings

__all__ = [
    "Answer",
    "AnswerNow",
    "DeadLetter",
    "Outcome",
    "RecordLife",
    "Resend",
    "Skip",
    "Submit",
]

log = logging.getLogger(__name__)


# -- outcomes: what a step decided for a record, acted on by the worker's loop ----------------


@dataclass(frozen=True, slots=True)
class Submit:
    """Checked: hand the request to the engine (`EngineRuns.submit`)."""

    rec: ConsumedRecord


@dataclass(frozen=True, slots=True)
class AnswerNow:
    """Answer without the engine: REJECTED / EXPIRED / ERROR with `error`; `reason` is the
    metric label (`ReplyPublisher.answer_without_engine`)."""

    rec: ConsumedRecord
    status: str
    reason: str
    error: str


@dataclass(frozen=True, slots=True)
class Resend:
    """Answered before (a reply pending delivery or stored): the same bytes again, not stored
    again."""

    rec: ConsumedRecord
    value: bytes


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """The record to the dead-letter topic with `reason`; with `reply_error` (a request whose
    last engine run failed too) then an ERROR reply with the same text."""

    rec: ConsumedRecord
    reason: str
    detail: BaseException | str
    reply_error: bool = False


@dataclass(frozen=True, slots=True)
class Skip:
    """Not this worker's to answer (another arm's record): done without a reply."""

    rec: ConsumedRecord


@dataclass(frozen=True, slots=True)
class Answer:
    """The engine's result for every record waiting on `inflight` (already out of the books)."""

    inflight: InFlight
    result: GenerationResult
    model_version: str
    finished_at: float | None = None  # monotonic time the engine finished it


Outcome = Submit | AnswerNow | Resend | DeadLetter | Skip | Answer


# -- the owner ----------------------------------------------------------------------------------


class RecordLife:
    """Offsets, quotas and in-flight requests of every record this worker took (module notes)."""

    def __init__(
        self, settings: Settings, topic_lang: Mapping[str, str], metrics: WorkerMetrics
    ) -> None:
        self.topic_lang = topic_lang  # request topic -> its language
        self._metrics = metrics
        self._max_in_flight = settings.max_in_flight
        self._low_water_ratio = settings.low_water_ratio
        self.partitions = PartitionState(
            topic_lang, metrics, settings.commit_every, settings.commit_interval_s
        )
        self.tracker = self.partitions.tracker  # offsets per partition (tests, health)
        self.intake = IntakeController.from_policies(
            {k: v for k, v in settings.policies.items() if k in settings.languages},
            low_water_ratio=settings.low_water_ratio,
            default_high_water=max(1, settings.max_in_flight),
        )
        self._inflight: dict[str, InFlight] = {}  # request id -> the request in the engine
        self._global_paused = False
        self.draining = False  # shutting down: every partition paused, nothing taken
        self.crashed = False  # left without a commit (Worker.crash): revokes commit nothing
        self.assigned_event = threading.Event()  # set once the first assignment arrived

    # -- taking a record ----------------------------------------------------------------------

    def held(self, tp: TP) -> bool:
        """Whether `tp` waits for a failed rewind to go through (none of its records taken)."""
        return tp in self.partitions.held

    def over_quota(self, lang: str, taken: Mapping[str, int]) -> bool:
        """Would one more record of `lang` (with `taken` records per language of this batch not
        yet submitted) exceed its intake high water or the global cap?"""
        high = self.intake.high_water(lang)
        if high is not None and self.intake.depth(lang) + taken.get(lang, 0) >= high:
            return True
        return len(self._inflight) + sum(taken.values()) >= self._max_in_flight

    def rewind(self, consumer: Any, tp: TP, offset: int) -> None:
        """Give `tp`'s records from `offset` back (read again later; held if the seek fails)."""
        self.partitions.rewind(consumer, tp, offset)

    def take(self, tp: TP, offset: int) -> int | None:
        """Track the record at `offset` (its answer is owed from now on); its partition's
        assignment generation, or None when the partition was revoked meanwhile."""
        if not self.tracker.track(tp, offset):
            return None
        return self.partitions.generation(tp)

    def done(self, tp: TP, offset: int) -> None:
        """The record's answer is delivered (or it needs none): its offset may be committed."""
        self.partitions.mark_done(tp, offset)

    # -- the request in the engine -------------------------------------------------------------

    def in_engine(self, request_id: str) -> InFlight | None:
        return self._inflight.get(request_id)

    def join(self, rec: ConsumedRecord) -> bool:
        """A record of a request already in the engine waits for that run's answer (the same
        record read again replaces its old copy); False when the request is not in the engine."""
        inflight = self._inflight.get(rec.request_id)
        if inflight is None:
            return False
        key = (rec.tp, rec.offset)
        inflight.records = [r for r in inflight.records if (r.tp, r.offset) != key]
        inflight.records.append(rec)
        return True

    def entered_engine(
        self, rec: ConsumedRecord, handle: RequestHandle, now_ms: int, now_ns: int
    ) -> InFlight:
        """`rec`'s request is in the engine: it counts against its language's quota."""
        inflight = InFlight(rec.request_id, rec.lang, handle, [rec], now_ms, submitted_ns=now_ns)
        self._inflight[rec.request_id] = inflight
        self.intake.on_enqueued(rec.lang)
        return inflight

    def left_engine(self, inflight: InFlight) -> None:
        """`inflight` leaves the books (answered, dead-lettered or dropped): its quota slot is
        free. Its records' offsets are done once their answers are delivered (`done`)."""
        if self._inflight.pop(inflight.request_id, None) is not None:
            self.intake.on_done(inflight.lang)

    def owned_records(self, inflight: InFlight, *, final: bool) -> list[ConsumedRecord]:
        """The records of `inflight` this worker still answers; those of a partition revoked
        meanwhile and not committed are dropped (the new owner answers them), the others
        answered; counted in `tolk_revoked_answers_total{outcome}` (answered ones when
        `final`)."""
        kept = []
        for rec in inflight.records:
            owner = self.partitions.ownership(rec.tp, rec.generation, rec.offset)
            if owner == "gone":
                self._metrics.revoked_answers_total.labels(outcome="dropped").inc()
                continue
            if owner != "owned" and final:
                self._metrics.revoked_answers_total.labels(outcome="answered").inc()
            kept.append(rec)
        return kept

    def in_flight(self) -> int:
        """Requests in the engine now."""
        return len(self._inflight)

    def requests(self) -> list[InFlight]:
        """The requests in the engine now (a copy: shutdown cancels them)."""
        return list(self._inflight.values())

    # -- partitions: pauses, rebalances, commits -----------------------------------------------

    def wanted_paused(self) -> set[str]:
        """The languages whose partitions take no records now."""
        langs = set(self.topic_lang.values())
        if self.draining or self._global_paused:
            return langs
        return set(self.intake.paused()) & langs

    def reconcile_pauses(self, consumer: Any) -> None:
        """Pause / resume partitions per the quotas (hysteresis) and the global cap."""
        self.intake.to_pause()
        self.intake.to_resume()
        total = len(self._inflight)
        cap = self._max_in_flight
        if total >= cap:
            self._global_paused = True
        elif self._global_paused and total <= math.floor(cap * self._low_water_ratio):
            self._global_paused = False
        self.partitions.reconcile(consumer, self.wanted_paused())

    def paused_languages(self) -> set[str]:
        """Languages with at least one assigned partition paused now."""
        return self.partitions.paused_languages()

    # The consumer's rebalance callbacks (served from consume() on the poll thread): a
    # partition's records in the engine still finish after a revoke, and are answered or
    # dropped when their results come back (`owned_records`).

    def on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        try:
            keys = self.partitions.assign(consumer, partitions, self.wanted_paused())
            log.info("assigned %s", keys)
            self.assigned_event.set()
        except Exception:
            log.exception("on_assign failed")

    def on_revoke(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        try:
            keys = {(p.topic, p.partition) for p in partitions}
            if not self.crashed:  # close() after a crash revokes too: a crash commits nothing
                self.partitions.commit(consumer, only=keys)
            self.partitions.forget(keys)
            log.info("revoked %s", sorted(keys))
        except Exception:
            log.exception("on_revoke failed")

    def on_lost(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        try:
            keys = {(p.topic, p.partition) for p in partitions}
            self.partitions.forget(keys)  # no commit: they already belong to someone else
            log.warning("lost %s", sorted(keys))
        except Exception:
            log.exception("on_lost failed")

    def retry_rewinds(self, consumer: Any) -> None:
        self.partitions.retry_rewinds(consumer)

    def maybe_commit(self, consumer: Any) -> None:
        self.partitions.maybe_commit(consumer)

    def commit(self, consumer: Any) -> None:
        self.partitions.commit(consumer)

    def stats(self) -> Mapping[str, Any]:
        return {
            "in_flight": len(self._inflight),
            "assigned": sorted(self.partitions.assigned),
            "paused": sorted(self.partitions.paused),
            "pending_offsets": self.tracker.total_pending(),
        }

    def languages_depth(self, languages: Collection[str]) -> dict[str, int]:
        """Requests in the engine per language (the in-flight gauge)."""
        return {lang: self.intake.depth(lang) for lang in languages}
