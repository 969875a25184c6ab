"""Rollout events on Kafka: building them, writing them, reading a topic back into states.

`tolk.rollout.events` (topics/catalog.py, one partition, keyed by the language) is the
rollouts' history and their only state: `tolk rollout start|promote|abort` write an operator
event (and the shares to the control topic), the guard writes one event per judged window of
a language in rollout. `read_events` reads the topic to its end (a consumer of no group,
`assign()` from the beginning, as `workers.kafka.arm_control` reads its topic) and `RolloutBook`
folds the events into one `RolloutState` per language with `policy.apply_event`, so every
reader (the guard at start, `tolk rollout status`) sees the same states. An undecodable event
is logged and skipped.

`EventWriter` produces events and shares and waits for the broker's acknowledgement
(acks=all, idempotent producer): the guard writes the event first, then the shares, so a crash
between the two leaves an event whose shares are not in the control topic: a restarted guard
writes them (`shares_lost`: only when the language's control entry was written before the
decision, so an operator's `tolk arms set` made since is not undone); otherwise the guard
writes shares only when its own decision moves them. Shares are written to take effect
`SHARE_LEAD_MS` later, for requests stamped from then on, so both arms route every request
alike across the change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

from schemas.codec import SchemaError, decode_rollout_event, encode_rollout_event
from workers.guard.policy import Decision, RolloutState, apply_event
from workers.kafka.arm_control import publish_shares

__all__ = [
    "EventWriter",
    "RolloutBook",
    "decision_event",
    "operator_event",
    "read_events",
    "shares_lost",
]

log = logging.getLogger(__name__)

# Shares take effect this long after they are written: the workers read them within ~0.6 s, so
# every arm has the entry before the first request it applies to (exactly one arm answers).
SHARE_LEAD_MS = 2000


def decision_event(decision: Decision, *, decided_by: str, now_ms: int) -> dict[str, Any]:
    """The `RolloutEvent` of a guard's decision."""
    state = decision.state
    return {
        "event_id": decision.event_id,
        "rollout_id": state.rollout_id,
        "language": state.lang,
        "action": decision.action,
        "stable_arm": state.stable,
        "canary_arm": state.canary,
        "share_before": decision.share_before,
        "share_after": decision.share_after,
        "steps": list(state.steps),
        "window_start": decision.window_start_ms,
        "window_end": decision.window_end_ms,
        "verdict": decision.verdict.kind,
        "good_streak": state.good_streak,
        "bad_streak": state.bad_streak,
        "reasons": list(decision.verdict.reasons),
        "figures": dict(decision.verdict.figures),
        "decided_at": now_ms,
        "decided_by": decided_by,
    }


def operator_event(
    action: str,
    *,
    rollout_id: str,
    lang: str,
    stable: str,
    canary: str,
    share_before: float,
    share_after: float,
    steps: Iterable[float],
    decided_by: str,
    now_ms: int,
    reason: str = "",
) -> dict[str, Any]:
    """A START, PROMOTE or ABORT written by `tolk rollout`."""
    return {
        "event_id": f"{rollout_id}/{lang}/{action.lower()}-{now_ms}",
        "rollout_id": rollout_id,
        "language": lang,
        "action": action,
        "stable_arm": stable,
        "canary_arm": canary,
        "share_before": float(share_before),
        "share_after": float(share_after),
        "steps": [float(s) for s in steps],
        "window_start": None,
        "window_end": None,
        "verdict": "",
        "good_streak": 0,
        "bad_streak": 0,
        "reasons": [reason] if reason else [],
        "figures": {},
        "decided_at": now_ms,
        "decided_by": decided_by,
    }


@dataclass
class RolloutBook:
    """Every language's rollout state, folded from the events in topic order."""

    states: dict[str, RolloutState] = field(default_factory=dict)
    history: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # per language
    seen_ids: set[str] = field(default_factory=set)

    def apply(self, event: Mapping[str, Any]) -> bool:
        """Fold one event in; False when it changed nothing (a duplicate, another rollout)."""
        lang = str(event["language"])
        if str(event["event_id"]) in self.seen_ids:
            return False  # read again (a re-read of the topic, a second guard's duplicate)
        self.seen_ids.add(str(event["event_id"]))
        self.history.setdefault(lang, []).append(dict(event))
        before = self.states.get(lang)
        after = apply_event(before, event)
        if after is None or after == before:
            return False
        self.states[lang] = after
        return True

    def active(self) -> dict[str, RolloutState]:
        return {lang: s for lang, s in self.states.items() if s.active}

    def share_set_at(self, lang: str) -> int | None:
        """When the share of `lang`'s current rollout was last set (the `decided_at` of its
        START or of its latest event that moved the share); None without a rollout."""
        state = self.states.get(lang)
        if state is None:
            return None
        for event in reversed(self.history.get(lang, [])):
            if event["rollout_id"] != state.rollout_id:
                continue
            if event["action"] == "START" or event["share_after"] != event["share_before"]:
                return int(event["decided_at"])
        return None

    def last_decision(self, lang: str) -> dict[str, Any] | None:
        return next(
            (e for e in reversed(self.history.get(lang, [])) if e["action"] != "INCONCLUSIVE"),
            None,
        )


