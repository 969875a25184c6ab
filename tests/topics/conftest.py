from tests.kafka_fixtures import kafka_bootstrap, redis_url  # noqa: F401
