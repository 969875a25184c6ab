import pytest

from schemas.codec import ARM_SHARES, DEAD_LETTER, REQUEST, RESULT, builtin_schemas
from topics.catalog import (
    ARM_CONTROL,
    DEAD_LETTERS,
    REPLIES,
    TopicSpec,
    catalog,
    language_of,
    request_topic,
)


def test_request_topic_names():
    assert request_topic("de") == "tolk.requests.de"
    assert request_topic("pt-br") == "tolk.requests.pt-br"
    assert language_of("tolk.requests.de") == "de"
    assert language_of(REPLIES) is None
    assert language_of("tolk.requests.") is None


@pytest.mark.parametrize("bad", ["", "DE", "de.x", "de/x", "a b", "x" * 33])
def test_request_topic_rejects_bad_codes(bad):
    with pytest.raises(ValueError):
        request_topic(bad)


def test_catalog_declares_every_topic_in_order():
    specs = catalog(["de", "fr", "de"], partitions=6)
    assert [s.name for s in specs] == [
        "tolk.requests.de",
        "tolk.requests.fr",
        REPLIES,
        DEAD_LETTERS,
        ARM_CONTROL,
        "tolk.rollout.events",
    ]
    by_name = {s.name: s for s in specs}
    assert by_name["tolk.requests.de"].partitions == 6
    assert by_name[REPLIES].partitions == 6
    assert by_name[DEAD_LETTERS].partitions == 1
    assert by_name["tolk.requests.fr"].value_schema == REQUEST
    assert by_name[REPLIES].value_schema == RESULT
    assert by_name[DEAD_LETTERS].value_schema == DEAD_LETTER


def test_retention():
    specs = {s.name: s for s in catalog(["de"])}
    week_ms = 7 * 24 * 3600 * 1000
    assert specs["tolk.requests.de"].config["retention.ms"] == str(week_ms)
    assert int(specs[DEAD_LETTERS].config["retention.ms"]) > week_ms
    # Topic configs go to the AdminClient as strings.
    for spec in specs.values():
        assert all(isinstance(v, str) for v in spec.config.values())


def test_every_value_schema_exists():
    for spec in catalog(["de", "uk"]):
        assert spec.value_schema in builtin_schemas()


def test_spec_is_frozen_and_validated():
    spec = catalog(["de"])[0]
    with pytest.raises(AttributeError):
        spec.partitions = 9  # type: ignore[misc]
    with pytest.raises(ValueError):
        TopicSpec("x", 0)
    with pytest.raises(TypeError):
        catalog("de")


def test_prefix_goes_in_front_of_every_name():
    names = [s.name for s in catalog(["de"], prefix="t-123.")]
    assert names == [
        "t-123.tolk.requests.de",
        "t-123.tolk.replies",
        "t-123.tolk.dead-letters",
        "t-123.tolk.control.arms",
        "t-123.tolk.rollout.events",
    ]
    assert request_topic("fr", "x.") == "x.tolk.requests.fr"
    assert language_of("x.tolk.requests.fr", "x.") == "fr"
    assert language_of("x.tolk.requests.fr") is None


def test_arm_control_topic_is_compacted_with_one_partition():
    spec = {s.name: s for s in catalog(["de"], partitions=6)}[ARM_CONTROL]
    assert ARM_CONTROL == "tolk.control.arms"
    assert spec.partitions == 1  # one order for every change, whatever the request topics have
    assert spec.config["cleanup.policy"] == "compact"  # the latest entry per language stays
    assert "retention.ms" not in spec.config
    assert spec.value_schema == ARM_SHARES


def test_rollout_events_topic_keeps_one_order_for_a_month():
    spec = {s.name: s for s in catalog(["de"], partitions=6)}["tolk.rollout.events"]
    assert spec.partitions == 1  # a rollout's history in one order
    assert spec.value_schema == "tolk.RolloutEvent"
    assert spec.config["retention.ms"] == str(30 * 24 * 3600 * 1000)