def shares_lost(
    state: RolloutState,
    share_set_at_ms: int | None,
    entry: tuple[int, Mapping[str, float] | None] | None,
) -> bool:
    """Did a rollout decision's shares never reach the control topic (a crash between the
    event and its shares)? `entry`: the language's control entry now and when it was written
    (the record time; `arm_control.read_entries_since`). True only when the entry differs from
    the state's shares and was written before the decision was made: an entry written at or
    after it (the decision's own write, or an operator's `tolk arms set` since) stays."""
    if entry is None:
        return True  # no entry ever: the decision's write is what is missing
    since_ms, shares = entry
    if shares is not None and dict(shares) == state.shares():
        return False
    return share_set_at_ms is not None and since_ms < share_set_at_ms


def read_events(
    kafka_config: Mapping[str, Any],
    topic: str,
    *,
    timeout_s: float = 10.0,
    positions: dict[int, int] | None = None,
) -> list[dict[str, Any]]:
    """Every decodable event of `topic`, in order (the topic read to its end once); with
    `positions` (partition -> next offset, updated in place) only the events after them: the
    guard follows the topic this way without reading it whole each time."""
    positions = positions if positions is not None else {}
    consumer = Consumer(
        {
            **kafka_config,
            "group.id": "tolk.rollout-events.unused",  # never joined
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 100,
        }
    )
    events: list[dict[str, Any]] = []
    try:
        meta = consumer.list_topics(topic=topic, timeout=timeout_s).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            return events
        parts = sorted(meta.partitions)
        ends = {}
        for p in parts:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)
            if high > max(low, positions.get(p, 0)):
                ends[p] = high
        if not ends:
            return events
        consumer.assign(
            [TopicPartition(topic, p, positions.get(p, OFFSET_BEGINNING)) for p in ends]
        )
        deadline = time.monotonic() + timeout_s
        while any(positions.get(p, -1) < end for p, end in ends.items()):
            if time.monotonic() > deadline:
                log.warning("rollout events %s: not read to the end in %.0f s", topic, timeout_s)
                break
            for msg in consumer.consume(num_messages=500, timeout=0.2):
                err = msg.error()
                if err is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        log.warning("rollout events %s: %s", topic, err)
                    continue
                positions[int(msg.partition() or 0)] = int(msg.offset() or 0) + 1
                try:
                    events.append(decode_rollout_event(msg.value() or b""))
                except SchemaError as exc:
                    log.warning("rollout event %s@%d skipped: %s", topic, msg.offset(), exc)
    finally:
        consumer.close()
    return events


def load_book(kafka_config: Mapping[str, Any], topic: str) -> RolloutBook:
    """The rollout states as the topic stands now."""
    book = RolloutBook()
    for event in read_events(kafka_config, topic):
        book.apply(event)
    return book


class EventWriter:
    """Writes rollout events and the shares they stand for (see the module docstring)."""

    def __init__(
        self, kafka_config: Mapping[str, Any], events_topic: str, control_topic: str
    ) -> None:
        self._kafka = dict(kafka_config)
        self.events_topic = events_topic
        self.control_topic = control_topic
        self._producer = Producer({**self._kafka, "acks": "all", "enable.idempotence": True})

    def write_event(self, event: Mapping[str, Any], *, timeout_s: float = 10.0) -> None:
        errors: list[KafkaError] = []

        def on_delivery(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                errors.append(err)

        self._producer.produce(
            self.events_topic,
            key=str(event["language"]).encode("utf-8"),
            value=encode_rollout_event(event),
            on_delivery=on_delivery,
        )
        left = self._producer.flush(timeout_s)
        if left or errors:
            why = errors[0] if errors else f"not acknowledged within {timeout_s:g} s"
            raise RuntimeError(f"rollout event not written to {self.events_topic}: {why}")

    def write_shares(self, state: RolloutState, *, updated_by: str) -> None:
        """The state's shares, in force from `SHARE_LEAD_MS` from now (`workers.kafka.arm_control`:
        both arms route a request by the entry in force at its time)."""
        publish_shares(
            self._kafka,
            self.control_topic,
            state.lang,
            state.shares(),
            updated_by=updated_by,
            now_ms=int(time.time() * 1000) + SHARE_LEAD_MS,
        )

    def close(self) -> None:
        self._producer.flush(5.0)
