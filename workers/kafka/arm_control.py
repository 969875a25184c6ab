"""The arms' shares in Kafka: the share sources a worker takes, the control topic's writer.

`tolk.control.arms` (topics/catalog.py) is compacted and keyed by the language (or `"*"`, the
default entry); each value is an Avro `ArmShares` (schemas/arm_shares.avsc), and a tombstone
(null value) removes the language's entry. A later canary controller moves shares by writing
here; so does `tolk arms set de A=30 B=70` (`publish_shares`).

`ArmControlReader` (one per arm worker, `workers/kafka/arm_reader.py`) reads the topic into the
share table the worker routes by: from the beginning, caught up before the worker subscribes,
then followed by a daemon thread (its notes have the rules).

`ArmControlReader.table_at(ts_ms)` routes a record by the entries in force at its timestamp:
each entry takes effect at its `updated_at` (a tombstone at its record time), so two arms that
read the same request at different moments around a share change still route it alike
(exactly one answers), as long as the entry reaches them before requests stamped after it do.
A canary controller writes its entries a little ahead (`workers.guard`: 2 s) for that reason.

`ShareSource` is what an arm worker takes (the reader, or `StaticShares`, the same interface
over a fixed table, for tests and embedding). `read_share_table` / `read_entries_since` read
the topic to its end once (`tolk arms show`, the canary guard's restart).
"""

from __future__ import annotations

import getpass
import logging
import socket
import time
from collections.abc import Mapping
from typing import Any, Protocol

from confluent_kafka import KafkaError, Producer

from schemas.codec import encode_arm_shares
from topics.catalog import request_topic
from workers.arms import DEFAULT_LANGUAGE, ShareTable, validate_shares
from workers.kafka.arm_reader import ArmControlReader

__all__ = [
    "ArmControlError",
    "ShareSource",
    "StaticShares",
    "default_updated_by",
    "publish_shares",
    "read_entries_since",
    "read_share_table",
    "validate_language_key",
]

log = logging.getLogger(__name__)


class ArmControlError(RuntimeError):
    """The control topic could not be written (or read for `tolk arms show`)."""


class ShareSource(Protocol):
    """Where an arm worker gets its share table from."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def table(self) -> ShareTable: ...


class StaticShares:
    """A fixed share table (tests, embedding); `set()` swaps it."""

    def __init__(self, table: ShareTable | None = None) -> None:
        self._table = table if table is not None else ShareTable()

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def table(self) -> ShareTable:
        return self._table

    def set(self, table: ShareTable) -> None:
        self._table = table


def validate_language_key(language: str) -> str:
    """`language` if it can key the control topic: `"*"` or a request topic's language code."""
    if language != DEFAULT_LANGUAGE:
        request_topic(language)  # ValueError for a code no request topic can have
    return language


def default_updated_by() -> str:
    """`user@host`: who wrote an entry, when the caller does not say."""
    try:
        user = getpass.getuser()
    except Exception:  # no login name in some containers
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


# -- writing ----------------------------------------------------------------------------------


def publish_shares(
    kafka_config: Mapping[str, Any],
    topic: str,
    language: str,
    shares: Mapping[str, float] | None,
    *,
    updated_by: str | None = None,
    timeout_s: float = 10.0,
    now_ms: int | None = None,
) -> None:
    """Write `language`'s shares (validated), or a tombstone when `shares` is None, and wait
    for the broker's acknowledgement; ArmControlError when it is not delivered."""
    validate_language_key(language)
    value: bytes | None = None
    if shares is not None:
        value = encode_arm_shares(
            {
                "language": language,
                "shares": validate_shares(shares),
                "updated_at": now_ms if now_ms is not None else int(time.time() * 1000),
                "updated_by": updated_by or default_updated_by(),
            }
        )
    producer = Producer({**kafka_config, "acks": "all", "enable.idempotence": True})
    errors: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            errors.append(err)

    producer.produce(topic, key=language.encode("utf-8"), value=value, on_delivery=on_delivery)
    left = producer.flush(timeout_s)
    if left or errors:
        why = errors[0] if errors else f"not acknowledged within {timeout_s:g} s"
        raise ArmControlError(f"shares for {language!r} not written to {topic}: {why}")


def read_entries_since(
    kafka_config: Mapping[str, Any], topic: str, *, timeout_s: float = 10.0
) -> dict[str, tuple[int, dict[str, float] | None]]:
    """`ArmControlReader.entries_since` of the topic read to its end once."""
    reader = ArmControlReader(kafka_config, topic, catch_up_timeout_s=timeout_s)
    try:
        if not reader.read_to_end():
            raise ArmControlError(f"control topic {topic} is not available")
        if not reader.caught_up:
            raise ArmControlError(f"control topic {topic} not read to its end")
        return reader.entries_since()
    finally:
        reader.stop()


def read_share_table(
    kafka_config: Mapping[str, Any], topic: str, *, timeout_s: float = 10.0
) -> ShareTable:
    """The table as it stands now (the topic read to its end once): `tolk arms show`."""
    reader = ArmControlReader(kafka_config, topic, catch_up_timeout_s=timeout_s)
    try:
        if not reader.read_to_end():
            raise ArmControlError(f"control topic {topic} is not available")
        return reader.table()
    finally:
        reader.stop()
