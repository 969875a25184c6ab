"""Fixtures of the replay tests: the local services (see tests/kafka_fixtures.py)."""

from tests.kafka_fixtures import kafka_bootstrap, redis_url  # noqa: F401
