"""The worker's Kafka client settings and its check that a reply topic exists.

The consumer stores and commits offsets itself (never auto), so an offset moves only once the
record's reply is delivered (both `enable.auto.commit` and `enable.auto.offset.store` off: with
either on, librdkafka could commit a record whose reply was never produced). The producer is
idempotent with `acks=all`, and must not create a reply topic by asking for its metadata: a
request naming a topic that does not exist is dead-lettered instead.

Security (TLS, SASL) comes from `Settings.kafka_common()`. librdkafka does not fail on a
misconfigured connection: it retries forever and logs, and a plaintext client talking to a TLS
listener sees nothing but "1/1 brokers are down". `check_broker` is the start-up check the
client and `tolk worker` run first: one metadata request with the same configuration, and on
failure a `KafkaConnectionError` that names the cause from librdkafka's error callbacks
(authentication, TLS handshake) or, when there is none, from a TLS probe of the port (a
listener that answers a TLS handshake while the client speaks plaintext). Its messages name
the settings to change and never contain a password.
"""

from __future__ import annotations

import logging
import re
import socket
import ssl
import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from workers.settings import Settings

__all__ = [
    "MISSING_TOPIC_CODES",
    "PERMANENT_PRODUCE_CODES",
    "TOO_LARGE_CODES",
    "KafkaConnectionError",
    "ReplyTopicChecker",
    "check_broker",
    "consumer_config",
    "is_fatal",
    "producer_config",
]

log = logging.getLogger(__name__)

TOPIC_NAME_RE = re.compile(r"^[a-zA-Z0-9._-]{1,249}$")

# Errors that mean "no such topic (for us)": a reply there can never be delivered.
MISSING_TOPIC_CODES = frozenset(
    {
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_TOPIC,
        KafkaError._UNKNOWN_PARTITION,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.TOPIC_EXCEPTION,
    }
)
TOO_LARGE_CODES = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})
# Produce errors that no retry can fix (a worker's reply becomes a dead letter, a client's
# request fails at once): no such topic for us, too large, invalid, not authorized.
PERMANENT_PRODUCE_CODES = (
    MISSING_TOPIC_CODES
    | TOO_LARGE_CODES
    | frozenset(
        {
            KafkaError.INVALID_RECORD,
            KafkaError.CLUSTER_AUTHORIZATION_FAILED,
            KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
            KafkaError._INVALID_ARG,
        }
    )
)


def is_fatal(err: KafkaError) -> bool:
    """True when the client that reported `err` cannot go on (it must be closed and the process
    restarted). A consumer reports a fatal error as an error event whose code is `_FATAL` and
    whose own `fatal()` flag is not set (librdkafka keeps the underlying error apart, e.g.
    KIP-848's "instance ID is still used by another member"), so both are checked."""
    return bool(err.fatal()) or err.code() == KafkaError._FATAL


def consumer_config(settings: Settings) -> dict[str, Any]:
    """The worker's consumer. Both group protocols rebalance incrementally (the worker's
    callbacks take and give back single partitions). Classic: cooperative-sticky, which
    balances the number of partitions per worker but may give one worker every partition of
    a language. KIP-848 (`group_protocol="consumer"`): the broker assigns with `range`, topic by
    topic, so with at least as many partitions per language as workers each worker holds
    every language; its session timeout is the broker's (`group.consumer.session.timeout.ms`)."""
    if settings.group_protocol == "consumer":
        group: dict[str, Any] = {"group.protocol": "consumer", "group.remote.assignor": "range"}
    else:
        group = {
            "partition.assignment.strategy": "cooperative-sticky",
            "session.timeout.ms": settings.session_timeout_ms,
        }
    return {
        **settings.kafka_common(),
        "group.id": settings.consumer_group(),  # <group>.<arm> for an arm's worker
        "client.id": settings.worker_id,
        **group,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "logger": logging.getLogger("tolk.kafka.consumer"),
    }


def producer_config(settings: Settings) -> dict[str, Any]:
    return {
        **settings.kafka_common(),
        "client.id": settings.worker_id,
        "enable.idempotence": True,
        "acks": "all",
        # A reply goes out at once: librdkafka's default waits 5 ms to batch, which was 5 ms of
        # every reply's latency (bench/serving.py stages at 1 req/s: "outside" 8-10 -> 4 ms).
        # Under load replies still batch: those queued while a produce is in flight go together.
        "linger.ms": 0,
        # librdkafka retries a produce until this runs out, then reports it failed; the
        # ReplyPublisher retries from there with backoff (300 s default: too long to notice).
        "message.timeout.ms": settings.delivery_timeout_ms,
        # A reply topic that does not exist must fail, not be created by a metadata request.
        "allow.auto.create.topics": False,
        "logger": logging.getLogger("tolk.kafka.producer"),
    }


