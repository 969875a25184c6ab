"""Every Kafka topic tolk uses (``topics.catalog``) and their creation (``topics.admin``).

``topics.admin`` imports confluent_kafka; import it explicitly where topics are created.
"""

from topics.catalog import (
    DEAD_LETTERS,
    REPLIES,
    REQUEST_TOPIC_PREFIX,
    TopicSpec,
    catalog,
    dead_letters_topic,
    language_of,
    replies_topic,
    request_topic,
)

__all__ = [
    "DEAD_LETTERS",
    "REPLIES",
    "REQUEST_TOPIC_PREFIX",
    "TopicSpec",
    "catalog",
    "dead_letters_topic",
    "language_of",
    "replies_topic",
    "request_topic",
]
