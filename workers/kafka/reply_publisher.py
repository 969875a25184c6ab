"""The worker's reply path: every answer a consumed record gets, and when its offset is done.

`ReplyPublisher` owns what happens after the worker has decided how to answer a record:

* build the reply (`workers.kafka.replies`: from the engine's result, or a plain REJECTED /
EXPIRED /
  ERROR reply without the engine) and count it in the worker's metrics (per-answer counters
  and histograms, and the tokens generated over the last `TOKEN_RATE_WINDOW_S`, a gauge the
  worker refreshes with `update_token_rate()`);
* produce it with the worker's idempotent producer to the request's reply topic, keyed by the
  request id;
* in the reply's delivery callback, and only there: store it in the results store under the
  request id (so a redelivery after a crash is answered from the store, not translated again)
  and mark the record's offset done (`mark_done`: `RecordLife.done`, the owner of the record's
  offset);
* a dead letter carries the original record byte for byte and its reason; its offset is done
  once it is delivered, never before;
* a request that failed for good in the engine (a poison request) gets both, in this order: a
  dead letter (the record, for the operator) and then an ERROR reply with the same reason (for
  the client, who would otherwise wait out its timeout): `dead_letter_and_reply_error()`;
* tell the intake step what was answered before (`pending_reply`, `stored_replies`) and
  whether a reply topic is usable (`reply_topics`).

At-least-once, answered once: an offset is never marked done before its answer (the reply or
the dead letter) is delivered, so the commit (the lowest offset not done, `workers.kafka.offsets`)
never passes an unanswered record. Between the first produce and the final delivery the reply
bytes are held in `pending_reply()`, so a duplicate of the request read meanwhile (also while
the reply waits for a retry) is answered with the same bytes.

Failures (`workers.kafka.reply_retry.Deliveries`): librdkafka retries a produce for
`Settings.delivery_timeout_ms`; a reply that still fails is produced again later (0.5 s
doubling up to 30 s) unless it failed for good or `reply_attempts` times, then it becomes a
dead letter; a dead letter is retried with no bound (its offset stays pending meanwhile; what
an operator sees then is said there). The worker serves the retries with
`retry_due(time.monotonic())` once per loop iteration.

Threads: everything runs on the worker's poll thread; delivery callbacks are served from
`producer.poll()` / `flush()` there. The producer is created by the worker when it starts and
handed over with `attach()`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from schemas.codec import SchemaError
from schemas.registry import value_subject
from schemas.wire import WireResult, write_result
from workers.engine.types import FinishReason, GenerationResult
from workers.kafka.config import ReplyTopicChecker
from workers.kafka.records import ConsumedRecord, InFlight, request_trace
from workers.kafka.replies import broker_to_now_ms, dead_letter_value, engine_reply, plain_reply
from workers.kafka.reply_config import DEFAULT_REPLY_ATTEMPTS, ReplyConfig
from workers.kafka.reply_retry import Deliveries, Outgoing
from workers.metrics import WorkerMetrics
from workers.store.results import ResultStore, ResultStoreError
from workers.store.unstored import UnstoredResults
from workers.tracing import RequestTracer

__all__ = ["DEFAULT_REPLY_ATTEMPTS", "ReplyConfig", "ReplyPublisher"]  # the first two: reply_config

log = logging.getLogger(__name__)

TOKEN_RATE_WINDOW_S = 5.0  # the tokens-per-second gauge averages over this window


class ReplyPublisher:
    """Produces replies and dead letters, retries failed ones, stores delivered replies, marks
    offsets done."""

    def __init__(
        self,
        config: ReplyConfig,
        *,
        store: ResultStore,
        metrics: WorkerMetrics,
        reply_topics: ReplyTopicChecker,
        mark_done: Callable[[tuple[str, int], int], Any],
        clock_ms: Callable[[], int],
        monotonic: Callable[[], float] = time.monotonic,
        tracer: RequestTracer | None = None,
    ) -> None:
        if config.reply_attempts < 1:
            raise ValueError(f"reply_attempts must be >= 1, got {config.reply_attempts!r}")
        self.store = store
        self.metrics = metrics
        self.dead_letter_topic = config.dead_letter_topic
        self.worker_id = config.worker_id
        self.reply_attempts = config.reply_attempts
        self.reply_topics = reply_topics  # also the intake's reply-topic check
        self._policies = config.policies  # the SLO of OK replies
        self._mark_done = mark_done
        self._now_ms = clock_ms
        self._plain_model_version = config.plain_model_version
        self.codec = config.codec  # also the intake's decoder
        self._tracer = tracer  # records each reply's spans (workers/tracing.py); None = off
        self._answered: dict[str, bytes] = {}  # not yet delivered (or retrying): rid -> bytes
        self._tokens_window: deque[tuple[float, int]] = deque()  # (monotonic s, tokens out)
        self._deliveries = Deliveries(  # produce and retry (workers/kafka/reply_retry.py)
            self,
            metrics,
            reply_attempts=self.reply_attempts,
            clock_ms=clock_ms,
            monotonic=monotonic,
        )
        self._send = self._deliveries.send
        self._monotonic = monotonic
        late = metrics.store_late_writes_total
        self.unstored = UnstoredResults(  # failed result writes, tried again (unstored.py)
            store.put,
            on_stored=lambda n: late.labels(outcome="stored").inc(n),
            on_dropped=lambda n: late.labels(outcome="dropped").inc(n),
            on_size=metrics.store_unstored.set,
        )

    def attach(self, producer: Any) -> None:
        """Use `producer` (a confluent-kafka `Producer`, idempotent) from now on."""
        self._deliveries.attach(producer)

    @property
    def tracing(self) -> bool:
        """Whether replies carry and record request spans (workers/tracing.py)."""
        return self._tracer is not None

    def pending_reply(self, request_id: str) -> bytes | None:
        """The reply produced for `request_id` whose delivery is still pending (in the producer
        or on the retry queue), or whose result-store write is (`unstored`), if any."""
        return self._answered.get(request_id) or self.unstored.get(request_id)

    def stored_replies(self, request_ids: Sequence[str]) -> dict[str, bytes]:
        """The replies the results store holds for `request_ids` (one look-up for all); empty
        when the store fails (then they are translated again: at-least-once)."""
        try:
            stored = self.store.get_many(list(request_ids))
        except ResultStoreError as exc:
            log.warning("result store lookup failed (translating anyway): %s", exc)
            return {}
        return {rid: v for rid, v in zip(request_ids, stored, strict=True) if v}

    def pending_retries(self) -> int:
        """Replies and dead letters that failed at least once and are not delivered yet."""
        return len(self._deliveries.queue)

    def next_retry_at(self) -> float | None:
        """When (on the monotonic clock) the earliest queued retry is due; None if none is."""
        return self._deliveries.queue.next_due()

    def update_token_rate(self, now_monotonic: float) -> None:
        """Set the tokens-per-second gauge from the engine results of the last window."""
        window = self._tokens_window
        while window and now_monotonic - window[0][0] > TOKEN_RATE_WINDOW_S:
            window.popleft()
        tokens = sum(n for _, n in window)
        self.metrics.tokens_per_second.set(tokens / TOKEN_RATE_WINDOW_S)

    # -- answers ------------------------------------------------------------------------------

    def answer_from_engine(
        self,
        inflight: InFlight,
        result: GenerationResult,
        *,
        model_version: str,
        finished_at: float | None = None,
    ) -> None:
        """Reply to every record waiting on `inflight` with the engine's result (the first
        record's reply is the one stored). `finished_at`: monotonic time the engine finished
        it (the finish-to-produce and finish-to-delivered lags)."""
        lang = inflight.lang
        reply = engine_reply(
            inflight,
            result,
            worker_id=self.worker_id,
            model_version=model_version,
            now_ms=self._now_ms(),
        )
        status, timings, m = reply.status, reply.timings, self.metrics
        withheld = result.finish_reason is FinishReason.WITHHELD  # quality, not a service error
        m.requests_total.labels(lang=lang, status="WITHHELD" if withheld else status).inc()
        if status != "OK" and not withheld:
            m.errors_total.labels(lang=lang, reason=f"engine_{result.finish_reason.value}").inc()
        m.tokens_generated_total.labels(lang=lang).inc(result.tokens_out)
        self._tokens_window.append((time.monotonic(), result.tokens_out))
        m.queue_seconds.labels(lang=lang).observe(max(0.0, timings.queue_ms) / 1e3)
        m.e2e_latency_seconds.labels(lang=lang).observe(timings.total_ms / 1e3)
        if status == "OK":
            policy = self._policies.get(lang)
            slo_s = policy.slo_p99_s if policy is not None else None
            m.observe_slo(lang, timings.total_ms / 1e3, slo_s)
        first = inflight.records[0]
        if first.taken_ns and inflight.submitted_ns and _scheduled(result):
            lag_s = (inflight.submitted_ns - first.taken_ns) / 1e9 + result.timings.queue_s
            m.observe_lag("consume_to_schedule", lang, lag_s)
        value = self.wire_value(first, reply)
        for i, rec in enumerate(inflight.records):
            self.produce_reply(
                rec,
                value,
                store=(i == 0),
                engine=(inflight, result),
                status=status,
                finished_at=finished_at if i == 0 else None,
            )
        if finished_at is not None:
            m.observe_lag("finish_to_produce", lang, time.monotonic() - finished_at)

    def answer_without_engine(
        self, rec: ConsumedRecord, status: str, reason: str, error: str
    ) -> None:
        """Reply REJECTED / EXPIRED / ERROR to a request the engine did not translate;
        `reason` is the metric label."""
        now_ms = self._now_ms()
        reply = plain_reply(
            rec,
            worker_id=self.worker_id,
            status=status,
            error=error,
            now_ms=now_ms,
            model_version=self._plain_model_version,
        )
        self.metrics.requests_total.labels(lang=rec.lang, status=status).inc()
        self.metrics.errors_total.labels(lang=rec.lang, reason=reason).inc()
        self.metrics.e2e_latency_seconds.labels(lang=rec.lang).observe(
            broker_to_now_ms(rec, now_ms) / 1e3
        )
        self.produce_reply(rec, self.wire_value(rec, reply), store=True, status=status)

    def produce_reply(
        self,
        rec: ConsumedRecord,
        value: bytes,
        *,
        store: bool,
        engine: tuple[InFlight, GenerationResult] | None = None,
        status: str = "",
        finished_at: float | None = None,
    ) -> None:
        """Produce `value` to the request's reply topic. On delivery: store it (when `store`;
        a reply answered from the store is not stored again) and mark the record done; on
        failure: retried, or a dead letter instead (see the module docstring). With tracing
        on, the reply carries its request span, recorded on delivery (`engine`: the run that
        made it, for the queue / prefill / decode spans)."""
        rid = rec.request_id
        topic = rec.reply_topic
        if store:
            self._answered[rid] = value
        entry = Outgoing("reply", rec, topic, rid.encode("utf-8"), value, store=store)
        entry.finished_at = finished_at
        if self._tracer is not None:
            req = request_trace(rec, engine, status)
            span, entry.headers = self._tracer.reply_headers(req)
            entry.trace = (span, req)
        self._send(entry)

    def wire_value(self, rec: ConsumedRecord, reply: WireResult) -> bytes:
        """The reply's bytes in the format of `rec`'s request: a request in the Confluent wire
        format (a registry serializer wrote it) is answered in it, with the id the registry
        holds under the reply topic's subject; any other in single-object encoding. A registry
        that cannot give the id (down, subject missing) gets the reply out anyway, in
        single-object encoding, with a warning and `tolk_worker_errors_total{reason="registry"}`:
        the answer is never held back by the registry."""
        if rec.registry_format:
            try:
                return write_result(reply, self.codec, subject=value_subject(rec.reply_topic))
            except SchemaError as exc:
                log.warning("reply %s in single-object encoding: %s", rec.request_id, exc)
                self.metrics.errors_total.labels(lang=rec.lang, reason="registry").inc()
        return write_result(reply, self.codec)

    def _store(self, rec: ConsumedRecord, value: bytes) -> None:
        try:
            self.store.put(rec.request_id, value)
        except ResultStoreError as exc:  # the reply is out; kept and written again later
            log.warning("result of %s not stored yet (kept for a retry): %s", rec.request_id, exc)
            self.metrics.errors_total.labels(lang=rec.lang, reason="store_failed").inc()
            self.unstored.add(rec.request_id, value, self._monotonic())

    # -- dead letters -------------------------------------------------------------------------

    def dead_letter_and_reply_error(self, rec: ConsumedRecord, reason: str, error: str) -> None:
        """A request that failed for good (a poison request): dead-letter the record with
        `reason`, then answer the client ERROR with the same text, so the operator has the
        record and the client an answer. The offset is done once both are delivered."""
        now_ms = self._now_ms()
        reply = plain_reply(
            rec,
            worker_id=self.worker_id,
            status="ERROR",
            error=f"{reason}: {error}",
            now_ms=now_ms,
            model_version=self._plain_model_version,
        )
        self.metrics.requests_total.labels(lang=rec.lang, status="ERROR").inc()
        self.metrics.errors_total.labels(lang=rec.lang, reason=reason).inc()
        rid = rec.request_id
        value = self.wire_value(rec, reply)
        self._answered[rid] = value
        topic = rec.reply_topic
        reply_entry = Outgoing("reply", rec, topic, rid.encode("utf-8"), value, store=True)
        self.dead_letter(rec, reason, error, then=reply_entry)

    def dead_letter(
        self,
        rec: ConsumedRecord,
        reason: str,
        exc: BaseException | str,
        *,
        then: Outgoing | None = None,
    ) -> None:
        """Write the record byte for byte to the dead-letter topic with `reason` and the
        exception's text; its offset is done once that is delivered (retried until it is)."""
        detail = exc if isinstance(exc, str) else repr(exc)
        self.metrics.dead_letters_total.labels(reason=reason).inc()
        log.warning(
            "dead letter %s[%d]@%d (%s): %s", rec.tp[0], rec.tp[1], rec.offset, reason, detail
        )
        try:
            value = dead_letter_value(rec, reason, detail, self._now_ms())
        except Exception:  # a bug (a record that cannot be encoded): no retry would help
            log.exception("dead letter for %s@%d cannot be encoded", rec.tp, rec.offset)
            self.metrics.errors_total.labels(lang=rec.lang, reason="dead_letter_failed").inc()
            if then is not None:
                self._send(then)
            else:
                self._mark_done(rec.tp, rec.offset)
            return
        self._send(
            Outgoing(
                "dead_letter",
                rec,
                self.dead_letter_topic,
                rec.key,
                value,
                reason=reason,
                detail=detail,
                then=then,
            )
        )

    # -- retries ------------------------------------------------------------------------------

    def retry_due(self, now_monotonic: float) -> int:
        """Produce again every queued reply and dead letter due at `now_monotonic` (the
        worker's loop calls this each iteration; it also writes the results kept unstored,
        `self.unstored`); returns how many replies / dead letters were produced."""
        self.unstored.retry_due(now_monotonic)  # result writes that failed (unstored.py)
        return self._deliveries.retry_due(now_monotonic)

    # -- delivery outcomes (reply_retry.DeliveryOutcomes) -------------------------------------

    def delivered(self, entry: Outgoing) -> None:
        """`entry` is delivered: store a reply, send what follows it, else the offset is done."""
        if entry.finished_at is not None:
            lag_s = time.monotonic() - entry.finished_at
            self.metrics.observe_lag("finish_to_delivered", entry.rec.lang, lag_s)
        self._end_trace(entry, "")
        rec = entry.rec
        if entry.kind == "reply" and entry.store:
            self._answered.pop(rec.request_id, None)
            self._store(rec, entry.value)
        if entry.then is not None:  # the next answer of this record; the offset waits for it
            follow, entry.then = entry.then, None
            self._send(follow)
            return
        self._mark_done(rec.tp, rec.offset)

    def _end_trace(self, entry: Outgoing, failure: str) -> None:
        if self._tracer is not None and entry.trace is not None:
            (span, req), entry.trace = entry.trace, None
            if failure:
                req.status = failure
            self._tracer.finish(span, req, time.time_ns())

    def reply_topic_missing(self, topic: str) -> None:
        self.reply_topics.forget(topic)

    def reply_given_up(self, entry: Outgoing, reason: str, why: str) -> None:
        """A reply that cannot be delivered: a dead letter instead."""
        self._end_trace(entry, reason)
        if entry.store:
            self._answered.pop(entry.rec.request_id, None)
        self.dead_letter(entry.rec, reason, why)


def _scheduled(result: GenerationResult) -> bool:
    """Whether the engine's scheduler ran the request: its `queue_s` is then the wait until it
    was first scheduled (a request refused or expired before prefill produced no token)."""
    return result.ok or result.tokens_out > 0
