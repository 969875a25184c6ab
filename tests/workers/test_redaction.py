"""Secrets out of reprs and messages (workers/redaction.py), the security settings
(workers/settings.py) and the broker check's verdicts that need no broker (workers/kafka/config.py).
The secured broker itself is exercised in tests/compose/test_stack_security.py."""

from __future__ import annotations

import socket
import time

import pytest

from topics.cluster import KafkaConnectionError, check_broker
from workers.redaction import mask_url, redact, with_password
from workers.settings import Settings
from workers.store.results import RedisResultStore

SECRET = "s3cr3t-Pa55"


@pytest.mark.parametrize(
    "url, shown",
    [
        (f"redis://:{SECRET}@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        (f"redis://tolk:{SECRET}@cache.internal/2", "redis://tolk:***@cache.internal/2"),
        (f"rediss://:{SECRET}@[::1]:6380/0", "rediss://:***@[::1]:6380/0"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),  # nothing to hide
        ("redis://tolk@127.0.0.1/0", "redis://tolk@127.0.0.1/0"),  # a user, no password
    ],
)
def test_mask_url_hides_only_the_password(url: str, shown: str) -> None:
    assert mask_url(url) == shown


def test_with_password_percent_encodes_and_keeps_the_user() -> None:
    url = with_password("redis://tolk@127.0.0.1:6379/0", "a/b@c")
    assert url == "redis://tolk:a%2Fb%40c@127.0.0.1:6379/0"
    assert mask_url(url) == "redis://tolk:***@127.0.0.1:6379/0"
    assert with_password("redis://:old@h:1/0", "new") == "redis://:new@h:1/0"
    with pytest.raises(ValueError, match="not a URL with a host"):
        with_password("not-a-url", "x")


def test_redact_replaces_plain_and_encoded_forms() -> None:
    text = f"failed: redis://:{SECRET}@h/0 and a%2Fb%40c and {SECRET}"
    out = redact(text, [SECRET, "a/b@c", ""])
    assert SECRET not in out and "a%2Fb%40c" not in out
    assert out.count("***") == 3


def test_settings_fold_the_redis_password_and_mask_both_secrets() -> None:
    env = {
        "TOLK_REDIS_URL": "redis://127.0.0.1:26379/0",
        "TOLK_REDIS_PASSWORD": SECRET,
        "TOLK_SECURITY_PROTOCOL": "SASL_SSL",
        "TOLK_SASL_MECHANISM": "SCRAM-SHA-512",
        "TOLK_SASL_USERNAME": "tolk",
        "TOLK_SASL_PASSWORD": SECRET + "-kafka",
        "TOLK_SSL_CA_LOCATION": "state/tls/ca.crt",
        "TOLK_SSL_ENDPOINT_IDENTIFICATION": "0",
    }
    settings = Settings.from_env(env)
    assert settings.redis_url == f"redis://:{SECRET}@127.0.0.1:26379/0"
    shown = repr(settings)
    assert SECRET not in shown
    assert "redis_url='redis://:***@127.0.0.1:26379/0'" in shown
    assert "sasl_password='***'" in shown
    security = settings.kafka_security()
    assert security == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "tolk",
        "sasl.password": SECRET + "-kafka",
        "ssl.ca.location": "state/tls/ca.crt",
        "ssl.endpoint.identification.algorithm": "none",
    }
    assert settings.kafka_common() == {"bootstrap.servers": settings.bootstrap, **security}


def test_default_settings_add_no_security_properties() -> None:
    settings = Settings.from_env({})
    assert settings.kafka_common() == {"bootstrap.servers": "127.0.0.1:9092"}
    assert settings.ssl_endpoint_identification is True
    # A password alone goes into the default URL.
    with_pw = Settings.from_env({"TOLK_REDIS_PASSWORD": SECRET})
    assert with_pw.redis_url == f"redis://:{SECRET}@127.0.0.1:6379/0"


def test_the_result_store_repr_masks_its_url() -> None:
    store = RedisResultStore(f"redis://:{SECRET}@127.0.0.1:1/0", ttl_s=60)  # never connects
    try:
        assert repr(store) == "RedisResultStore(url='redis://:***@127.0.0.1:1/0', ttl_s=60)"
    finally:
        store.close()


def test_check_broker_says_nothing_answers_on_a_closed_port() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(KafkaConnectionError) as info:
        check_broker({"bootstrap.servers": f"127.0.0.1:{port}"}, timeout_s=1.0)
    assert time.monotonic() - started < 5
    message = str(info.value)
    assert f"Kafka at 127.0.0.1:{port} (security.protocol=PLAINTEXT)" in message
    assert "no broker answered a metadata request" in message
    assert "Connection refused" in message
