"""The intake step: one consume() batch becomes outcomes (`workers.kafka.record_life`).

`RecordIntake.take()` reads a batch on the poll thread and yields, per record, what to do with
it; the worker's loop acts on each outcome before the next record is decided. The record's
state (offsets, quotas, in-flight requests) is asked of and kept by `RecordLife`, never here:

* `poll()`: the records ready now, else a wait for the first one (never for a full batch);
* consumer errors: end of partition is ignored, a fatal error raises `KafkaException` (the
  worker's loop exits), others are logged;
* while the worker drains, no record is taken (not tracked, it stays above the commit point,
  read again later);
* quotas: librdkafka has no fairness across topics, and one batch can hold hundreds of a
  flooding language's records. A record that would pass its language's intake high water or
  the global cap rewinds its partition to itself (`RecordLife.rewind`; a seek that fails holds
  the partition until a retry works), and the rest of that partition's batch is skipped; the
  worker pauses the language at the end of its iteration;
* decode and route: an undecodable record or one without request id, or one whose reply topic
  is unusable (`ReplyTopicChecker`), is a `DeadLetter`; another arm's record is a `Skip`
  (`workers.kafka.arm_routing`); an unexpected exception dead-letters the record as "poison";
* dispatch: a request already in the engine (the same record read again) joins its run
  (`RecordLife.join`, no outcome); one answered before is a `Resend` of the same bytes (the
  publisher's pending reply, or the results store, looked up for the whole batch at once; a
  store that fails means translate anyway); an invalid one is an `AnswerNow` (`check_request`:
  REJECTED, or EXPIRED by the deadline rule of `workers.engine.deadlines`); the rest `Submit`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from schemas.codec import SchemaError
from schemas.wire import read_request
from workers.engine.deadlines import ms_past_deadline_at_intake
from workers.kafka.arm_routing import ArmRouter
from workers.kafka.config import is_fatal
from workers.kafka.record_life import (
    AnswerNow,
    DeadLetter,
    Outcome,
    RecordLife,
    Resend,
    Skip,
    Submit,
)
from workers.kafka.records import ConsumedRecord
from workers.kafka.reply_publisher import ReplyPublisher
from workers.settings import Settings
from workers.tracing import traceparent_of

__all__ = ["BUSY_POLL_S", "RecordIntake", "check_request"]

# The poll's wait while requests are in the engine: their results become replies only between
# polls, so this bounds the delay a finished request (or a cache hit) waits for its reply.
BUSY_POLL_S = 0.002

log = logging.getLogger(__name__)


class RecordIntake:
    """Takes the worker's consumed records: quotas, decoding, arm routing, duplicates, checks;
    yields what the loop does with each (module notes)."""

    def __init__(
        self,
        settings: Settings,
        life: RecordLife,
        replies: ReplyPublisher,
        *,
        engine_languages: Callable[[], Sequence[str]],
        arms: ArmRouter | None,
        clock_ms: Callable[[], int],
    ) -> None:
        self.settings = settings
        self.life = life
        self.replies = replies  # read only here: its pending replies, the store, topic checks
        self.engine_languages = engine_languages  # the source languages the model knows
        self.arms = arms  # None: no arm
        self._now_ms = clock_ms

    def poll(self, consumer: Any) -> list[Any]:
        """The records ready now, else wait for the first one. `consume(n, timeout)` returns
        only when it has n records or the timeout passed, so one call would hold a lone record
        (a cache hit answered in microseconds) for the whole poll timeout. Instead: take what
        is buffered without waiting; if nothing is, wait for one record (it returns as soon as
        one arrives) and then take what came with it. The wait is `poll_timeout_s` when idle
        and `BUSY_POLL_S` while requests are in the engine, whose results the worker's loop
        turns into replies between polls."""
        most = self.settings.max_poll_records
        msgs = consumer.consume(num_messages=most, timeout=0)
        if msgs:
            return list(msgs)
        wait = self.settings.poll_timeout_s
        if self.life.in_flight():
            wait = min(wait, BUSY_POLL_S)
        first = consumer.consume(num_messages=1, timeout=wait)
        if not first or most <= 1:
            return list(first or [])
        return [*first, *consumer.consume(num_messages=most - 1, timeout=0)]

    def take(
        self, msgs: Iterable[Any], consumer: Any, producer: Any, draining: bool
    ) -> Iterator[Outcome]:
        """The outcomes of `msgs` (one consume() batch), in order; `draining`: shutting down,
        no record is taken."""
        life = self.life
        ready: list[ConsumedRecord] = []
        taken: dict[str, int] = {}  # records of this batch per language, not yet submitted
        rewound: set[tuple[str, int]] = set()
        for msg in msgs:
            err = msg.error()
            if err is not None:
                _on_consume_error(err)
                continue
            if draining:
                continue  # not taken: stays above the commit point, read again later
            tp = (msg.topic(), msg.partition())
            if tp in rewound or life.held(tp):
                continue  # read again from the rewound offset (once the seek went through)
            lang = life.topic_lang.get(tp[0], "unknown")
            if life.over_quota(lang, taken):
                # Handing a flood over would blow its quota and the global cap (which pauses
                # every language, the light ones too): rewind the partition to this record.
                life.rewind(consumer, tp, msg.offset())
                rewound.add(tp)
                continue
            taken[lang] = taken.get(lang, 0) + 1
            generation = life.take(tp, msg.offset())
            if generation is None:
                continue  # partition revoked meanwhile
            ts_type, ts = msg.timestamp()
            rec = ConsumedRecord(
                tp=tp,
                offset=msg.offset(),
                key=msg.key(),
                value=msg.value() or b"",
                lang=lang,
                broker_ts_ms=ts if ts_type and ts > 0 else self._now_ms(),
                generation=generation,
            )
            rec.taken_ns = time.time_ns()  # the consume-to-submit / -schedule lags
            if self.replies.tracing:
                rec.trace_parent = traceparent_of(msg.headers())
            try:
                routed = self._decode_and_route(rec, producer)
            except Exception as exc:
                routed = DeadLetter(rec, "poison", exc)
            if routed is None:
                ready.append(rec)
            else:
                yield routed
        if ready:
            yield from self._dispatch(ready)

    def _decode_and_route(self, rec: ConsumedRecord, producer: Any) -> Outcome | None:
        """Decode and check the reply topic; None when the record goes on to dispatch."""
        try:
            rec.request = read_request(rec.value, self.replies.codec)
        except SchemaError as exc:  # routed by its key: one arm dead-letters it
            return DeadLetter(rec, "undecodable", exc) if self._for_this_arm(rec) else Skip(rec)
        if not self._for_this_arm(rec):
            return Skip(rec)
        if not rec.request_id:
            return DeadLetter(rec, "invalid", "request_id is empty: no reply can be correlated")
        problem = self.replies.reply_topics.problem(producer, rec.reply_topic)
        if problem is not None:
            return DeadLetter(rec, "reply_topic_missing", problem)
        return None

    def _for_this_arm(self, rec: ConsumedRecord) -> bool:
        """False for another arm's record (done without a reply, workers.kafka.arm_routing)."""
        return self.arms is None or self.arms.serves(rec)

    def _dispatch(self, records: list[ConsumedRecord]) -> Iterator[Outcome]:
        """Join what is in the engine, resend what was answered before, check the rest."""
        life = self.life
        stored = self.replies.stored_replies(
            [r.request_id for r in records if life.in_engine(r.request_id) is None]
        )
        engine_languages = tuple(self.engine_languages() or ())
        for rec in records:
            try:
                rid = rec.request_id
                if life.join(rec):
                    self.replies.metrics.duplicates_total.inc()
                    continue
                previous = self.replies.pending_reply(rid) or stored.get(rid)
                if previous is not None:
                    self.replies.metrics.duplicates_total.inc()
                    outcome: Outcome = Resend(rec, previous)
                else:
                    outcome = check_request(
                        rec,
                        served=self.settings.languages,
                        engine_languages=engine_languages,
                        max_text_bytes=self.settings.max_text_bytes,
                        now_ms=self._now_ms(),
                    ) or Submit(rec)
            except Exception as exc:
                outcome = DeadLetter(rec, "poison", exc)
            yield outcome


