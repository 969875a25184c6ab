"""The Kafka worker: request topics in, engine in the middle, replies out.

Design notes
------------
* One confluent-kafka consumer reads every language's request topic (cooperative-sticky, no
  auto commit, no auto offset store). The poll loop never waits on the model: each iteration
  polls for at most `poll_timeout_s`, hands records to the engine (`submit_translation` returns
  a handle at once), drains the queue the engine's done-callbacks fill, produces replies, and
  commits. A paused consumer keeps polling, so the group never times it out (PITFALLS).
* At-least-once, answered once: the reply path (`workers.kafka.reply_publisher.ReplyPublisher`)
  marks a record's offset done only in the delivery callback of its reply (or its dead letter)
  and stores a delivered reply in redis under its request id; the commit is the lowest offset
  not yet done per partition (`workers.kafka.offsets.OffsetTracker`). A redelivered request (after a
  crash before the commit) is answered with the stored bytes instead of being translated again.
  Redis is an optimisation: while it is down the store fails fast (short timeouts, a circuit
  breaker: `workers.store.results.CircuitBreakerStore`), every request is translated, and each
  failed or skipped look-up / put counts in `tolk_store_degraded_total{op}`.
* Fair intake: per language quotas with hysteresis and a global cap pause partitions; records
  of one batch past a quota are rewound with `seek()` (`workers.kafka.intake`,
  `workers.kafka.record_life`).
* Engine results: a failed run is retried up to `max_attempts` runs, then dead-lettered as
  "poison" and answered ERROR; a revoked partition's result is answered or dropped
  (`workers.kafka.engine_runs`).
* Arms (with `Settings.arm`; `workers.kafka.arm_routing`): group `<group>.<arm>`; a record that is
  another arm's (`workers.arms`) is done without a reply; replies carry `"<version>@<arm>"`.
* Never die on a record: any failure on one record becomes a dead letter (undecodable bytes,
  an unusable reply topic, an unexpected exception) or an ERROR/REJECTED/EXPIRED reply.
* Shutdown (SIGTERM/SIGINT or the stop event): pause all intake, let in-flight requests finish
  for up to `drain_timeout_s` while still polling, flush the producer, commit, close the
  consumer, stop the engine. Records read but not handed to the engine are not committed.

Threads: everything here runs on the poll thread except the engine's done-callbacks, which
only put `(request_id, result)` on a queue. Kafka's rebalance and delivery callbacks are
served from `consume()` / `producer.poll()` on the poll thread.

One record's life, and who does what (`workers.kafka.record_life` has the whole picture):

* `RecordLife` (kafka/record_life.py) owns every record's state: its offset (`partitions`, over
  `offsets`), its language's quota and the global cap, the request in the engine that it waits
  on. Nothing else holds any of that.
* The steps decide and return outcomes: `RecordIntake.take()` (kafka/intake.py: quotas and
  rewinds, decoding, arm routing, duplicates, checks) yields `Submit`, `AnswerNow`, `Resend`,
  `DeadLetter` or `Skip`; `EngineRuns` (kafka/engine_runs.py: submit, results, bounded retries)
  yields `Answer`, `AnswerNow` or `DeadLetter`.
* This loop acts on each outcome (`_act`) through the `ReplyPublisher` (kafka/reply_publisher.py:
  produce, store, dead letters, retries in kafka/reply_retry.py; the offset is done on delivery).

The worker keeps the loop, shutdown and the gauges; `workers.kafka.config` has the client settings
and the reply-topic check. A `FairEngine`'s fair-share gauges are read
from its `queue_snapshot()` (one frozen copy, `workers.serving.queue_snapshot`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from prometheus_client import CollectorRegistry

from topics.catalog import request_topic
from workers.engine.types import TranslationEngine
from workers.health import WorkerProbes, start_health_server
from workers.kafka.arm_control import ShareSource
from workers.kafka.arm_routing import ArmRouter, ArmScopedStore
from workers.kafka.config import ReplyTopicChecker, consumer_config, is_fatal, producer_config
from workers.kafka.drain import start_drain_monitor
from workers.kafka.engine_runs import EngineRuns
from workers.kafka.intake import RecordIntake
from workers.kafka.record_life import (
    Answer,
    AnswerNow,
    DeadLetter,
    Outcome,
    RecordLife,
    Resend,
    Skip,
    Submit,
)
from workers.kafka.replies import STATUS_OF
from workers.kafka.reply_publisher import ReplyConfig, ReplyPublisher
from workers.metrics import WorkerMetrics
from workers.process_hooks import (
    install_stop_signals,
    seconds_since_process_start,
    start_metrics_server,
    worker_registry,
)
from workers.settings import Settings
from workers.store.results import CircuitBreakerStore, RedisResultStore, ResultStore
from workers.tracing import request_tracer

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
        arm_shares: ShareSource | None = None,  # an arm's share table (default: control topic)
        tracer_provider: Any = None,  # OpenTelemetry; default: per Settings.tracing (tracing.py)
    ) -> None:
        self.settings = settings
        self.engine = engine
        self._consumer_factory = consumer_factory
        self._producer_factory = producer_factory
        self.registry = registry if registry is not None else worker_registry()
        self.metrics = WorkerMetrics(self.registry)
        self.metrics.init_languages(settings.languages)
        if hasattr(engine, "bind_metrics"):  # workers.stages.protected.stage counts in our metrics
            engine.bind_metrics(self.metrics.stages)
        self.arms = ArmRouter.for_settings(settings, self.metrics, arm_shares)  # None: no arm
        degraded = self.metrics.store_degraded_total
        if store is None:
            store = RedisResultStore(
                settings.redis_url, settings.result_ttl_s, socket_timeout_s=settings.store_timeout_s
            )
        retried = self.metrics.redis_retries_total
        self.store = CircuitBreakerStore(  # fails fast while redis is down (store/results.py)
            store if self.arms is None else ArmScopedStore(store, self.arms.arm),
            on_degraded=lambda op: degraded.labels(op=op).inc(),
            patience_s=settings.store_patience_s,  # a timeout is retried first (breaker.py)
            on_retry=lambda op: retried.labels(store="results", op=op).inc(),
        )
        self._now_ms = clock_ms or (lambda: int(time.time() * 1000))

        prefix = settings.topic_prefix
        self.topic_lang: dict[str, str] = {
            prefix + request_topic(lang): lang for lang in settings.languages
        }
        self.life = RecordLife(settings, self.topic_lang, self.metrics)  # the records' state
        self._crash = False
        self._consumer: Any = None
        self._producer: Any = None
        self.publisher = ReplyPublisher(  # the reply step: produce, store, dead letters
            ReplyConfig.from_settings(settings, self.arms.model_version("") if self.arms else ""),
            store=self.store,
            metrics=self.metrics,
            reply_topics=ReplyTopicChecker(settings.topic_check_ttl_s),
            mark_done=self.life.done,
            clock_ms=self._now_ms,
            tracer=request_tracer(settings.tracing, settings.worker_id, tracer_provider),
        )
        self.runs = EngineRuns(engine, settings, self.life, self.metrics, self._now_ms)
        self.records = RecordIntake(  # the intake step: a consumed batch -> outcomes
            settings,
            self.life,
            self.publisher,
            engine_languages=lambda: tuple(getattr(engine, "languages", ()) or ()),
            arms=self.arms,
            clock_ms=self._now_ms,
        )
        self._last_gauges = 0.0
        self._stop_event = threading.Event()
        self.assigned_event = self.life.assigned_event  # set once the first assignment arrived
        self.subscribed_event = threading.Event()  # engine started, consumer subscribed
        self.stopped_event = threading.Event()  # set when run() has returned
        self.metrics_port: int | None = None  # where run() serves /metrics (None: off)
        self.health_port: int | None = None  # where run() serves /readyz, /livez (None: off)

    # -- lifecycle ----------------------------------------------------------------------------

    def run(self, stop_event: threading.Event | None = None) -> None:
        """Poll until `stop_event` is set (or SIGTERM/SIGINT when on the main thread), then
        shut down gracefully."""
        stop = stop_event if stop_event is not None else self._stop_event
        self._stop_event = stop
        # an explicit port that is taken raises PortUnavailable here, before anything started
        # (workers/ports.py); the ports actually served are kept for whoever runs several
        http_server = start_metrics_server(self.settings.metrics_port, self.registry)
        probes = WorkerProbes(self, self.settings.liveness_stall_s)  # workers/health.py
        try:
            health_server = start_health_server(self.settings.health_port, probes)
        except BaseException:
            if http_server is not None:
                http_server.shutdown()
            raise
        self.metrics_port = None if http_server is None else int(http_server.server_address[1])
        self.health_port = None if health_server is None else health_server.port
        restore = install_stop_signals(stop)
        drain_monitor = start_drain_monitor(self.settings, self.topic_lang, self.metrics)
        try:
            self.engine.start()
            self._consumer = self._consumer_factory(consumer_config(self.settings))
            self._producer = self._producer_factory(producer_config(self.settings))
            self.publisher.attach(self._producer)
            if self.arms is not None:  # the share table read to its end before any request
                self.arms.start()
            self._consumer.subscribe(
                list(self.topic_lang),
                on_assign=self.life.on_assign,  # rebalances: the records' owner
                on_revoke=self.life.on_revoke,
                on_lost=self.life.on_lost,
            )
            self.subscribed_event.set()
            up, cpu = seconds_since_process_start(), time.process_time()
            log.info(
                "worker %s consuming %s (%s since process start, %.1fs of CPU)",
                self.settings.worker_id,
                sorted(self.topic_lang),
                "?" if up is None else f"{up:.1f}s",
                cpu,  # with `up`: how much of the start-up was waiting for a busy machine
            )
            try:
                while not stop.is_set() and not self._crash:
                    self._iteration()
            except KafkaException as exc:  # fatal (_iteration re-raises only those)
                log.error("worker %s: fatal Kafka error, exiting: %s", self.settings.worker_id, exc)
                self._abandon()  # replies flushed; uncommitted records go to the next owner
                raise
            if self._crash:
                self._abandon()
            else:
                self._shutdown()
        finally:
            restore()
            if self.arms is not None:
                self.arms.stop()
            if http_server is not None:
                http_server.shutdown()
            if drain_monitor is not None:
                drain_monitor.stop()
            self.stopped_event.set()
            if health_server is not None:
                health_server.shutdown()

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
        self.life.crashed = True

    # -- the loop -----------------------------------------------------------------------------

    def _iteration(self) -> None:
        try:
            msgs = self.records.poll(self._consumer)
            if msgs:
                self.metrics.batch_size.observe(len(msgs))
                draining = self.life.draining
                self._act(self.records.take(msgs, self._consumer, self._producer, draining))
            self._act(self.runs.drain_done())
            self.life.retry_rewinds(self._consumer)
            self._producer.poll(0)
            self.publisher.retry_due(time.monotonic())  # replies / dead letters to produce again
            self.life.reconcile_pauses(self._consumer)
            self.life.maybe_commit(self._consumer)
            self._update_gauges()
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if isinstance(err, KafkaError) and is_fatal(err):
                raise
            log.exception("worker loop: Kafka error (continuing)")
            time.sleep(0.05)
        except Exception:
            log.exception("worker loop: unexpected error (continuing)")
            time.sleep(0.05)

    def _act(self, outcomes: Iterable[Outcome]) -> None:
        """Do what the steps decided, one outcome at a time (a step decides its next record
        after the last one was acted on: workers.kafka.record_life). An outcome that raises
        becomes a
        poison dead letter of its records (one that was a poison dead letter already raises)."""
        publisher = self.publisher
        for outcome in outcomes:
            try:
                match outcome:
                    case Submit(rec):
                        self._act(self.runs.submit(rec))
                    case AnswerNow(rec, status, reason, error):
                        publisher.answer_without_engine(rec, status, reason, error)
                    case Resend(rec, value):
                        publisher.produce_reply(rec, value, store=False)
                    case DeadLetter(rec, reason, detail, reply_error=True):
                        publisher.dead_letter_and_reply_error(rec, reason, str(detail))
                    case DeadLetter(rec, reason, detail):
                        publisher.dead_letter(rec, reason, detail)
                    case Skip(rec):
                        self.life.done(rec.tp, rec.offset)  # another arm's: no reply
                    case Answer(inflight, result, model_version, finished_at):
                        publisher.answer_from_engine(
                            inflight, result, model_version=model_version, finished_at=finished_at
                        )
            except Exception as exc:
                if isinstance(outcome, DeadLetter) and outcome.reason == "poison":
                    raise
                records = outcome.inflight.records if isinstance(outcome, Answer) else [outcome.rec]
                for rec in records:
                    publisher.dead_letter(rec, "poison", exc)

    def _shutdown(self) -> None:
        log.info("worker %s draining %d in-flight", self.settings.worker_id, self.in_flight())
        self.life.draining = True
        self.life.reconcile_pauses(self._consumer)
        end = time.monotonic() + self.settings.drain_timeout_s
        while self.life.in_flight() and time.monotonic() < end:
            self._iteration()
        for inflight in self.life.requests():
            log.warning("drain timeout: abandoning %s (redelivered later)", inflight.request_id)
            with contextlib.suppress(Exception):
                inflight.handle.cancel()
        left = self._producer.flush(max(1.0, end - time.monotonic()))
        if left:
            log.warning("%d messages not delivered at shutdown", left)
        self.publisher.unstored.flush()  # result writes that failed: one last try
        self.life.commit(self._consumer)
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

    def paused_languages(self) -> set[str]:
        """Languages with at least one assigned partition paused now."""
        return self.life.paused_languages()

    # -- gauges -------------------------------------------------------------------------------

    def _update_gauges(self) -> None:
        now = time.monotonic()
        if now - self._last_gauges < 0.5:
            return
        self._last_gauges = now
        paused = self.paused_languages()
        depth = self.life.languages_depth(self.settings.languages)
        for lang in self.settings.languages:
            self.metrics.in_flight.labels(lang=lang).set(depth[lang])
            self.metrics.paused.labels(lang=lang).set(1 if lang in paused else 0)
        snapshot = getattr(self.engine, "queue_snapshot", None)  # FairEngine: its queue's ledger
        if callable(snapshot):  # one frozen copy, taken under the engine's queue lock
            self.metrics.update_fairness(snapshot())
        engine_stats = getattr(self.engine, "stats_snapshot", None)  # Engine / FairEngine
        if callable(engine_stats):  # KV use, prefix hits, preemptions (engine_snapshot.py)
            self.metrics.engine.update(engine_stats())
        self.publisher.update_token_rate(now)

    # -- introspection (tests, health) ---------------------------------------------------------

    def in_flight(self) -> int:
        return self.life.in_flight()

    @property
    def draining(self) -> bool:
        """Shutting down: intake paused, in-flight requests finishing (readiness: false)."""
        return self.life.draining

    @property
    def served_languages(self) -> tuple[str, ...]:
        return self.settings.languages

    def stats(self) -> Mapping[str, Any]:
        return self.life.stats()
