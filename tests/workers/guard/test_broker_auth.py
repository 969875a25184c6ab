"""The guard's faust consumer gets the deployment's Kafka security (workers/guard/broker_auth.py).

The translation from librdkafka properties (what `Settings.kafka_common()` gives every other
client) to faust's `broker_credentials`, and the refusals; the guard on the real SASL_SSL stack
is in tests/compose/test_stack_security.py.
"""

from __future__ import annotations

import certifi
import faust
import pytest

from workers.guard.broker_auth import GuardSecurityError, faust_credentials
from workers.settings import Settings

SECURED = {
    "TOLK_BOOTSTRAP": "127.0.0.1:29092",
    "TOLK_SECURITY_PROTOCOL": "SASL_SSL",
    "TOLK_SASL_MECHANISM": "SCRAM-SHA-512",
    "TOLK_SASL_USERNAME": "tolk",
    "TOLK_SASL_PASSWORD": "s3cret-pw",
    "TOLK_SSL_CA_LOCATION": certifi.where(),
}


def test_plaintext_needs_no_credentials() -> None:
    assert faust_credentials(Settings().kafka_common()) is None


def test_the_secured_stacks_settings_become_sasl_ssl_scram_credentials() -> None:
    creds = faust_credentials(Settings.from_env(SECURED).kafka_common())
    assert isinstance(creds, faust.SASLCredentials)
    assert creds.protocol.value == "SASL_SSL"
    assert creds.mechanism.value == "SCRAM-SHA-512"
    assert (creds.username, creds.password) == ("tolk", "s3cret-pw")
    assert creds.ssl_context is not None and creds.ssl_context.check_hostname
    assert "s3cret-pw" not in repr(creds)
    # what faust hands aiokafka
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    auth = credentials_to_aiokafka_auth(creds)
    assert auth["security_protocol"] == "SASL_SSL" and auth["sasl_mechanism"] == "SCRAM-SHA-512"


def test_host_name_check_off_and_the_other_protocols() -> None:
    env = {**SECURED, "TOLK_SSL_ENDPOINT_IDENTIFICATION": "0"}
    creds = faust_credentials(Settings.from_env(env).kafka_common())
    assert creds.ssl_context.check_hostname is False
    plain_sasl = {**SECURED, "TOLK_SECURITY_PROTOCOL": "SASL_PLAINTEXT"}
    creds = faust_credentials(Settings.from_env(plain_sasl).kafka_common())
    assert creds.protocol.value == "SASL_PLAINTEXT" and creds.ssl_context is None
    tls_only = {"TOLK_SECURITY_PROTOCOL": "SSL", "TOLK_SSL_CA_LOCATION": certifi.where()}
    creds = faust_credentials(Settings.from_env(tls_only).kafka_common())
    assert isinstance(creds, faust.SSLCredentials) and creds.protocol.value == "SSL"


def test_what_faust_cannot_take_is_refused_by_name() -> None:
    for conf, named in (
        ({"security.protocol": "SASL_SSL", "sasl.mechanism": "GSSAPI"}, "GSSAPI"),
        ({"security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER"}, "OAUTHBEARER"),
        ({"security.protocol": "KERBEROS"}, "KERBEROS"),
        ({"security.protocol": "SSL", "ssl.certificate.location": "/x.pem"}, "ssl.certificate"),
    ):
        with pytest.raises(GuardSecurityError, match=named):
            faust_credentials(conf)


def test_tolk_guard_refuses_to_start_on_settings_faust_cannot_take() -> None:
    from typer.testing import CliRunner

    from workers.cli import app

    env = {**SECURED, "TOLK_SASL_MECHANISM": "GSSAPI"}
    out = CliRunner().invoke(app, ["guard", "--metrics-port", "0"], env=env)
    assert out.exit_code == 2, out.output
    assert "sasl.mechanism 'GSSAPI'" in out.output and "TOLK_SASL_MECHANISM" in out.output
