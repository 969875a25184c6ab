"""The worker's reply path: every answer a consumed record gets, and when its offset is done.

`ReplyPublisher` owns what happens after the worker has decided how to answer a record:

* build the reply (`workers.replies`: from the engine's result, or a plain REJECTED / EXPIRED /
  ERROR reply without the engine) and count it in the worker's metrics (per-answer counters
  and histograms, and the tokens generated over the last `TOKEN_RATE_WINDOW_S`, a gauge the
  worker refreshes with `update_token_rate()`);
* produce it with the worker's idempotent producer to the request's reply topic, keyed by the
  request id (a full local queue is waited out by serving delivery reports, then retried);
* in the reply's delivery callback, and only there: store it in the results store under the
  request id (so a redelivery after a crash is answered from the store, not translated again)
  and mark the record's offset done (`mark_done`, the worker's `PartitionState.mark_done`);
* a reply that cannot be produced or delivered becomes a dead letter instead (a missing reply
  topic also drops that topic from the `ReplyTopicChecker` cache);
* a dead letter carries the original record byte for byte and its reason; its offset is done
  once it is delivered, or once it failed for good (a lost dead letter must not stall the
  partition's commits forever, so it is logged and counted instead).

At-least-once, answered once: an offset is never marked done before its answer is delivered,
so the commit (the lowest offset not done, `workers.offsets`) never passes an unanswered
record. Between produce and delivery the reply bytes are held in `pending_reply()`, so a
duplicate of the request read meanwhile is answered with the same bytes.

Threads: everything runs on the worker's poll thread; delivery callbacks are served from
`producer.poll()` / `flush()` there. The producer is created by the worker when it starts and
handed over with `attach()`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from schemas.codec import encode_result
from workers.engine.types import GenerationResult
from workers.fairness.policy import LanguagePolicy
from workers.kafka_config import MISSING_TOPIC_CODES, ReplyTopicChecker
from workers.metrics import WorkerMetrics
from workers.records import ConsumedRecord, InFlight
from workers.replies import broker_to_now_ms, dead_letter_value, engine_reply, plain_reply
from workers.results_store import ResultStore, ResultStoreError

__all__ = ["ReplyPublisher"]

log = logging.getLogger(__name__)

# Produce attempts while the producer's local queue stays full (each waits up to 0.1 s).
_QUEUE_FULL_ATTEMPTS = 100
TOKEN_RATE_WINDOW_S = 5.0  # the tokens-per-second gauge averages over this window


class ReplyPublisher:
    """Produces replies and dead letters; stores delivered replies; marks offsets done."""

    def __init__(
        self,
        *,
        store: ResultStore,
        metrics: WorkerMetrics,
        reply_topics: ReplyTopicChecker,
        dead_letter_topic: str,
        worker_id: str,
        policies: Mapping[str, LanguagePolicy],
        mark_done: Callable[[tuple[str, int], int], None],
        clock_ms: Callable[[], int],
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.dead_letter_topic = dead_letter_topic
        self.worker_id = worker_id
        self._reply_topics = reply_topics  # shared with the worker's intake check
        self._policies = policies  # the SLO of OK replies
        self._mark_done = mark_done
        self._now_ms = clock_ms
        self._producer: Any = None
        self._answered: dict[str, bytes] = {}  # produced, delivery pending: rid -> reply bytes
        self._tokens_window: deque[tuple[float, int]] = deque()  # (monotonic s, tokens out)

    def attach(self, producer: Any) -> None:
        """Use `producer` (a confluent-kafka `Producer`, idempotent) from now on."""
        self._producer = producer

    def pending_reply(self, request_id: str) -> bytes | None:
        """The reply produced for `request_id` whose delivery is still pending, if any."""
        return self._answered.get(request_id)

    def update_token_rate(self, now_monotonic: float) -> None:
        """Set the tokens-per-second gauge from the engine results of the last window."""
        window = self._tokens_window
        while window and now_monotonic - window[0][0] > TOKEN_RATE_WINDOW_S:
            window.popleft()
        tokens = sum(n for _, n in window)
        self.metrics.tokens_per_second.set(tokens / TOKEN_RATE_WINDOW_S)

    # -- answers ------------------------------------------------------------------------------

    def answer_from_engine(
        self, inflight: InFlight, result: GenerationResult, *, model_version: str
    ) -> None:
        """Reply to every record waiting on `inflight` with the engine's result (the first
        record's reply is the one stored)."""
        lang = inflight.lang
        reply = engine_reply(
            inflight,
            result,
            worker_id=self.worker_id,
            model_version=model_version,
            now_ms=self._now_ms(),
        )
        status = reply["status"]
        timings = reply["timings"]
        m = self.metrics
        m.requests_total.labels(lang=lang, status=status).inc()
        if status != "OK":
            m.errors_total.labels(lang=lang, reason=f"engine_{result.finish_reason.value}").inc()
        m.tokens_generated_total.labels(lang=lang).inc(result.tokens_out)
        self._tokens_window.append((time.monotonic(), result.tokens_out))
        m.queue_seconds.labels(lang=lang).observe(max(0.0, timings["queue_ms"]) / 1e3)
        m.e2e_latency_seconds.labels(lang=lang).observe(timings["total_ms"] / 1e3)
        if status == "OK":
            policy = self._policies.get(lang)
            slo_s = policy.slo_p99_s if policy is not None else None
            m.observe_slo(lang, timings["total_ms"] / 1e3, slo_s)
        value = encode_result(reply)
        for i, rec in enumerate(inflight.records):
            self.produce_reply(rec, value, store=(i == 0))

    def answer_without_engine(
        self, rec: ConsumedRecord, status: str, reason: str, error: str
    ) -> None:
        """Reply REJECTED / EXPIRED / ERROR to a request the engine did not translate;
        `reason` is the metric label."""
        now_ms = self._now_ms()
        reply = plain_reply(
            rec, worker_id=self.worker_id, status=status, error=error, now_ms=now_ms
        )
        self.metrics.requests_total.labels(lang=rec.lang, status=status).inc()
        self.metrics.errors_total.labels(lang=rec.lang, reason=reason).inc()
        self.metrics.e2e_latency_seconds.labels(lang=rec.lang).observe(
            broker_to_now_ms(rec, now_ms) / 1e3
        )
        self.produce_reply(rec, encode_result(reply), store=True)

    def produce_reply(self, rec: ConsumedRecord, value: bytes, *, store: bool) -> None:
        """Produce `value` to the request's reply topic. On delivery: store it (when `store`;
        a reply answered from the store is not stored again) and mark the record done; on
        failure: a dead letter instead."""
        rid = rec.request_id
        topic = str(rec.request.get("reply_topic", ""))
        if store:
            self._answered[rid] = value

        def on_delivery(err: KafkaError | None, _msg: Any) -> None:
            if store:
                self._answered.pop(rid, None)
            if err is None:
                if store:
                    self._store(rec, value)
                self._mark_done(rec.tp, rec.offset)
                return
            if err.code() in MISSING_TOPIC_CODES:
                self._reply_topics.forget(topic)
                self.dead_letter(rec, "reply_topic_missing", f"reply to {topic!r} failed: {err}")
            else:
                self.dead_letter(rec, "reply_undeliverable", f"reply to {topic!r} failed: {err}")

        try:
            self._produce(topic, rid.encode("utf-8"), value, on_delivery)
        except KafkaException as exc:
            if store:
                self._answered.pop(rid, None)
            self.dead_letter(rec, "reply_undeliverable", exc)

    def _store(self, rec: ConsumedRecord, value: bytes) -> None:
        try:
            self.store.put(rec.request_id, value)
        except ResultStoreError as exc:  # the reply is out; only a redelivery pays for it
            log.warning("result of %s not stored: %s", rec.request_id, exc)
            self.metrics.errors_total.labels(lang=rec.lang, reason="store_failed").inc()

    # -- dead letters -------------------------------------------------------------------------

    def dead_letter(self, rec: ConsumedRecord, reason: str, exc: BaseException | str) -> None:
        """Write the record byte for byte to the dead-letter topic with `reason` and the
        exception's text; its offset is done when that is delivered or failed for good."""
        detail = exc if isinstance(exc, str) else repr(exc)
        self.metrics.dead_letters_total.labels(reason=reason).inc()
        log.warning(
            "dead letter %s[%d]@%d (%s): %s", rec.tp[0], rec.tp[1], rec.offset, reason, detail
        )
        try:
            value = dead_letter_value(rec, reason, detail, self._now_ms())

            def on_delivery(err: KafkaError | None, _msg: Any) -> None:
                if err is not None:
                    log.error("dead letter for %s@%d lost: %s", rec.tp, rec.offset, err)
                    self.metrics.errors_total.labels(
                        lang=rec.lang, reason="dead_letter_failed"
                    ).inc()
                self._mark_done(rec.tp, rec.offset)

            self._produce(self.dead_letter_topic, rec.key, value, on_delivery)
        except Exception:
            log.exception("dead letter for %s@%d could not be produced", rec.tp, rec.offset)
            self.metrics.errors_total.labels(lang=rec.lang, reason="dead_letter_failed").inc()
            self._mark_done(rec.tp, rec.offset)

    # -- the producer -------------------------------------------------------------------------

    def _produce(
        self,
        topic: str,
        key: bytes | None,
        value: bytes,
        on_delivery: Callable[[KafkaError | None, Any], None],
    ) -> None:
        if self._producer is None:
            raise KafkaException(KafkaError(KafkaError._STATE, "no producer attached"))
        for _ in range(_QUEUE_FULL_ATTEMPTS):
            try:
                self._producer.produce(topic, value=value, key=key, on_delivery=on_delivery)
                return
            except BufferError:  # local queue full: serve delivery reports, then retry
                self._producer.poll(0.1)
        raise KafkaException(KafkaError(KafkaError._QUEUE_FULL, "producer queue stays full"))
