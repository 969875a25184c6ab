"""Every Kafka topic tolk uses, declared in one place.

Requests go to one topic per *target* language, ``tolk.requests.<lang>``: the worker's
per-language fair share pauses and resumes whole topics, and the partition count caps how
many workers share one language. Results go to the request's ``reply_topic``, normally
``tolk.replies``. Records the worker cannot handle go, byte for byte, to
``tolk.dead-letters``. Keys are UTF-8 strings (the conversation id, else the request id),
so one conversation stays on one partition and in order.

``tolk.control.arms`` holds the arms' shares per language (``ArmShares``, keyed by the
language or ``"*"``; ``workers.arms``, ``workers.kafka.arm_control``). It is compacted, so it keeps
the latest entry per key forever and a worker reads the whole table from the beginning at
start; one partition keeps every change in one order.

``tolk.rollout.events`` holds the canary rollouts' history (``RolloutEvent``, keyed by the
language; ``workers.guard``): operator starts, promotions and aborts and the guard's decision on
every judged window. One partition, kept 30 days; the guard folds it into each language's
rollout state at start.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from schemas.codec import ARM_SHARES, DEAD_LETTER, REQUEST, RESULT, ROLLOUT_EVENT

REQUEST_TOPIC_PREFIX = "tolk.requests."
REPLIES = "tolk.replies"
DEAD_LETTERS = "tolk.dead-letters"
ARM_CONTROL = "tolk.control.arms"  # compacted: the latest ArmShares per language
ROLLOUT_EVENTS = "tolk.rollout.events"  # the canary guard's RolloutEvents (workers/guard)

_DAY_MS = 24 * 60 * 60 * 1000
REQUEST_RETENTION_MS = 7 * _DAY_MS  # long enough to replay a week for A/B comparisons
REPLY_RETENTION_MS = 1 * _DAY_MS  # clients read replies within seconds
DEAD_LETTER_RETENTION_MS = 30 * _DAY_MS  # kept for a person to look at

# A language code as it appears in a topic name: lowercase letters, digits, '-' or '_'
# (e.g. "de", "pt-br", "zh_hant"); Kafka allows [a-zA-Z0-9._-] and '.' is our separator.
_LANG_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


@dataclass(frozen=True)
class TopicSpec:
    """One topic as tolk expects it."""

    name: str
    partitions: int
    config: Mapping[str, str] = field(default_factory=dict)  # topic-level configs
    value_schema: str = ""  # full Avro name of the value schema (schemas/*.avsc)
    key_schema: str = "string"  # keys are UTF-8 strings
    replication_factor: int = -1  # -1: the broker's default.replication.factor

    def __post_init__(self) -> None:
        if self.partitions < 1:
            raise ValueError(f"{self.name}: partitions must be >= 1, not {self.partitions}")


def request_topic(lang: str, prefix: str = "") -> str:
    """``"de"`` -> ``"tolk.requests.de"``; ``prefix`` (tests, tenants) goes in front."""
    if not _LANG_RE.match(lang):
        raise ValueError(
            f"invalid language code for a topic name: {lang!r} "
            "(lowercase letters, digits, '-' or '_', at most 32)"
        )
    return prefix + REQUEST_TOPIC_PREFIX + lang


def replies_topic(prefix: str = "") -> str:
    return prefix + REPLIES


def dead_letters_topic(prefix: str = "") -> str:
    return prefix + DEAD_LETTERS


def arm_control_topic(prefix: str = "") -> str:
    return prefix + ARM_CONTROL


def rollout_events_topic(prefix: str = "") -> str:
    return prefix + ROLLOUT_EVENTS


def language_of(topic: str, prefix: str = "") -> str | None:
    """``"tolk.requests.de"`` -> ``"de"``; None for topics that are not request topics."""
    head = prefix + REQUEST_TOPIC_PREFIX
    if not topic.startswith(head):
        return None
    lang = topic[len(head) :]
    return lang if _LANG_RE.match(lang) else None


def catalog(languages: Sequence[str], partitions: int = 3, *, prefix: str = "") -> list[TopicSpec]:
    """Every topic for a deployment serving ``languages`` (target languages), in a stable
    order: the request topics (as given, duplicates dropped), the replies, the dead letters,
    the arms' control topic, the rollout events.
    ``prefix`` goes in front of every name (``Settings.topic_prefix``: tests, tenants)."""
    if isinstance(languages, str):
        raise TypeError("languages must be a sequence of codes, not one string")
    specs: list[TopicSpec] = []
    for lang in dict.fromkeys(languages):
        specs.append(
            TopicSpec(
                name=request_topic(lang, prefix),
                partitions=partitions,
                config={"retention.ms": str(REQUEST_RETENTION_MS), "cleanup.policy": "delete"},
                value_schema=REQUEST,
            )
        )
    specs.append(
        TopicSpec(
            name=replies_topic(prefix),
            partitions=partitions,
            config={"retention.ms": str(REPLY_RETENTION_MS), "cleanup.policy": "delete"},
            value_schema=RESULT,
        )
    )
    specs.append(
        TopicSpec(
            name=dead_letters_topic(prefix),
            partitions=1,
            config={"retention.ms": str(DEAD_LETTER_RETENTION_MS), "cleanup.policy": "delete"},
            value_schema=DEAD_LETTER,
        )
    )
    specs.append(
        TopicSpec(
            name=arm_control_topic(prefix),
            partitions=1,
            # compacted: the latest entry per language lives forever; tombstones go after a day
            config={"cleanup.policy": "compact", "delete.retention.ms": str(_DAY_MS)},
            value_schema=ARM_SHARES,
        )
    )
    specs.append(
        TopicSpec(
            # one partition: a rollout's history in one order, read whole by the guard and
            # `tolk rollout status`; the guard's changelog and repartition topics are faust's
            name=rollout_events_topic(prefix),
            partitions=1,
            config={"retention.ms": str(DEAD_LETTER_RETENTION_MS), "cleanup.policy": "delete"},
            value_schema=ROLLOUT_EVENT,
        )
    )
    return specs
