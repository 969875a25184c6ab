"""`tolk guard`: the faust app that counts replies in tumbling windows and judges them.

Design notes
------------
* **Counting.** One agent reads the reply topic (concurrency 1: faust-streaming #606, a
  concurrent agent can commit past unprocessed records). Each reply becomes an observation
  (`windows.observe`) and is folded into a tumbling windowed table (`window_s`, event time =
  the reply record's timestamp) keyed by `<source partition>|<language>|<arm>`. Faust writes a
  table update to the changelog partition of the event's own partition, so the source
  partition belongs in the key: every key is written from one partition only, and a restart
  restores it whole. The value carries the last source offset folded in; faust flushes the
  changelog before it commits source offsets, so after a SIGKILL the replies since the last
  commit are read again and those already in the changelog are skipped
  (`windows.add_observation`): the counts equal an uninterrupted run's.
* **Judging.** A timer (every 0.5 s) judges, for each language in an active rollout, every
  window that has closed: its end plus `grace_s` has passed on the wall clock, and every reply
  partition has been read past it (a reply with a later timestamp processed, or the partition
  read to the high watermark seen now; at start the committed offsets count as read). The
  window's counts are summed over partitions per arm (`windows.merge_counts`) and handed to
  `policy.decide`; replies of other arms in the language are counted as `unknown_arm`.
* **Deciding.** A decision is written as a rollout event, then (if the share moved) the
  language's shares go to the control topic (`events.EventWriter`), and a log line says why
  with the figures. The rollout states come from the events topic (`events.load_book`) at
  start and are then updated by the guard's own decisions; an operator's command (`tolk
  rollout promote|abort|start`) is picked up by re-reading the events topic every
  `refresh_s`. Decisions are keyed (`policy.Decision.event_id`), so a second guard (another
  `app_id`, its own changelog) writes the same events and shares: duplicates, harmless.
* Security: the guard's own topics and the control topic use confluent-kafka with the
  deployment's security settings (`GuardConfig.kafka_config`); the faust app's aiokafka gets
  the same ones translated into faust's `broker_credentials` (`broker_auth.faust_credentials`:
  SASL_SSL with SCRAM and the CA on the secured stack), or `tolk guard` refuses to start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from schemas.codec import SchemaError, decode_result
from workers.fairness.policy import LanguagePolicy
from workers.guard.broker_auth import faust_credentials
from workers.guard.events import (
    EventWriter,
    RolloutBook,
    decision_event,
    load_book,
    shares_lost,
)
from workers.guard.metrics import GuardMetrics
from workers.guard.policy import GuardPolicy, RolloutState, decide
from workers.guard.windows import (
    Ignored,
    add_observation,
    merge_counts,
    observe,
    stats_of,
)

__all__ = ["GuardConfig", "GuardCore", "build_app", "restore_lost_shares", "run_guard"]

log = logging.getLogger("tolk.guard")


@dataclass(frozen=True)
class GuardConfig:
    """Everything the guard process needs (the CLI builds it from `Settings` and its flags)."""

    bootstrap: str
    kafka_config: Mapping[str, Any]  # confluent-kafka settings (security included)
    replies_topic: str
    events_topic: str
    control_topic: str
    policy: GuardPolicy = field(default_factory=GuardPolicy)
    slos: Mapping[str, LanguagePolicy] = field(default_factory=dict)
    app_id: str = "tolk-guard"
    guard_id: str = "tolk-guard"
    grace_s: float = 2.0  # after a window's end, for late replies
    refresh_s: float = 2.0  # operator events picked up this often
    expires_s: float = 600.0  # how long a window stays in the table (at least 20 windows)
    session_timeout_s: float = 6.0  # a killed guard's partitions free up this soon
    datadir: str = ".tolk-guard"  # faust's local state (memory store: only its metadata)


class GuardCore:
    """The guard's logic around the faust table (testable without faust: see `on_reply`)."""

    def __init__(
        self,
        config: GuardConfig,
        *,
        writer: Any = None,
        metrics: GuardMetrics | None = None,
        book: RolloutBook | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else GuardMetrics()
        self.writer = writer
        self.book = book if book is not None else RolloutBook()
        self.window_ms = config.policy.window_ms
        self.read_upto: dict[int, int] = {}  # partition -> next offset to read (processed)
        self.max_ts: dict[int, int] = {}  # partition -> latest reply timestamp processed
        self.ignored: dict[str, int] = {}
        self._last_refresh = 0.0

    # -- counting -------------------------------------------------------------------------------

    def on_reply(
        self, value: bytes | None, *, partition: int, offset: int, ts_ms: int, current: Any
    ) -> tuple[str, dict[str, Any]] | None:
        """(table key, new counts) for one reply record, None when nothing is to be written
        (ignored, or already counted); `current(key)` gives the key's counts in the record's
        window."""
        self.read_upto[partition] = max(self.read_upto.get(partition, 0), offset + 1)
        self.max_ts[partition] = max(self.max_ts.get(partition, 0), ts_ms)
        try:
            reply = decode_result(value) if value is not None else None
        except SchemaError:
            reply = None
        obs = observe(reply, record_ts_ms=ts_ms)
        if isinstance(obs, Ignored):
            self._ignore(obs.reason)
            return None
        key = f"{partition}|{obs.lang}|{obs.arm}"
        new = add_observation(current(key), obs, offset)
        if new is None:
            return None
        self.metrics.replies_total.labels(lang=obs.lang, arm=obs.arm).inc()
        return key, new

    def _ignore(self, reason: str, n: int = 1) -> None:
        self.ignored[reason] = self.ignored.get(reason, 0) + n
        self.metrics.ignored_total.labels(reason=reason).inc(n)

    # -- judging --------------------------------------------------------------------------------

    def window_counts(
        self, items: list[tuple[Any, Any]], start_ms: int
    ) -> dict[tuple[str, str], dict[str, Any]]:
        """(lang, arm) -> counts of the window starting at `start_ms`, summed over partitions;
        `items`: the table's raw (key, window range) -> value pairs."""
        parts: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
        for raw_key, value in items:
            key, window = raw_key[0], raw_key[1]
            if int(round(float(window[0]) * 1000)) != start_ms or not value:
                continue
            _, lang, arm = str(key).split("|", 2)
            parts.setdefault((lang, arm), []).append(value)
        return {k: merge_counts(v) for k, v in parts.items()}

    def caught_up(self, end_ms: int, highwaters: Mapping[int, int]) -> bool:
        """Every reply partition read past `end_ms` + grace, or to its high watermark."""
        past = end_ms + int(self.config.grace_s * 1000)
        return all(
            self.max_ts.get(p, -1) >= past or self.read_upto.get(p, 0) >= hw
            for p, hw in highwaters.items()
        )

    def due_windows(self, state: RolloutState, now_ms: int) -> list[int]:
        """Starts of the closed windows of `state` not judged yet (oldest first)."""
        w = self.window_ms
        kept_ms = int(self.config.expires_s * 1000) - 2 * w  # still in the table
        first = max(state.judge_from_ms, state.last_window_ms + 1, now_ms - kept_ms)
        first = -(-first // w) * w  # the first whole window at or after it
        grace = int(self.config.grace_s * 1000)
        return list(range(first, now_ms - w - grace + 1, w))

    def judge(
        self, state: RolloutState, start_ms: int, counts: Mapping[tuple[str, str], Any]
    ) -> Any:
        """Decide one window of `state`'s language and write the decision; the decision."""
        lang, w = state.lang, self.window_ms
        canary = stats_of(
            counts.get((lang, state.canary)),
            lang=lang,
            arm=state.canary,
            start_ms=start_ms,
            window_ms=w,
        )
        stable = stats_of(
            counts.get((lang, state.stable)),
            lang=lang,
            arm=state.stable,
            start_ms=start_ms,
            window_ms=w,
        )
        unknown = sum(
            int(c["requests"])
            for (lg, arm), c in counts.items()
            if lg == lang and arm not in (state.stable, state.canary)
        )
        if unknown:
            self._ignore("unknown_arm", unknown)
        decision = decide(state, canary, stable, self.config.slos.get(lang), self.config.policy)
        if decision is None:
            return None
        event = decision_event(decision, decided_by=self.config.guard_id, now_ms=_now_ms())
        if self.writer is not None:
            self.writer.write_event(event)
            if decision.changes_share:
                self.writer.write_shares(decision.state, updated_by=self.config.guard_id)
        self.book.apply(event)
        m = self.metrics
        m.windows_total.labels(lang=lang, verdict=decision.verdict.kind).inc()
        m.decisions_total.labels(lang=lang, action=decision.action).inc()
        m.canary_share.labels(lang=lang).set(decision.share_after)
        if canary.requests:
            m.canary_p99_seconds.labels(lang=lang).set(canary.p99_ms / 1000)
        log.info(
            "%s %s window %d: %s %s, share %g -> %g (%s) %s",
            decision.action,
            lang,
            start_ms,
            decision.verdict.kind,
            state.canary,
            decision.share_before,
            decision.share_after,
            "; ".join(decision.verdict.reasons),
            " ".join(f"{k}={v:g}" for k, v in sorted(decision.verdict.figures.items())),
        )
        return decision

    def tick(self, items: list[tuple[Any, Any]], highwaters: Mapping[int, int], now_ms: int) -> int:
        """Judge every due window of every active rollout; returns how many were judged."""
        judged = 0
        for lang in sorted(self.book.active()):
            state = self.book.states[lang]
            for start in self.due_windows(state, now_ms):
                if not self.caught_up(start + self.window_ms, highwaters):
                    break
                self.judge(self.book.states[lang], start, self.window_counts(items, start))
                judged += 1
                if not self.book.states[lang].active:
                    break
        return judged


def _now_ms() -> int:
    return int(time.time() * 1000)


def _partitions_and_committed(config: GuardConfig) -> tuple[list[int], dict[int, int]]:
    """The reply topic's partitions, and the offsets the guard's group committed on them."""
    consumer = Consumer(
        {**config.kafka_config, "group.id": config.app_id, "enable.auto.commit": False}
    )
    try:
        meta = consumer.list_topics(topic=config.replies_topic, timeout=10).topics.get(
            config.replies_topic
        )
        if meta is None or meta.error is not None or not meta.partitions:
            raise RuntimeError(
                f"reply topic {config.replies_topic} not found: `tolk topics create`"
            )
        parts = sorted(meta.partitions)
        committed = consumer.committed(
            [TopicPartition(config.replies_topic, p) for p in parts], timeout=10
        )
        return parts, {tp.partition: tp.offset for tp in committed if tp.offset >= 0}
    finally:
        consumer.close()


def _highwaters(consumer: Any, topic: str, parts: list[int]) -> dict[int, int]:
    return {
        p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=5, cached=False)[1]
        for p in parts
    }


def build_app(config: GuardConfig, core: GuardCore) -> Any:
    """The faust app: the counting agent, the windowed table, the judging timer."""
    import faust

    parts, committed = _partitions_and_committed(config)
    core.read_upto.update(committed)
    app = faust.App(
        config.app_id,
        broker=f"kafka://{config.bootstrap.split(',')[0]}",
        broker_credentials=faust_credentials(config.kafka_config),  # as the worker's clients
        store="memory://",
        datadir=config.datadir,
        web_enabled=False,
        consumer_auto_offset_reset="earliest",
        broker_commit_interval=1.0,
        broker_session_timeout=config.session_timeout_s,
        broker_heartbeat_interval=config.session_timeout_s / 3,
        table_cleanup_interval=max(config.policy.window_s, 1.0),
        topic_partitions=len(parts),
        key_serializer="json",  # the table's changelog: (key, window) keys, dict values
        value_serializer="json",
    )
    replies = app.topic(
        config.replies_topic,
        key_type=bytes,
        value_type=bytes,
        key_serializer="raw",
        value_serializer="raw",
    )
    window_s = config.policy.window_s
    table = (
        app.Table(
            "guard-window-counts",
            default=dict,
            partitions=len(parts),
        )
        .tumbling(
            timedelta(seconds=window_s),
            expires=timedelta(seconds=max(config.expires_s, window_s * 20)),
        )
        .relative_to_stream()
    )

    @app.agent(replies, concurrency=1)
    async def count_replies(stream: Any) -> None:
        async for event in stream.events():
            msg = event.message
            out = core.on_reply(
                msg.value,
                partition=msg.partition,
                offset=msg.offset,
                ts_ms=int(round(msg.timestamp * 1000)),
                current=lambda key: table[key].current(),
            )
            if out is not None:
                table[out[0]] = out[1]

    watermark_consumer: list[Any] = []
    events_read: dict[int, int] = {}  # the events topic's partition -> next offset to read

    @app.timer(interval=0.5)
    async def judge_windows() -> None:
        if not watermark_consumer:
            watermark_consumer.append(
                Consumer({**config.kafka_config, "group.id": config.app_id + ".watermarks"})
            )
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        if now - core._last_refresh >= config.refresh_s:  # operator events, off the loop
            core._last_refresh = now
            new = await loop.run_in_executor(None, _fresh_events, config, events_read)
            for event in new:
                core.book.apply(event)
        recovered = app.tables.recovery.completed.is_set()  # type: ignore[attr-defined]
        if not core.book.active() or not recovered:
            return  # nothing in rollout, or the table not yet restored from its changelog
        highwaters = await loop.run_in_executor(
            None, _highwaters, watermark_consumer[0], config.replies_topic, parts
        )
        # no await from here on: the table and the read offsets are of one instant
        core.tick(list(table.table.data.items()), highwaters, _now_ms())

    return app


def _fresh_events(config: GuardConfig, positions: dict[int, int]) -> list[dict[str, Any]]:
    from workers.guard.events import read_events

    return read_events(config.kafka_config, config.events_topic, positions=positions)


def restore_lost_shares(config: GuardConfig, book: RolloutBook, writer: Any) -> list[str]:
    """Write the shares of the rollout decisions whose shares never reached the control topic
    (a crash between an event and its shares; `events.shares_lost`), and nothing else: a
    language's entry set since its last decision (`tolk arms set`) stays. The languages
    written."""
    from workers.arm_control import read_entries_since

    entries = read_entries_since(config.kafka_config, config.control_topic)
    written = []
    for lang, state in sorted(book.states.items()):
        if shares_lost(state, book.share_set_at(lang), entries.get(lang)):
            log.info(
                "rollout %s %s: shares %s not in the control topic: writing them",
                state.rollout_id,
                lang,
                state.shares(),
            )
            writer.write_shares(state, updated_by=config.guard_id)
            written.append(lang)
    return written


def run_guard(
    config: GuardConfig,
    *,
    metrics_port: int | None = 0,
    loglevel: str = "info",
    what: str = "guard metrics (/metrics)",
    setting: str = "tolk guard --metrics-port",
) -> None:
    """Start the guard and run until SIGTERM / Ctrl-C (faust's worker). `metrics_port`: a
    port setting (workers/ports.py: a number, taken -> `PortUnavailable` before anything
    starts; AUTO_PORT; None = 9401 or a free one; 0 = off)."""
    import faust

    from workers.ports import DEFAULT_GUARD_METRICS_PORT
    from workers.process_hooks import start_metrics_server

    metrics = GuardMetrics()
    start_metrics_server(
        metrics_port,
        metrics.registry,
        default=DEFAULT_GUARD_METRICS_PORT,
        what=what,
        setting=setting,
    )
    writer = EventWriter(config.kafka_config, config.events_topic, config.control_topic)
    book = load_book(config.kafka_config, config.events_topic)
    for lang, state in sorted(book.active().items()):
        log.info(
            "rollout %s %s: %s -> %s at %g%%",
            state.rollout_id,
            lang,
            state.stable,
            state.canary,
            state.share,
        )
    restore_lost_shares(config, book, writer)
    core = GuardCore(config, writer=writer, metrics=metrics, book=book)
    app = build_app(config, core)
    faust.Worker(app, loglevel=loglevel).execute_from_commandline()
