"""`tolk guard`: the faust app that counts replies in tumbling windows and judges them.

Design notes
------------
* **Counting and judging** are `GuardCore`'s (workers/guard/core.py, without faust: its notes
  say how a reply becomes a count in the windowed table, why the source partition is in the
  key, and when a window is judged). This module builds the faust app around it: the agent
  that feeds it the reply topic (concurrency 1: faust-streaming #606, a concurrent agent can
  commit past unprocessed records), the tumbling windowed table, and the 0.5 s timer that
  hands it the table and the reply partitions' high watermarks.
* **Resuming.** Faust does not wait for the table's changelog before it commits the reply
  offsets, so after the table is restored (faust's `on_rebalance_complete`, before it seeks to
  the committed offsets) `read_again_past_the_changelog` moves a committed offset that is past
  the restored counts back to them (`GuardCore.rewind`, core.py says why).
* **Deciding.** A decision is written as a rollout event, then (if the share moved) the
  language's shares go to the control topic (`events.EventWriter`), and a log line says why
  with the figures. The rollout states come from the events topic (`events.load_book`) at
  start and are then updated by the guard's own decisions; an operator's command (`tolk
  rollout promote|abort|start`) is picked up by re-reading the events topic every
  `refresh_s`. Decisions are keyed (`policy.Decision.event_id`), so a second guard (another
  `app_id`, its own changelog) writes the same events and shares: duplicates, harmless.
* **The table's changelog topic is created here** (faust's name and settings: compact +
  delete, the windows' retention) and waited for until every partition has a leader, before
  faust starts. Faust would declare it itself, but its consumer's metadata can then list the
  new topic with no partitions yet; the table's first write checks the partition counts once
  per topic and failed ("changelog ... has 0 partitions", faust's `PartitionsMismatch`), which
  ended the counting agent for good (seen once in CI, 2026-12-05).
* Security: the guard's own topics and the control topic use confluent-kafka with the
  deployment's security settings (`GuardConfig.kafka_config`); the faust app's aiokafka gets
  the same ones translated into faust's `broker_credentials` (`broker_auth.faust_credentials`:
  SASL_SSL with SCRAM and the CA on the secured stack), or `tolk guard` refuses to start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from topics.admin import MISMATCH_PREFIX, ensure_topics
from topics.catalog import TopicSpec
from workers.guard.broker_auth import faust_credentials
from workers.guard.core import GuardConfig, GuardCore, wall_clock_ms
from workers.guard.events import (
    EventWriter,
    RolloutBook,
    load_book,
    shares_lost,
)
from workers.guard.metrics import GuardMetrics

__all__ = ["build_app", "restore_lost_shares", "run_guard"]

log = logging.getLogger("tolk.guard")


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


TABLE = "guard-window-counts"


def _ensure_changelog(config: GuardConfig, partitions: int, retention_s: float) -> str:
    """Create the windowed table's changelog topic as faust would (`<app_id>-<table>-changelog`,
    compact + delete, the windows' retention) and wait for its partitions' leaders (module
    notes); an existing one is left as it is. Returns its name."""
    name = f"{config.app_id}-{TABLE}-changelog"
    policy = {"cleanup.policy": "compact,delete", "retention.ms": str(int(retention_s * 1000))}
    spec = TopicSpec(name, partitions, policy)
    outcome = ensure_topics(config.bootstrap, [spec], client_config=config.kafka_config)[name]
    if outcome.startswith(MISMATCH_PREFIX):  # faust would refuse it at the first write
        raise RuntimeError(f"{name}: {outcome} (the reply topic's count)")
    return name


def _highwaters(consumer: Any, topic: str, parts: list[int]) -> dict[int, int]:
    return {
        p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=5, cached=False)[1]
        for p in parts
    }


def build_app(config: GuardConfig, core: GuardCore) -> Any:
    """The faust app: the counting agent, the windowed table, the judging timer."""
    import faust
    from faust.types import TP

    parts, committed = _partitions_and_committed(config)
    core.read_upto.update(committed)
    window_s = config.policy.window_s
    expires_s = max(config.expires_s, window_s * 20)
    _ensure_changelog(config, len(parts), expires_s)
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
    table = (
        app.Table(TABLE, default=dict, partitions=len(parts))
        .tumbling(timedelta(seconds=window_s), expires=timedelta(seconds=expires_s))
        .relative_to_stream()
    )

    async def read_again_past_the_changelog(sender: Any, *_: Any, **__: Any) -> None:
        # the table is restored, faust seeks to the committed offsets next (core.py: "Resuming")
        assigned = {
            tp.partition for tp in app.consumer.assignment() if tp.topic == config.replies_topic
        }
        if not assigned:
            return
        loop = asyncio.get_running_loop()
        now_committed = (await loop.run_in_executor(None, _partitions_and_committed, config))[1]
        mine = {p: off for p, off in now_committed.items() if p in assigned}
        back = core.rewind(list(table.table.data.items()), mine)
        if not back:
            return
        for p, offset in sorted(back.items()):
            log.warning(
                "reply partition %d: committed offset %d is past the restored counts: reading "
                "from %d again (GuardCore.rewind)",
                p,
                mine[p],
                offset,
            )
        offsets = {TP(config.replies_topic, p): offset for p, offset in back.items()}
        consumer: Any = app.consumer  # its _commit: as faust's own member and generation
        if not await consumer._commit(offsets):
            log.error("could not move the committed offsets back to %s", back)

    signal: Any = app.on_rebalance_complete  # mode's stubs reject an async receiver
    signal.connect(read_again_past_the_changelog)

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
        core.tick(list(table.table.data.items()), highwaters, wall_clock_ms())

    return app


def _fresh_events(config: GuardConfig, positions: dict[int, int]) -> list[dict[str, Any]]:
    from workers.guard.events import read_events

    return read_events(config.kafka_config, config.events_topic, positions=positions)


def restore_lost_shares(config: GuardConfig, book: RolloutBook, writer: Any) -> list[str]:
    """Write the shares of the rollout decisions whose shares never reached the control topic
    (a crash between an event and its shares; `events.shares_lost`), and nothing else: a
    language's entry set since its last decision (`tolk arms set`) stays. The languages
    written."""
    from workers.kafka.arm_control import read_entries_since

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
