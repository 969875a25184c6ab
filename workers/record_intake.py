"""The worker's records in: one consume() batch becomes engine requests, replies or dead letters.

`workers.worker.Worker` polls; `RecordIntake.handle_batch()` takes each batch on the poll
thread:

* consumer errors: end of partition is ignored, a fatal error raises `KafkaException` (the
  worker's loop exits), others are logged;
* while the worker drains, no record is taken (not handed, it stays above the commit point, read
  again later);
* quotas: librdkafka has no fairness across topics, and one batch can hold hundreds of a
  flooding language's records. A record that would pass its language's intake high water
  (`workers.fairness.intake.IntakeController`) or the global cap (`max_in_flight`) rewinds its
  partition to itself (`PartitionState.rewind`; a seek that fails holds the partition until a
  retry works), and the rest of the batch of that partition is skipped; the worker pauses the
  language at the end of its iteration;
* decode and route: an undecodable record or one without request id, or one whose reply topic
  is unusable (`ReplyTopicChecker`), is dead-lettered; another arm's record is done without a
  reply (`workers.arm_routing`); an unexpected exception dead-letters the record as "poison";
* dispatch: a request already in the engine (the same record read again) joins its run; one
  answered before is answered with the same bytes (the publisher's pending reply, or the
  results store, looked up for the whole batch at once; a store that fails means translate
  anyway); an invalid one gets REJECTED / EXPIRED (`workers.validation`); the rest go to
  `EngineRuns.submit`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from schemas.codec import SchemaError, decode_request
from workers.arm_routing import ArmRouter
from workers.engine.types import TranslationEngine
from workers.engine_runs import EngineRuns
from workers.fairness.intake import IntakeController
from workers.kafka_config import ReplyTopicChecker, is_fatal
from workers.metrics import WorkerMetrics
from workers.partitions import PartitionState
from workers.records import ConsumedRecord
from workers.reply_publisher import ReplyPublisher
from workers.results_store import ResultStore, ResultStoreError
from workers.settings import Settings
from workers.tracing import traceparent_of
from workers.validation import validate_request

__all__ = ["RecordIntake"]

log = logging.getLogger(__name__)


class RecordIntake:
    """Takes the worker's consumed records: quotas, decoding, arm routing, duplicates, checks,
    then the engine (`EngineRuns`)."""

    def __init__(
        self,
        *,
        settings: Settings,
        engine: TranslationEngine,
        topic_lang: Mapping[str, str],
        intake: IntakeController,
        partitions: PartitionState,
        store: ResultStore,
        publisher: ReplyPublisher,
        runs: EngineRuns,
        metrics: WorkerMetrics,
        arms: ArmRouter | None,
        reply_topics: ReplyTopicChecker,
        clock_ms: Callable[[], int],
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.topic_lang = topic_lang  # request topic -> language
        self.intake = intake
        self.partitions = partitions
        self.tracker = partitions.tracker
        self.store = store
        self.publisher = publisher
        self.runs = runs
        self.metrics = metrics
        self.arms = arms  # None: no arm
        self._reply_topics = reply_topics  # shared with the publisher
        self._now_ms = clock_ms
        self._tracing = publisher.tracing
        self._inflight = runs.inflight  # request id -> in the engine

    def handle_batch(
        self, msgs: Iterable[Any], consumer: Any, producer: Any, draining: bool
    ) -> None:
        """Hand `msgs` (one consume() batch) over: to the engine, answered, rewound past a
        quota, or dead-lettered. `draining`: shutting down, no record is taken."""
        ready: list[ConsumedRecord] = []
        taken: dict[str, int] = {}  # records of this batch per language, not yet submitted
        rewound: set[tuple[str, int]] = set()
        for msg in msgs:
            err = msg.error()
            if err is not None:
                self._on_consume_error(err)
                continue
            if draining:
                continue  # not handed: stays above the commit point, read again later
            tp = (msg.topic(), msg.partition())
            if tp in rewound or tp in self.partitions.held:
                continue  # read again from the rewound offset (once the seek went through)
            lang = self.topic_lang.get(tp[0], "unknown")
            if self._over_quota(lang, taken):
                # One consume() batch can hold hundreds of a flooding language's records:
                # handing them all over would blow its intake quota and the global cap (which
                # pauses every language, the light ones too). Rewind the partition to this
                # record instead; the language is paused at the end of the iteration. A seek
                # that fails holds the partition until a retry works (PartitionState.rewind).
                self.partitions.rewind(consumer, tp, msg.offset())
                rewound.add(tp)
                continue
            taken[lang] = taken.get(lang, 0) + 1
            if not self.tracker.track(tp, msg.offset()):
                continue  # partition revoked meanwhile
            ts_type, ts = msg.timestamp()
            rec = ConsumedRecord(
                tp=tp,
                offset=msg.offset(),
                key=msg.key(),
                value=msg.value() or b"",
                lang=lang,
                broker_ts_ms=ts if ts_type and ts > 0 else self._now_ms(),
                generation=self.partitions.generation(tp),
            )
            rec.taken_ns = time.time_ns()  # the consume-to-submit / -schedule lags
            if self._tracing:
                rec.trace_parent = traceparent_of(msg.headers())
            try:
                if self._decode_and_route(rec, producer):
                    ready.append(rec)
            except Exception as exc:
                self.publisher.dead_letter(rec, "poison", exc)
        if ready:
            self._dispatch(ready)

    def _over_quota(self, lang: str, taken: Mapping[str, int]) -> bool:
        """Would one more record of `lang` exceed its intake high water or the global cap?"""
        high = self.intake.high_water(lang)
        if high is not None and self.intake.depth(lang) + taken.get(lang, 0) >= high:
            return True
        return len(self._inflight) + sum(taken.values()) >= self.settings.max_in_flight

    def _on_consume_error(self, err: KafkaError) -> None:
        if err.code() == KafkaError._PARTITION_EOF:
            return
        if is_fatal(err):
            raise KafkaException(err)
        log.warning("consumer error: %s", err)

    def _decode_and_route(self, rec: ConsumedRecord, producer: Any) -> bool:
        """Decode and check the reply topic; False when the record was dead-lettered."""
        dead_letter = self.publisher.dead_letter
        try:
            rec.request = decode_request(rec.value)
        except SchemaError as exc:
            if self._for_this_arm(rec):  # routed by its key: one arm dead-letters it
                dead_letter(rec, "undecodable", exc)
            return False
        if not self._for_this_arm(rec):
            return False
        if not rec.request_id:
            dead_letter(rec, "invalid", "request_id is empty: no reply can be correlated")
            return False
        topic = str(rec.request.get("reply_topic", ""))
        problem = self._reply_topics.problem(producer, topic)
        if problem is not None:
            dead_letter(rec, "reply_topic_missing", problem)
            return False
        return True

    def _for_this_arm(self, rec: ConsumedRecord) -> bool:
        """False for another arm's record, which is then done without a reply (arm_routing)."""
        if self.arms is None or self.arms.serves(rec):
            return True
        self.partitions.mark_done(rec.tp, rec.offset)
        return False

    def _dispatch(self, records: list[ConsumedRecord]) -> None:
        """Answer from the store what was answered before; check and submit the rest."""
        lookup = [r for r in records if r.request_id not in self._inflight]
        try:
            stored_list = self.store.get_many([r.request_id for r in lookup])
        except ResultStoreError as exc:
            log.warning("result store lookup failed (translating anyway): %s", exc)
            stored_list = [None] * len(lookup)
        stored = {r.request_id: v for r, v in zip(lookup, stored_list, strict=True) if v}
        engine_languages = tuple(getattr(self.engine, "languages", ()) or ())
        for rec in records:
            try:
                rid = rec.request_id
                inflight = self._inflight.get(rid)
                if inflight is not None:
                    self.metrics.duplicates_total.inc()
                    # the same record read again (partition assigned back) replaces its old copy
                    key = (rec.tp, rec.offset)
                    inflight.records = [r for r in inflight.records if (r.tp, r.offset) != key]
                    inflight.records.append(rec)
                    continue
                previous = self.publisher.pending_reply(rid) or stored.get(rid)
                if previous is not None:
                    self.metrics.duplicates_total.inc()
                    self.publisher.produce_reply(rec, previous, store=False)
                    continue
                problem = validate_request(
                    rec.request,
                    topic=rec.tp[0],
                    topic_lang=rec.lang,
                    served=self.settings.languages,
                    engine_languages=engine_languages,
                    max_text_bytes=self.settings.max_text_bytes,
                    now_ms=self._now_ms(),
                )
                if problem is not None:
                    status, reason, error = problem
                    self.publisher.answer_without_engine(rec, status, reason, error)
                    continue
                self.runs.submit(rec)
            except Exception as exc:
                self.publisher.dead_letter(rec, "poison", exc)
