"""The Kafka worker: request topics in, engine in the middle, replies out.

Design notes
------------
* One confluent-kafka consumer reads every language's request topic (cooperative-sticky, no
  auto commit, no auto offset store). The poll loop never waits on the model: each iteration
  polls for at most `poll_timeout_s`, hands records to the engine (`submit_translation` returns
  a handle at once), drains the queue the engine's done-callbacks fill, produces replies, and
  commits. A paused consumer keeps polling, so the group never times it out (PITFALLS).
* At-least-once, answered once: a record's offset is marked done only in the delivery callback
  of its reply (or its dead letter), and the commit is the lowest offset not yet done per
  partition (`workers.offsets.OffsetTracker`). A reply is stored in redis under its request id
  when it is delivered, so a redelivered request (after a crash before the commit) is answered
  with the stored bytes instead of being translated again.
* Fair intake: librdkafka has no fairness across topics, so per language an
  `IntakeController` counts requests in the engine; at its high water the language's
  partitions are paused, at its low water resumed (hysteresis, since `pause()` drops the
  prefetched records). A global cap (`max_in_flight`) pauses everything the same way.
* Never die on a record: any failure on one record becomes a dead letter (undecodable bytes,
  an unusable reply topic, an unexpected exception) or an ERROR/REJECTED/EXPIRED reply.
* Shutdown (SIGTERM/SIGINT or the stop event): pause all intake, let in-flight requests finish
  for up to `drain_timeout_s` while still polling, flush the producer, commit, close the
  consumer, stop the engine. Records read but not handed to the engine are not committed.

Threads: everything here runs on the poll thread except the engine's done-callbacks, which
only put `(request_id, result)` on a queue. Kafka's rebalance and delivery callbacks are
served from `consume()` / `producer.poll()` on the poll thread.

The pieces around this loop live beside it: `kafka_config` (client settings, the reply-topic
check), `records` (what is held per record and per in-flight request), `validation` (checks
before the engine), `replies` (building result and dead-letter records), `partitions`
(assignment, pauses, commits).
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from prometheus_client import CollectorRegistry

from schemas.codec import SchemaError, decode_request, encode_result
from topics.catalog import DEAD_LETTERS, request_topic
from workers.engine.types import GenerationResult, TranslationEngine, UnsupportedLanguage
from workers.fairness.intake import IntakeController
from workers.kafka_config import (
    MISSING_TOPIC_CODES,
    ReplyTopicChecker,
    consumer_config,
    producer_config,
)
from workers.metrics import WorkerMetrics
from workers.partitions import PartitionState
from workers.records import ConsumedRecord, InFlight
from workers.replies import (
    STATUS_OF,
    broker_to_now_ms,
    dead_letter_value,
    engine_reply,
    plain_reply,
)
from workers.results_store import RedisResultStore, ResultStore, ResultStoreError
from workers.settings import Settings
from workers.validation import validate_request

__all__ = ["STATUS_OF", "Worker", "consumer_config", "producer_config"]

log = logging.getLogger(__name__)


class Worker:
    """Consumes `tolk.requests.<lang>` for `settings.languages`, answers on each reply topic."""

    def __init__(
        self,
        settings: Settings,
        engine: TranslationEngine,
        consumer_factory: Callable[[dict[str, Any]], Any] = Consumer,
        producer_factory: Callable[[dict[str, Any]], Any] = Producer,
        store: ResultStore | None = None,
        registry: CollectorRegistry | None = None,
        clock_ms: Callable[[], int] | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self._consumer_factory = consumer_factory
        self._producer_factory = producer_factory
        self.store: ResultStore = (
            store
            if store is not None
            else RedisResultStore(settings.redis_url, settings.result_ttl_s)
        )
        self.registry = registry if registry is not None else _default_registry()
        self.metrics = WorkerMetrics(self.registry)
        self.metrics.init_languages(settings.languages)
        self._now_ms = clock_ms or (lambda: int(time.time() * 1000))

        prefix = settings.topic_prefix
        self.topic_lang: dict[str, str] = {
            prefix + request_topic(lang): lang for lang in settings.languages
        }
        self.dead_letter_topic = prefix + DEAD_LETTERS
        self.intake = IntakeController.from_policies(
            {k: v for k, v in settings.policies.items() if k in settings.languages},
            low_water_ratio=settings.low_water_ratio,
            default_high_water=max(1, settings.max_in_flight),
        )

        self._consumer: Any = None
        self._producer: Any = None
        self._done: queue.SimpleQueue[tuple[str, GenerationResult]] = queue.SimpleQueue()
        self._inflight: dict[str, InFlight] = {}
        self._answered: dict[str, bytes] = {}  # produced, delivery pending: rid -> reply bytes
        self.partitions = PartitionState(
            self.topic_lang, self.metrics, settings.commit_every, settings.commit_interval_s
        )
        self.tracker = self.partitions.tracker  # offsets per partition (tests, health)
        self._global_paused = False
        self._draining = False
        self._crash = False
        self._reply_topics = ReplyTopicChecker(settings.topic_check_ttl_s)
        self._last_gauges = 0.0
        self._tokens_window: deque[tuple[float, int]] = deque()
        self._stop_event = threading.Event()
        self.assigned_event = threading.Event()  # set once the first assignment arrived
        self.stopped_event = threading.Event()  # set when run() has returned

    # -- lifecycle ----------------------------------------------------------------------------

    def run(self, stop_event: threading.Event | None = None) -> None:
        """Poll until `stop_event` is set (or SIGTERM/SIGINT when on the main thread), then
        shut down gracefully."""
        stop = stop_event if stop_event is not None else self._stop_event
        self._stop_event = stop
        restore = self._install_signal_handlers(stop)
        http_server = self._start_metrics_server()
        try:
            self.engine.start()
            self._consumer = self._consumer_factory(consumer_config(self.settings))
            self._producer = self._producer_factory(producer_config(self.settings))
            self._consumer.subscribe(
                list(self.topic_lang),
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
            log.info("worker %s consuming %s", self.settings.worker_id, sorted(self.topic_lang))
            while not stop.is_set() and not self._crash:
                self._iteration()
            if self._crash:
                self._abandon()
            else:
                self._shutdown()
        finally:
            restore()
            if http_server is not None:
                http_server.shutdown()
            self.stopped_event.set()

    def run_in_thread(self, stop_event: threading.Event | None = None) -> threading.Thread:
        """Start `run()` on a daemon thread (tests, embedding); `stop()` ends it."""
        if stop_event is not None:
            self._stop_event = stop_event
        thread = threading.Thread(
            target=self.run, args=(self._stop_event,), name="tolk-worker", daemon=True
        )
        thread.start()
        return thread

    def stop(self) -> None:
        """Ask the loop to shut down gracefully (drain, flush, commit, close)."""
        self._stop_event.set()

    def crash(self) -> None:
        """Test hook: leave the loop at once, as a crash would after replies went out but before
        the next commit: no drain, no commit. Replies already produced are flushed and the
        consumer leaves the group (so a successor gets the partitions without waiting for the
        session timeout)."""
        self._crash = True

    def _install_signal_handlers(self, stop: threading.Event) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

        def handler(signum: int, frame: object) -> None:
            log.info("signal %s: stopping intake and draining", signal.Signals(signum).name)
            stop.set()

        for s in previous:
            signal.signal(s, handler)

        def restore() -> None:
            for s, h in previous.items():
                signal.signal(s, h)

        return restore

    def _start_metrics_server(self) -> Any:
        if self.settings.metrics_port <= 0:
            return None
        from prometheus_client import start_http_server

        try:
            server, _thread = start_http_server(self.settings.metrics_port, registry=self.registry)
        except OSError as exc:
            log.error("metrics port %d unavailable: %s", self.settings.metrics_port, exc)
            return None
        return server

    # -- the loop -----------------------------------------------------------------------------

    def _iteration(self) -> None:
        try:
            msgs = self._consumer.consume(
                num_messages=self.settings.max_poll_records,
                timeout=self.settings.poll_timeout_s,
            )
            if msgs:
                self.metrics.batch_size.observe(len(msgs))
                self._handle_batch(msgs)
            self._drain_done()
            self._producer.poll(0)
            self._reconcile_pauses()
            self._maybe_commit()
            self._update_gauges()
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if isinstance(err, KafkaError) and err.fatal():
                raise
            log.exception("worker loop: Kafka error (continuing)")
            time.sleep(0.05)
        except Exception:
            log.exception("worker loop: unexpected error (continuing)")
            time.sleep(0.05)

    def _shutdown(self) -> None:
        log.info("worker %s draining %d in-flight", self.settings.worker_id, len(self._inflight))
        self._draining = True
        self._reconcile_pauses()
        end = time.monotonic() + self.settings.drain_timeout_s
        while self._inflight and time.monotonic() < end:
            self._iteration()
        for inflight in list(self._inflight.values()):
            log.warning("drain timeout: abandoning %s (redelivered later)", inflight.request_id)
            with contextlib.suppress(Exception):
                inflight.handle.cancel()
        left = self._producer.flush(max(1.0, end - time.monotonic()))
        if left:
            log.warning("%d messages not delivered at shutdown", left)
        self._commit()
        self._consumer.close()
        self.engine.stop(drain=False, timeout=5.0)
        log.info("worker %s stopped", self.settings.worker_id)

    def _abandon(self) -> None:
        log.warning("worker %s: crash() requested, leaving without commit", self.settings.worker_id)
        with contextlib.suppress(Exception):
            self._producer.flush(10.0)
        with contextlib.suppress(Exception):
            self._consumer.close()
        with contextlib.suppress(Exception):
            self.engine.stop(drain=False, timeout=2.0)

    # -- records in ---------------------------------------------------------------------------

    def _handle_batch(self, msgs: Iterable[Any]) -> None:
        ready: list[ConsumedRecord] = []
        taken: dict[str, int] = {}  # records of this batch per language, not yet submitted
        rewound: set[tuple[str, int]] = set()
        for msg in msgs:
            err = msg.error()
            if err is not None:
                self._on_consume_error(err)
                continue
            if self._draining:
                continue  # not handed: stays above the commit point, read again later
            tp = (msg.topic(), msg.partition())
            if tp in rewound:
                continue  # read again from the rewound offset once the language resumes
            lang = self.topic_lang.get(tp[0], "unknown")
            if self._over_quota(lang, taken):
                # One consume() batch can hold hundreds of a flooding language's records:
                # handing them all over would blow its intake quota and the global cap (which
                # pauses every language, the light ones too). Rewind the partition to this
                # record instead; the language is paused at the end of the iteration.
                with contextlib.suppress(KafkaException):
                    self._consumer.seek(TopicPartition(tp[0], tp[1], msg.offset()))
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
            )
            try:
                if self._decode_and_route(rec):
                    ready.append(rec)
            except Exception as exc:
                self._dead_letter(rec, "poison", exc)
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
        if err.fatal():
            raise KafkaException(err)
        log.warning("consumer error: %s", err)

    def _decode_and_route(self, rec: ConsumedRecord) -> bool:
        """Decode and check the reply topic; False when the record was dead-lettered."""
        try:
            rec.request = decode_request(rec.value)
        except SchemaError as exc:
            self._dead_letter(rec, "undecodable", exc)
            return False
        if not rec.request_id:
            self._dead_letter(rec, "invalid", "request_id is empty: no reply can be correlated")
            return False
        problem = self._reply_topic_problem(str(rec.request.get("reply_topic", "")))
        if problem is not None:
            self._dead_letter(rec, "reply_topic_missing", problem)
            return False
        return True

    def _dispatch(self, records: list[ConsumedRecord]) -> None:
        """Answer from the store what was answered before; check and submit the rest."""
        lookup = [r for r in records if r.request_id not in self._inflight]
        try:
            stored_list = self.store.get_many([r.request_id for r in lookup])
        except ResultStoreError as exc:
            log.warning("result store lookup failed (translating anyway): %s", exc)
            stored_list = [None] * len(lookup)
        stored = {r.request_id: v for r, v in zip(lookup, stored_list, strict=True) if v}
        for rec in records:
            try:
                rid = rec.request_id
                inflight = self._inflight.get(rid)
                if inflight is not None:
                    self.metrics.duplicates_total.inc()
                    inflight.records.append(rec)
                    continue
                previous = self._answered.get(rid) or stored.get(rid)
                if previous is not None:
                    self.metrics.duplicates_total.inc()
                    self._produce_reply(rec, previous, store=False)
                    continue
                problem = self._validate(rec)
                if problem is not None:
                    status, reason, error = problem
                    self._reply_without_engine(rec, status, reason, error)
                    continue
                self._submit(rec)
            except Exception as exc:
                self._dead_letter(rec, "poison", exc)

    def _validate(self, rec: ConsumedRecord) -> tuple[str, str, str] | None:
        """(status, metric reason, error text) when the request cannot be translated."""
        return validate_request(
            rec.request,
            topic=rec.tp[0],
            topic_lang=rec.lang,
            served=self.settings.languages,
            engine_languages=tuple(getattr(self.engine, "languages", ()) or ()),
            max_text_bytes=self.settings.max_text_bytes,
            now_ms=self._now_ms(),
        )

    def _submit(self, rec: ConsumedRecord) -> None:
        req = rec.request
        rid = rec.request_id
        deadline_ms = req.get("deadline")
        deadline_mono = None
        if deadline_ms is not None:
            # Wall-clock epoch millis -> the engine's monotonic clock.
            deadline_mono = time.monotonic() + (int(deadline_ms) - self._now_ms()) / 1000.0
        policy = self.settings.policy(rec.lang)
        try:
            handle = self.engine.submit_translation(
                request_id=rid,
                text=str(req["text"]),
                source_lang=str(req.get("source_lang", "")),
                target_lang=str(req["target_lang"]),
                deadline=deadline_mono,
                max_new_tokens=policy.max_new_tokens if policy else None,
            )
        except UnsupportedLanguage as exc:
            self._reply_without_engine(rec, "REJECTED", "unsupported_language", str(exc))
            return
        except Exception as exc:
            self._reply_without_engine(
                rec, "ERROR", "engine_error", f"engine refused the request: {exc!r}"
            )
            return
        self._inflight[rid] = InFlight(rid, rec.lang, handle, [rec], self._now_ms())
        self.intake.on_enqueued(rec.lang)
        done = self._done

        def on_done(result: GenerationResult) -> None:  # engine thread: only enqueue
            done.put((rid, result))

        handle.add_done_callback(on_done)

    # -- answers out --------------------------------------------------------------------------

    def _drain_done(self) -> None:
        while True:
            try:
                rid, result = self._done.get_nowait()
            except queue.Empty:
                return
            inflight = self._inflight.pop(rid, None)
            if inflight is None:
                continue
            self.intake.on_done(inflight.lang)
            try:
                self._answer_from_engine(inflight, result)
            except Exception as exc:
                for rec in inflight.records:
                    self._dead_letter(rec, "poison", exc)

    def _answer_from_engine(self, inflight: InFlight, result: GenerationResult) -> None:
        lang = inflight.lang
        reply = engine_reply(
            inflight,
            result,
            worker_id=self.settings.worker_id,
            model_version=self.engine.model_version,
            now_ms=self._now_ms(),
        )
        status = reply["status"]
        value = encode_result(reply)
        m = self.metrics
        m.requests_total.labels(lang=lang, status=status).inc()
        if status != "OK":
            m.errors_total.labels(lang=lang, reason=f"engine_{result.finish_reason.value}").inc()
        m.tokens_generated_total.labels(lang=lang).inc(result.tokens_out)
        self._tokens_window.append((time.monotonic(), result.tokens_out))
        m.queue_seconds.labels(lang=lang).observe(max(0.0, reply["timings"]["queue_ms"]) / 1e3)
        m.e2e_latency_seconds.labels(lang=lang).observe(reply["timings"]["total_ms"] / 1e3)
        if status == "OK":
            policy = self.settings.policies.get(lang)
            slo_s = policy.slo_p99_s if policy is not None else None
            m.observe_slo(lang, reply["timings"]["total_ms"] / 1e3, slo_s)
        for i, rec in enumerate(inflight.records):
            self._produce_reply(rec, value, store=(i == 0))

    def _reply_without_engine(
        self, rec: ConsumedRecord, status: str, reason: str, error: str
    ) -> None:
        now_ms = self._now_ms()
        reply = plain_reply(
            rec, worker_id=self.settings.worker_id, status=status, error=error, now_ms=now_ms
        )
        self.metrics.requests_total.labels(lang=rec.lang, status=status).inc()
        self.metrics.errors_total.labels(lang=rec.lang, reason=reason).inc()
        self.metrics.e2e_latency_seconds.labels(lang=rec.lang).observe(
            broker_to_now_ms(rec, now_ms) / 1e3
        )
        self._produce_reply(rec, encode_result(reply), store=True)

    def _produce_reply(self, rec: ConsumedRecord, value: bytes, *, store: bool) -> None:
        rid = rec.request_id
        topic = str(rec.request.get("reply_topic", ""))
        if store:
            self._answered[rid] = value

        def on_delivery(err: KafkaError | None, _msg: Any) -> None:
            if store:
                self._answered.pop(rid, None)
            if err is None:
                if store:
                    try:
                        self.store.put(rid, value)
                    except ResultStoreError as exc:
                        log.warning("result of %s not stored: %s", rid, exc)
                        self.metrics.errors_total.labels(lang=rec.lang, reason="store_failed").inc()
                self._mark_done(rec)
                return
            if err.code() in MISSING_TOPIC_CODES:
                self._reply_topics.forget(topic)
                self._dead_letter(rec, "reply_topic_missing", f"reply to {topic!r} failed: {err}")
            else:
                self._dead_letter(rec, "reply_undeliverable", f"reply to {topic!r} failed: {err}")

        try:
            self._produce(topic, rid.encode("utf-8"), value, on_delivery)
        except KafkaException as exc:
            if store:
                self._answered.pop(rid, None)
            self._dead_letter(rec, "reply_undeliverable", exc)

    def _dead_letter(self, rec: ConsumedRecord, reason: str, exc: BaseException | str) -> None:
        """Write the record byte for byte to the dead-letter topic; its offset is done when
        that is delivered (or failed for good: a lost dead letter must not stall the
        partition's commits forever, so it is logged and counted instead)."""
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
                self._mark_done(rec)

            self._produce(self.dead_letter_topic, rec.key, value, on_delivery)
        except Exception:
            log.exception("dead letter for %s@%d could not be produced", rec.tp, rec.offset)
            self.metrics.errors_total.labels(lang=rec.lang, reason="dead_letter_failed").inc()
            self._mark_done(rec)

    def _produce(
        self,
        topic: str,
        key: bytes | None,
        value: bytes,
        on_delivery: Callable[[KafkaError | None, Any], None],
    ) -> None:
        for _ in range(100):
            try:
                self._producer.produce(topic, value=value, key=key, on_delivery=on_delivery)
                return
            except BufferError:  # local queue full: serve delivery reports, then retry
                self._producer.poll(0.1)
        raise KafkaException(KafkaError(KafkaError._QUEUE_FULL, "producer queue stays full"))

    def _mark_done(self, rec: ConsumedRecord) -> None:
        self.partitions.mark_done(rec.tp, rec.offset)

    def _reply_topic_problem(self, topic: str) -> str | None:
        return self._reply_topics.problem(self._producer, topic)

    # -- intake quotas ------------------------------------------------------------------------

    def _wanted_paused(self) -> set[str]:
        langs = set(self.topic_lang.values())
        if self._draining or self._global_paused:
            return langs
        return set(self.intake.paused()) & langs

    def _reconcile_pauses(self) -> None:
        self.intake.to_pause()
        self.intake.to_resume()
        total = len(self._inflight)
        cap = self.settings.max_in_flight
        if total >= cap:
            self._global_paused = True
        elif self._global_paused and total <= math.floor(cap * self.settings.low_water_ratio):
            self._global_paused = False
        self.partitions.reconcile(self._consumer, self._wanted_paused())

    def paused_languages(self) -> set[str]:
        """Languages with at least one assigned partition paused now."""
        return self.partitions.paused_languages()

    # -- rebalance (served from consume() on the poll thread) ---------------------------------

    def _on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        try:
            keys = self.partitions.assign(consumer, partitions, self._wanted_paused())
            log.info("assigned %s", keys)
            self.assigned_event.set()
        except Exception:
            log.exception("on_assign failed")

    def _on_revoke(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        try:
            keys = {(p.topic, p.partition) for p in partitions}
            if not self._crash:  # close() after crash() revokes too: a crash commits nothing
                self.partitions.commit(consumer, only=keys)
            self.partitions.forget(keys)
            log.info("revoked %s", sorted(keys))
        except Exception:
            log.exception("on_revoke failed")

    def _on_lost(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        try:
            keys = {(p.topic, p.partition) for p in partitions}
            self.partitions.forget(keys)  # no commit: they already belong to someone else
            log.warning("lost %s", sorted(keys))
        except Exception:
            log.exception("on_lost failed")

    def _maybe_commit(self) -> None:
        self.partitions.maybe_commit(self._consumer)

    def _commit(self) -> None:
        self.partitions.commit(self._consumer)

    # -- gauges -------------------------------------------------------------------------------

    def _update_gauges(self) -> None:
        now = time.monotonic()
        if now - self._last_gauges < 0.5:
            return
        self._last_gauges = now
        paused = self.paused_languages()
        for lang in self.settings.languages:
            self.metrics.in_flight.labels(lang=lang).set(self.intake.depth(lang))
            self.metrics.paused.labels(lang=lang).set(1 if lang in paused else 0)
        queue = getattr(self.engine, "queue", None)  # FairEngine exposes its VTC/FCFS queue
        if queue is not None and hasattr(queue, "service_by_group"):
            # RuntimeError: the engine thread resized a ledger dict meanwhile; next time then
            with contextlib.suppress(RuntimeError):
                self.metrics.update_fairness(queue)
        window_s = 5.0
        while self._tokens_window and now - self._tokens_window[0][0] > window_s:
            self._tokens_window.popleft()
        tokens = sum(n for _, n in self._tokens_window)
        self.metrics.tokens_per_second.set(tokens / window_s)

    # -- introspection (tests, health) ---------------------------------------------------------

    def in_flight(self) -> int:
        return len(self._inflight)

    def stats(self) -> Mapping[str, Any]:
        return {
            "in_flight": len(self._inflight),
            "assigned": sorted(self.partitions.assigned),
            "paused": sorted(self.partitions.paused),
            "pending_offsets": self.tracker.total_pending(),
        }


def _default_registry() -> CollectorRegistry:
    """A registry of its own per worker (several workers may share a test process), with the
    process and platform collectors the default registry would have."""
    from prometheus_client import PlatformCollector, ProcessCollector

    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry
