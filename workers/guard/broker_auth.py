"""The guard's faust app on a secured broker: the deployment's librdkafka settings, for aiokafka.

The guard has two kinds of Kafka clients. Its own topics (rollout events, the control topic,
the watermarks) go through confluent-kafka with `Settings.kafka_common()`, the same
properties as the worker's (docs/SECURITY.md). The faust app that reads the reply topic goes
through aiokafka, which takes no librdkafka properties: faust's `broker_credentials` (a
`faust.SASLCredentials` / `faust.SSLCredentials`) and an `ssl.SSLContext`. It used to get
none, so it spoke plaintext, and on the SASL_SSL stack (`TOLK_KAFKA_SECURITY=sasl_ssl`) the
guard never read a reply. `faust_credentials` translates:

| librdkafka (`TOLK_*`) | faust / aiokafka |
|---|---|
| `security.protocol` PLAINTEXT or unset | no credentials |
| SSL | `SSLCredentials(context)` |
| SASL_PLAINTEXT | `SASLCredentials(username, password, mechanism)` |
| SASL_SSL | the same with `ssl_context=context` |
| `sasl.mechanism` PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 | `mechanism` (faust's `SASLMechanism`) |
| `ssl.ca.location` | the context's CA file (unset: the system's CAs) |
| `ssl.endpoint.identification.algorithm=none` | `check_hostname = False` |

Anything it cannot carry over (another protocol or mechanism, GSSAPI and OAUTHBEARER, which
need more than a password, or a librdkafka `ssl.*` / `sasl.*` property beyond those above)
raises `GuardSecurityError` naming it, and `tolk guard` refuses to start (exit 2) rather than
run a guard that cannot read.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Any

__all__ = ["GuardSecurityError", "faust_credentials"]

MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
CARRIED = {  # the librdkafka properties faust_credentials translates
    "bootstrap.servers",
    "security.protocol",
    "sasl.mechanism",
    "sasl.username",
    "sasl.password",
    "ssl.ca.location",
    "ssl.endpoint.identification.algorithm",
}


class GuardSecurityError(ValueError):
    """The deployment's Kafka security settings have no faust (aiokafka) equivalent here."""


def _ssl_context(conf: Mapping[str, Any]) -> ssl.SSLContext:
    context = ssl.create_default_context(
        ssl.Purpose.SERVER_AUTH, cafile=conf.get("ssl.ca.location") or None
    )
    if str(conf.get("ssl.endpoint.identification.algorithm", "https")).lower() == "none":
        context.check_hostname = False  # TOLK_SSL_ENDPOINT_IDENTIFICATION=0 (docs/SECURITY.md)
    return context


def faust_credentials(conf: Mapping[str, Any]) -> Any:
    """faust `broker_credentials` for the librdkafka properties `conf` (module notes): None
    for plaintext, else a `faust.SSLCredentials` / `faust.SASLCredentials`."""
    import faust

    others = sorted(k for k in conf if k not in CARRIED and k.startswith(("ssl.", "sasl.")))
    if others:
        raise GuardSecurityError(
            f"tolk guard cannot pass {', '.join(others)} to its faust (aiokafka) consumer: "
            "use security.protocol, sasl.mechanism/username/password and ssl.ca.location"
        )
    protocol = str(conf.get("security.protocol") or "PLAINTEXT").upper()
    if protocol == "PLAINTEXT":
        return None
    if protocol == "SSL":
        return faust.SSLCredentials(_ssl_context(conf))
    if protocol not in ("SASL_SSL", "SASL_PLAINTEXT"):
        raise GuardSecurityError(f"tolk guard: unknown security.protocol {protocol!r}")
    mechanism = str(conf.get("sasl.mechanism") or "PLAIN").upper()
    if mechanism not in MECHANISMS:
        raise GuardSecurityError(
            f"tolk guard: sasl.mechanism {mechanism!r} is not supported by its faust (aiokafka) "
            f"consumer with a password (one of {', '.join(MECHANISMS)}; TOLK_SASL_MECHANISM)"
        )
    return faust.SASLCredentials(
        username=conf.get("sasl.username"),
        password=conf.get("sasl.password"),
        ssl_context=_ssl_context(conf) if protocol == "SASL_SSL" else None,
        mechanism=mechanism,
    )