def _on_consume_error(err: KafkaError) -> None:
    if err.code() == KafkaError._PARTITION_EOF:
        return
    if is_fatal(err):
        raise KafkaException(err)
    log.warning("consumer error: %s", err)


def check_request(
    rec: ConsumedRecord,
    *,
    served: Sequence[str],
    engine_languages: Sequence[str],
    max_text_bytes: int,
    now_ms: int,
) -> AnswerNow | None:
    """None when `rec`'s request may go to the engine of a worker serving the target languages
    `served`; else the reply it gets: REJECTED for what will never work, EXPIRED for what came
    too late, with the metric reason naming the check. Cheapest and most basic checks first."""
    request, topic, topic_lang = rec.request, rec.tp[0], rec.lang
    if request is None:
        raise ValueError(f"record at offset {rec.offset} was not decoded")
    target, source, text = request.target_lang, request.source_lang, request.text

    def no(status: str, reason: str, error: str) -> AnswerNow:
        return AnswerNow(rec, status, reason, error)

    if target not in served:
        return no(
            "REJECTED",
            "unknown_language",
            f"unknown target language {target!r}; this worker serves {', '.join(served)}",
        )
    if target != topic_lang:
        return no(
            "REJECTED",
            "wrong_topic",
            f"target_lang {target!r} does not match topic {topic!r} ({topic_lang!r})",
        )
    if source and engine_languages and source not in engine_languages:
        return no(
            "REJECTED",
            "unknown_language",
            f"unknown source language {source!r}; the model knows {', '.join(engine_languages)}",
        )
    if not text or not text.strip():
        return no("REJECTED", "empty_text", "text is empty")
    size = len(text.encode("utf-8"))
    if size > max_text_bytes:
        return no("REJECTED", "too_large", f"text is {size} bytes; the limit is {max_text_bytes}")
    late_ms = ms_past_deadline_at_intake(request.deadline, now_ms)
    if late_ms is not None:
        return no(
            "EXPIRED",
            "deadline_passed",
            f"deadline passed {late_ms} ms before the worker read the request",
        )
    return None
