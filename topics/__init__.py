"""Every Kafka topic tolk uses (``topics.catalog``) and their creation (``topics.admin``).

``topics.admin`` imports confluent_kafka; import it explicitly where topics are created.
"""

from topics.catalog import (
    ARM_CONTROL,
    DEAD_LETTERS,
    REPLIES,
    REQUEST_TOPIC_PREFIX,
    TopicSpec,
    arm_control_topic,
    catalog,
    dead_letters_topic,
    language_of,
    replies_topic,
    request_topic,
)

__all__ = [
    "ARM_CONTROL",
    "DEAD_LETTERS",
    "REPLIES",
    "REQUEST_TOPIC_PREFIX",
    "TopicSpec",
    "arm_control_topic",
    "catalog",
    "dead_letters_topic",
    "language_of",
    "replies_topic",
    "request_topic",
]
