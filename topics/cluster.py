"""What every Kafka client of tolk shares: the start-up check that the cluster answers, and the
produce errors no retry fixes.

The worker (workers/kafka/), the bots' client (workers/client/), the replay job and the CLI all
connect with the same settings and must fail the same way, so this lives below all of them
(it imports nothing of tolk).

librdkafka does not fail on a misconfigured connection: it retries forever and logs, and a
plaintext client talking to a TLS listener sees nothing but "1/1 brokers are down".
`check_broker` is the start-up check the client and `tolk worker` run first: one metadata
request with the same configuration, and on failure a `KafkaConnectionError` that names the
cause from librdkafka's error callbacks (authentication, TLS handshake) or, when there is none,
from a TLS probe of the port (a listener that answers a TLS handshake while the client speaks
plaintext). Its messages name the settings to change and never contain a password.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException

__all__ = [
    "MISSING_TOPIC_CODES",
    "PERMANENT_PRODUCE_CODES",
    "TOO_LARGE_CODES",
    "KafkaConnectionError",
    "check_broker",
    "speaks_tls",
]

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
