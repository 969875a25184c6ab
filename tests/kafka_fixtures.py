"""Fixtures for tests that need the local services (``bash compose/stack.sh up``).

Import them into a conftest.py (the repository root must be on sys.path, as it is under
``python -m pytest``)::

    from tests.kafka_fixtures import kafka_bootstrap, redis_url  # noqa: F401

and mark the tests ``@pytest.mark.kafka`` / ``@pytest.mark.redis``. Without a service the
tests are skipped; with ``TOLK_REQUIRE_SERVICES=1`` (CI) they fail instead. The addresses
default to the stack's and can be moved with ``TOLK_KAFKA_BOOTSTRAP`` and ``TOLK_REDIS_URL``.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from typing import NoReturn

import pytest

DEFAULT_KAFKA_BOOTSTRAP = "127.0.0.1:9092"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def services_required() -> bool:
    return os.environ.get("TOLK_REQUIRE_SERVICES", "") not in ("", "0", "false", "no")


def unique_name(prefix: str) -> str:
    """A topic / group / key name no other test (or earlier run) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def _unavailable(what: str, why: str) -> NoReturn:
    message = f"{what} is not available ({why}); start it with `bash compose/stack.sh up`"
    if services_required():
        pytest.fail(f"{message} [TOLK_REQUIRE_SERVICES is set]", pytrace=False)
    pytest.skip(message)


def _tcp_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """``host:port`` of a Kafka broker that answers a metadata request."""
    bootstrap = os.environ.get("TOLK_KAFKA_BOOTSTRAP", DEFAULT_KAFKA_BOOTSTRAP)
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    if not _tcp_open(host or "127.0.0.1", int(port)):
        _unavailable("Kafka", f"nothing listens on {bootstrap}")
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    try:
        metadata = admin.list_topics(timeout=10)
    except KafkaException as exc:
        _unavailable("Kafka", f"{bootstrap} did not answer a metadata request: {exc}")
    else:
        if not metadata.brokers:
            _unavailable("Kafka", f"{bootstrap} reported no brokers")
    yield bootstrap


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a redis-server that answers PING (db 0; tests must use unique keys)."""
    url = os.environ.get("TOLK_REDIS_URL", DEFAULT_REDIS_URL)
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        _unavailable("redis", f"{url}: {exc}")
    finally:
        client.close()
    yield url
