"""What the worker's settings say about its replies: `ReplyConfig`, read once at the edge
(`ReplyConfig.from_settings`) and handed to `workers/kafka/reply_publisher.py`'s
`ReplyPublisher`.

Besides the dead-letter topic, the worker id, the SLOs and the delivery attempts, it holds the
worker's codec (`worker_codec`): the built-in one, or with `TOLK_SCHEMA_REGISTRY_URL` one that
resolves the registry ids of requests bots wrote with a registry serializer and writes a reply
to such a request with the id its reply topic's subject holds (`ReplyPublisher.wire_value`;
`schemas/registry.py`, issue #45). The registry is asked with a 2 s timeout: the poll loop waits
on a first lookup.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from schemas.codec import AvroCodec, default_codec
from schemas.registry import SchemaRegistry
from topics.catalog import DEAD_LETTERS
from workers.fairness.policy import LanguagePolicy
from workers.settings import Settings

__all__ = ["DEFAULT_REPLY_ATTEMPTS", "REGISTRY_TIMEOUT_S", "ReplyConfig", "worker_codec"]

DEFAULT_REPLY_ATTEMPTS = 5  # deliveries of a reply tried before it becomes a dead letter
REGISTRY_TIMEOUT_S = 2.0  # one registry call of the worker (its poll loop waits on it)


def worker_codec(settings: Settings) -> AvroCodec:
    """The built-in codec, or one asking the registry of `settings` for the ids it lacks."""
    if not settings.schema_registry_url:
        return default_codec()
    registry = SchemaRegistry.from_url(
        settings.schema_registry_url,
        ca_file=settings.ssl_ca_location or None,
        timeout_s=REGISTRY_TIMEOUT_S,
    )
    return AvroCodec(ids_from=registry)


@dataclass(frozen=True, slots=True)
class ReplyConfig:
    """What the worker's settings say about its replies (`from_settings`)."""

    dead_letter_topic: str
    worker_id: str
    policies: Mapping[str, LanguagePolicy] = field(default_factory=dict)  # SLO of OK replies
    reply_attempts: int = DEFAULT_REPLY_ATTEMPTS  # deliveries tried before a dead letter
    plain_model_version: str = ""  # of replies without the engine: "" or "@<arm>"
    # the worker's codec: with TOLK_SCHEMA_REGISTRY_URL it resolves the registry's ids of the
    # requests bots wrote, and a reply to such a request carries the id of its reply topic's
    # subject (`wire_value`); else the built-in one
    codec: AvroCodec = field(default_factory=default_codec)

    @classmethod
    def from_settings(cls, settings: Settings, plain_model_version: str = "") -> ReplyConfig:
        return cls(
            dead_letter_topic=settings.topic_prefix + DEAD_LETTERS,
            worker_id=settings.worker_id,
            policies=settings.policies,
            reply_attempts=settings.reply_attempts,
            plain_model_version=plain_model_version,
            codec=worker_codec(settings),
        )
