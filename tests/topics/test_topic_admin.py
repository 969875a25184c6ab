"""ensure_topics against the real local broker (bash compose/stack.sh up)."""

from collections.abc import Iterator

import pytest

from tests.kafka_fixtures import unique_name
from topics.admin import CREATED, EXISTS, MISMATCH_PREFIX, TopicAdminError, ensure_topics
from topics.catalog import TopicSpec

pytestmark = pytest.mark.kafka


@pytest.fixture
def topic_names(kafka_bootstrap: str) -> Iterator[list[str]]:
    """Unique names; whatever a test created under them is deleted afterwards."""
    names: list[str] = []
    yield names
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    existing = admin.list_topics(timeout=10).topics
    doomed = [n for n in names if n in existing]
    if doomed:
        for future in admin.delete_topics(doomed, operation_timeout=30).values():
            future.result()


def _describe(bootstrap: str, name: str) -> tuple[int, dict[str, str]]:
    from confluent_kafka.admin import AdminClient, ConfigResource

    admin = AdminClient({"bootstrap.servers": bootstrap})
    partitions = len(admin.list_topics(topic=name, timeout=10).topics[name].partitions)
    resource = ConfigResource(ConfigResource.Type.TOPIC, name)
    configs = admin.describe_configs([resource])[resource].result(timeout=10)
    return partitions, {k: v.value for k, v in configs.items()}


def test_creates_then_reports_existing(kafka_bootstrap, topic_names):
    req, dlq = unique_name("test.requests"), unique_name("test.dead")
    topic_names += [req, dlq]
    specs = [
        TopicSpec(req, 3, {"retention.ms": "604800000"}, "tolk.TranslationRequest"),
        TopicSpec(dlq, 1, {"retention.ms": "2592000000"}, "tolk.DeadLetter"),
    ]

    assert ensure_topics(kafka_bootstrap, specs) == {req: CREATED, dlq: CREATED}

    partitions, config = _describe(kafka_bootstrap, req)
    assert partitions == 3
    assert config["retention.ms"] == "604800000"
    assert _describe(kafka_bootstrap, dlq)[0] == 1

    # Idempotent: a second run creates nothing.
    assert ensure_topics(kafka_bootstrap, specs) == {req: EXISTS, dlq: EXISTS}


def test_reports_partition_mismatch_without_altering(kafka_bootstrap, topic_names):
    name = unique_name("test.mismatch")
    topic_names.append(name)
    assert ensure_topics(kafka_bootstrap, [TopicSpec(name, 2)]) == {name: CREATED}

    outcome = ensure_topics(kafka_bootstrap, [TopicSpec(name, 4)])

    assert outcome[name].startswith(MISMATCH_PREFIX)
    assert "has 2" in outcome[name] and "declared 4" in outcome[name]
    assert _describe(kafka_bootstrap, name)[0] == 2  # left as it was


def test_created_topic_takes_records_at_once(kafka_bootstrap, topic_names):
    from confluent_kafka import Producer

    name = unique_name("test.produce")
    topic_names.append(name)
    ensure_topics(kafka_bootstrap, [TopicSpec(name, 3)])

    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    delivered = []
    producer.produce(name, b"v", key=b"k", on_delivery=lambda err, msg: delivered.append(err))
    producer.flush(10)
    assert delivered == [None]


def test_invalid_config_raises(kafka_bootstrap, topic_names):
    name = unique_name("test.invalid")
    topic_names.append(name)
    with pytest.raises(TopicAdminError, match=name):
        ensure_topics(kafka_bootstrap, [TopicSpec(name, 1, {"cleanup.policy": "nonsense"})])


def test_unreachable_broker_raises():
    with pytest.raises(TopicAdminError):
        ensure_topics("127.0.0.1:1", [TopicSpec("tolk.never", 1)], timeout=2)