class ReplyTopicChecker:
    """Says whether a reply topic exists; each answer is trusted for `ttl_s` (a metadata round
    trip on the poll thread, so once per topic, not once per record)."""

    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._checks: dict[str, tuple[str | None, float]] = {}  # topic -> (problem, when)

    def forget(self, topic: str) -> None:
        """Drop a cached answer (a delivery to the topic failed: ask the broker again)."""
        self._checks.pop(topic, None)

    def problem(self, producer: Any, topic: str) -> str | None:
        """None when `topic` exists; else why no reply can go there."""
        if not TOPIC_NAME_RE.match(topic):
            return f"reply_topic {topic!r} is not a valid Kafka topic name"
        now = time.monotonic()
        cached = self._checks.get(topic)
        if cached is not None and now - cached[1] < self.ttl_s:
            return cached[0]
        problem: str | None
        try:
            md = producer.list_topics(topic=topic, timeout=5.0)
            info = md.topics.get(topic)
            if info is None:
                problem = f"reply_topic {topic!r} does not exist"
            elif info.error is not None and info.error.code() in MISSING_TOPIC_CODES:
                problem = f"reply_topic {topic!r} does not exist ({info.error.str()})"
            else:
                problem = None  # exists (maybe still electing a leader: the producer waits)
        except KafkaException as exc:
            log.warning("metadata check of %r failed (assuming it exists): %s", topic, exc)
            return None
        if len(self._checks) > self.max_entries:
            self._checks.clear()
        self._checks[topic] = (problem, now)
        return problem


# ---------------------------------------------------------------------- start-up check


class KafkaConnectionError(RuntimeError):
    """The broker could not be reached with the configured security settings."""


# librdkafka properties that are no use to the check's admin client (callbacks, consumer or
# producer options it would warn about).
_CHECK_DROPS = ("logger", "error_cb", "stats_cb", "throttle_cb", "on_delivery", "debug")
_SECURITY_HINT = (
    "set TOLK_SECURITY_PROTOCOL (SASL_SSL for compose/stack.sh's secure mode) with "
    "TOLK_SSL_CA_LOCATION and TOLK_SASL_MECHANISM / TOLK_SASL_USERNAME / TOLK_SASL_PASSWORD, "
    "or the same properties in TranslationClient(kafka_config=...)"
)


def _first_broker(bootstrap: str) -> tuple[str, int] | None:
    host, _, port = bootstrap.split(",")[0].strip().rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    return (host, int(port)) if port.isdigit() else None


def speaks_tls(host: str, port: int, timeout_s: float = 3.0) -> bool:
    """Whether the listener at host:port completes a TLS handshake (certificate not checked:
    this only asks which protocol the port speaks)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return True
    except (OSError, ssl.SSLError):
        return False


def check_broker(conf: Mapping[str, Any], timeout_s: float = 10.0) -> None:
    """One metadata request with `conf` (bootstrap + security properties); returns when the
    broker answers, else raises `KafkaConnectionError` saying why in words."""
    from confluent_kafka.admin import AdminClient

    bootstrap = str(conf.get("bootstrap.servers", ""))
    protocol = str(conf.get("security.protocol") or "PLAINTEXT").upper()
    errors: list[KafkaError] = []
    admin_conf = {k: v for k, v in conf.items() if k not in _CHECK_DROPS}
    # librdkafka's own log lines would repeat what the error callback reports (and this check
    # turns into one message): keep them quiet here.
    admin_conf |= {"error_cb": errors.append, "log_level": 0}
    admin = AdminClient(admin_conf)
    try:
        if admin.list_topics(timeout=timeout_s).brokers:
            return
        failure = "no broker in the metadata"
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        failure = err.str() if isinstance(err, KafkaError) else str(exc)
    finally:
        admin.poll(0.2)  # serves the error callbacks queued meanwhile
    raise KafkaConnectionError(_explain(bootstrap, protocol, conf, errors, failure))


def _explain(
    bootstrap: str,
    protocol: str,
    conf: Mapping[str, Any],
    errors: list[KafkaError],
    failure: str,
) -> str:
    where = f"Kafka at {bootstrap} (security.protocol={protocol})"
    by_code = {e.code(): e.str() for e in errors}
    auth = by_code.get(KafkaError._AUTHENTICATION)
    if auth is not None:
        user = conf.get("sasl.username", "")
        mechanism = conf.get("sasl.mechanism", "")
        return (
            f"{where}: SASL authentication failed for user {user!r} ({mechanism}); check "
            f"TOLK_SASL_USERNAME / TOLK_SASL_PASSWORD. The broker said: {auth}"
        )
    tls_error = by_code.get(KafkaError._SSL)
    broker = _first_broker(bootstrap)
    if tls_error is not None:
        if broker is not None and not speaks_tls(*broker):
            return (
                f"{where}: the listener does not speak TLS (a plaintext port?); use the "
                f"security protocol the broker's listener has. librdkafka: {tls_error}"
            )
        return (
            f"{where}: the TLS handshake failed; TOLK_SSL_CA_LOCATION must name the CA that "
            f"signed the broker certificate (compose/stack.sh: <state>/tls/ca.crt). "
            f"librdkafka: {tls_error}"
        )
    if "SSL" not in protocol and broker is not None and speaks_tls(*broker):
        return (
            f"{where}: the broker's listener expects TLS (it answered a TLS handshake) but this "
            f"client speaks {protocol}: a security protocol mismatch; {_SECURITY_HINT}"
        )
    seen = "; ".join(sorted(set(by_code.values()))) or failure
    return f"{where}: no broker answered a metadata request: {seen}"
