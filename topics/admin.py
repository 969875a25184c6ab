"""Create tolk's topics and check the ones that exist, with confluent-kafka's AdminClient.

``ensure_topics`` never alters an existing topic: adding partitions to a keyed topic moves
keys between partitions (and conversations out of order), so a partition-count mismatch is
reported for a person to decide.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from topics.catalog import TopicSpec

CREATED = "created"
EXISTS = "exists"
MISMATCH_PREFIX = "partition-mismatch"


class TopicAdminError(RuntimeError):
    """A topic could not be created or checked."""


def ensure_topics(
    bootstrap: str,
    specs: Iterable[TopicSpec],
    *,
    timeout: float = 30.0,
    client_config: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Create the missing topics of ``specs`` and check the existing ones.

    Returns, per topic name: ``"created"``, ``"exists"``, or
    ``"partition-mismatch: has N partitions, declared M"`` (left as it is). Raises
    ``TopicAdminError`` when the broker cannot be reached or a creation fails for another
    reason than the topic already existing. Waits until created topics have a leader for
    every partition, so producing right after returns does not race the metadata.
    """
    specs = list(specs)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate topic names in specs: {names}")
    admin = AdminClient({"bootstrap.servers": bootstrap, **(client_config or {})})
    existing = _partition_counts(admin, timeout)

    outcome: dict[str, str] = {}
    to_create = [s for s in specs if s.name not in existing]
    if to_create:
        futures = admin.create_topics(
            [
                NewTopic(
                    s.name,
                    num_partitions=s.partitions,
                    replication_factor=s.replication_factor,
                    config=dict(s.config),
                )
                for s in to_create
            ],
            operation_timeout=timeout,
            request_timeout=timeout,
        )
        errors: list[str] = []
        raced: list[str] = []
        for name, future in futures.items():
            try:
                future.result()
                outcome[name] = CREATED
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    raced.append(name)  # created by someone else meanwhile: check it below
                else:
                    errors.append(f"{name}: {exc}")
        if errors:
            raise TopicAdminError("could not create topics: " + "; ".join(errors))
        created = [n for n, o in outcome.items() if o == CREATED]
        current = _wait_for_leaders(admin, created + raced, timeout)
        existing.update(current)

    for spec in specs:
        if outcome.get(spec.name) == CREATED:
            continue
        has = existing.get(spec.name)
        if has is None:
            raise TopicAdminError(f"{spec.name}: reported as existing but has no metadata")
        if has != spec.partitions:
            outcome[spec.name] = (
                f"{MISMATCH_PREFIX}: has {has} partitions, declared {spec.partitions}"
            )
        else:
            outcome[spec.name] = EXISTS
    return {name: outcome[name] for name in names}


def _partition_counts(admin: AdminClient, timeout: float) -> dict[str, int]:
    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        raise TopicAdminError(f"cannot list topics: {exc}") from exc
    return {
        name: len(topic.partitions)
        for name, topic in metadata.topics.items()
        if topic.error is None
    }


def _wait_for_leaders(admin: AdminClient, names: list[str], timeout: float) -> dict[str, int]:
    """Poll metadata until every partition of ``names`` has a leader; their counts."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            metadata = admin.list_topics(timeout=max(1.0, deadline - time.monotonic()))
        except KafkaException as exc:
            raise TopicAdminError(f"cannot list topics: {exc}") from exc
        counts: dict[str, int] = {}
        pending = []
        for name in names:
            topic = metadata.topics.get(name)
            if (
                topic is None
                or topic.error is not None
                or not topic.partitions
                or any(p.leader < 0 for p in topic.partitions.values())
            ):
                pending.append(name)
            else:
                counts[name] = len(topic.partitions)
        if not pending:
            return counts
        if time.monotonic() >= deadline:
            raise TopicAdminError(f"topics without a leader after {timeout}s: {pending}")
        time.sleep(0.1)
