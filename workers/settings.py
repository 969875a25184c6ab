"""Worker settings: one frozen object, read once at the edge.

`Settings.from_env()` is called by the CLI (or a test builds `Settings(...)` directly); every
lower layer takes the values it needs as arguments. Nothing here reads the environment at import
time. Secrets are kept out of `repr()` so a logged settings object never leaks a password.

Environment variables (all optional):

    TOLK_BOOTSTRAP            Kafka bootstrap servers          127.0.0.1:9092
    TOLK_REDIS_URL            result store                     redis://127.0.0.1:6379/0
    TOLK_GROUP_ID             consumer group of the workers    tolk-workers
    TOLK_ARM                  serve as this A/B arm (workers/arms.py): group
                              <group>.<arm>, replies' model_version "<version>@<arm>"  (none)
    TOLK_LANGUAGES            comma list of target languages   en,de,fr,es,it
    TOLK_MODEL                model name for the engine        gemma3-270m
    TOLK_MAX_TEXT_BYTES       larger texts are REJECTED        100000
    TOLK_METRICS_PORT         Prometheus port: a number (taken: no start), auto (a free
                              one, logged), 0 = off; unset: 9400, else a free one with a
                              warning (workers/ports.py)                              9400
    TOLK_HEALTH_PORT          /readyz and /livez probes (workers/health.py), the same
                              forms as TOLK_METRICS_PORT                              8081
    TOLK_LIVENESS_STALL_S     /livez fails when the engine loop made no progress for this
                              long while requests are in flight                       120
    TOLK_DRAIN_REFRESH_S      consumer lag / time to drain read from the broker every
                              this many seconds (0 = off; workers/kafka/drain.py)           5
    TOLK_WORKER_ID            on every reply                   <hostname>-<pid>
    TOLK_POLICIES             lang:weight:slo[:max_queue[:max_new_tokens]],...  (merged over
                              workers.fairness.policy.DEFAULT_POLICIES)
    TOLK_RESULT_TTL_S         result records in redis live     86400
    TOLK_MAX_IN_FLIGHT        all languages together           1024
    TOLK_TOPIC_PREFIX         prepended to every topic name    "" (tests use a unique one)
    TOLK_DRAIN_TIMEOUT_S      shutdown waits for in-flight     30
    TOLK_MAX_ATTEMPTS         engine runs of a request that fails (ERROR) before it is
                              dead-lettered as "poison"        3
    TOLK_STORE_TIMEOUT_S      redis connect / read timeout of one attempt               0.3
    TOLK_STORE_PATIENCE_S     a redis call that times out is tried again (short back-off)
                              until this long after its first attempt before the circuit
                              breaker counts an outage (0 = never retry; workers/breaker.py) 2
    TOLK_REPLY_ATTEMPTS       deliveries of a reply tried before it is dead-lettered  5
    TOLK_DELIVERY_TIMEOUT_MS  producer message.timeout.ms      30000
    TOLK_CACHE                exact-match translation cache (workers/stages/cache/stage.py); 0 =
    off  1
    TOLK_CACHE_L1_ENTRIES     L1 (in the worker) entries, shared equally by the languages  20000
    TOLK_CACHE_TTL            L2 (redis) TTL tiers, lang:seconds,...,*:seconds   *:86400
    TOLK_CACHE_DIR            what a worker computes once per machine: dequantized weights,
                              compiled graphs, the auto configuration's probe
                              (workers/engine/disk_cache.py)   $XDG_CACHE_HOME/tolk or ~/.cache/tolk
    TOLK_SECURITY_PROTOCOL / TOLK_SASL_MECHANISM / TOLK_SASL_USERNAME / TOLK_SASL_PASSWORD
    TOLK_SSL_CA_LOCATION      CA file that signed the broker certificate (SSL / SASL_SSL)
    TOLK_SSL_ENDPOINT_IDENTIFICATION  0 = do not check the broker's host name (default: check)
    TOLK_REDIS_PASSWORD       folded into the redis URL (`redis://:***@host...`)
    TOLK_SCHEMA_REGISTRY_URL  a Confluent-compatible Schema Registry, e.g.
                              http://127.0.0.1:8085/apis/ccompat/v7 (user:password@ in the URL;
                              TLS checked against TOLK_SSL_CA_LOCATION): `tolk topics create`
                              registers every topic's value schema there (schemas/registry.py)
                                                               (none)
    (`compose/stack.sh` in sasl_ssl mode writes all of these into <state>/secrets/client.env;
    docs/SECURITY.md)
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from workers.arms import validate_arm_name
from workers.cache_ttl import TtlTiers, parse_ttl_tiers
from workers.context_layouts import DEFAULT_LAYOUT, LAYOUTS
from workers.fairness.policy import (
    DEFAULT_BURST_TOKENS,
    DEFAULT_POLICIES,
    LanguagePolicy,
    parse_policies,
)
from workers.ports import parse_port, valid_port_setting
from workers.redaction import mask_url, with_password

__all__ = ["Settings", "default_worker_id"]

DEFAULT_LANGUAGES: tuple[str, ...] = ("en", "de", "fr", "es", "it")


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


_URLS = ("redis_url", "schema_registry_url")  # shown masked by __repr__


def _frozen_policies(policies: Mapping[str, LanguagePolicy]) -> Mapping[str, LanguagePolicy]:
    return MappingProxyType(dict(policies))


@dataclass(frozen=True, slots=True)
class Settings:
    bootstrap: str = "127.0.0.1:9092"  # Kafka bootstrap.servers
    redis_url: str = "redis://127.0.0.1:6379/0"  # result store
    group_id: str = "tolk-workers"  # consumer group shared by all workers
    arm: str | None = None  # the A/B arm this worker serves (None: every request, no suffix)
    languages: tuple[str, ...] = DEFAULT_LANGUAGES  # target languages this worker consumes
    model: str = "gemma3-270m"  # model name the CLI hands to the engine loader
    max_text_bytes: int = 100_000  # UTF-8 size above which a request is REJECTED
    # Prometheus HTTP port and the /readyz, /livez port (workers/ports.py): a number (taken:
    # refuse to start), AUTO_PORT (a free one), None (9400 / 8081, else a free one, warned),
    # 0 (no server)
    metrics_port: int | None = None
    health_port: int | None = None
    liveness_stall_s: float = 120.0  # engine loop silent this long with work: not live
    drain_refresh_s: float = 5.0  # lag / time-to-drain refresh (workers/kafka/drain.py); 0 = off
    worker_id: str = field(default_factory=default_worker_id)  # goes on every reply
    policies: Mapping[str, LanguagePolicy] = field(
        default_factory=lambda: _frozen_policies(DEFAULT_POLICIES)
    )  # per-language weight, SLO, intake high water, output cap
    result_ttl_s: int = 24 * 3600  # how long a result stays in redis for redeliveries
    max_in_flight: int = 1024  # requests in the engine, all languages together
    burst_tokens: int = DEFAULT_BURST_TOKENS  # VTC burst credit of a language back from idle
    topic_prefix: str = ""  # prepended to request and dead-letter topics (tests, tenants)
    low_water_ratio: float = 0.5  # intake resumes a language at floor(high * ratio)
    poll_timeout_s: float = 0.05  # consumer poll; the loop never blocks longer than this
    max_poll_records: int = 500  # records per consume() call
    commit_interval_s: float = 0.5  # commit committable offsets at least this often
    commit_every: int = 200  # ... or after this many completed records
    drain_timeout_s: float = 30.0  # on shutdown, wait this long for in-flight requests
    max_attempts: int = 3  # engine runs of a request whose run fails (ERROR) before "poison"
    store_timeout_s: float = 0.3  # redis connect/read timeout: an outage never stalls the loop
    store_patience_s: float = 2.0  # a timed-out redis call is retried this long (breaker.py)
    session_timeout_ms: int = 45_000  # consumer group session timeout (classic protocol)
    # "classic": client-side cooperative-sticky assignment; "consumer": KIP-848, the broker's
    # `range` assignor, which gives every worker partitions of every language topic (the
    # condition of fair share across workers, workers/serving/group_fairness.py)
    group_protocol: str = "classic"
    tracing: str = "off"  # "otlp": OpenTelemetry spans per request (workers/tracing.py)
    topic_check_ttl_s: float = 30.0  # how long a reply-topic existence check is trusted
    reply_attempts: int = 5  # deliveries of a reply tried (with backoff) before a dead letter
    delivery_timeout_ms: int = 30_000  # producer message.timeout.ms (librdkafka's 300 s: long)
    security_protocol: str = ""  # "" = PLAINTEXT (librdkafka default)
    sasl_mechanism: str = ""
    sasl_username: str = ""
    sasl_password: str = field(default="", repr=False)  # secret: never in repr or logs
    ssl_ca_location: str = ""  # CA certificate file for SSL / SASL_SSL ("" = system CAs)
    ssl_endpoint_identification: bool = True  # verify the broker certificate's host name
    cache_enabled: bool = True  # exact-match translation cache in front of the engine
    cache_l1_entries: int = 20_000  # L1 capacity, all languages together
    cache_ttl: TtlTiers = field(default_factory=lambda: parse_ttl_tiers(""))  # L2 TTL per lang
    context_tokens: int = 256  # `--context`: history token budget per prompt
    # (workers/stages/context/rules.py)
    context_idle_s: float = 600.0  # `--context`: a conversation's history kept this long idle
    context_layout: str = DEFAULT_LAYOUT  # `--context`: the turns shown
    # (workers/stages/context/rules.py)
    cache_dir: str = ""  # TOLK_CACHE_DIR; "" = $XDG_CACHE_HOME/tolk or ~/.cache/tolk
    # a Confluent-compatible Schema Registry (schemas/registry.py), credentials in the URL;
    # "" = none: the built-in schemas and single-object encoding only
    schema_registry_url: str = ""

    def __post_init__(self) -> None:
        if not self.languages:
            raise ValueError("languages must not be empty")
        if self.arm is not None:
            validate_arm_name(self.arm)
        if self.max_text_bytes < 1:
            raise ValueError(f"max_text_bytes must be >= 1, got {self.max_text_bytes!r}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight!r}")
        if self.reply_attempts < 1:
            raise ValueError(f"reply_attempts must be >= 1, got {self.reply_attempts!r}")
        if self.delivery_timeout_ms < 100:
            raise ValueError(f"delivery_timeout_ms must be >= 100: {self.delivery_timeout_ms!r}")
        if self.tracing not in ("off", "otlp"):
            raise ValueError(f"tracing must be off or otlp, got {self.tracing!r}")
        if self.group_protocol not in ("classic", "consumer"):
            raise ValueError(f"group_protocol must be classic or consumer: {self.group_protocol!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts!r}")
        if not self.store_timeout_s > 0:
            raise ValueError(f"store_timeout_s must be > 0, got {self.store_timeout_s!r}")
        if not self.store_patience_s >= 0:
            raise ValueError(f"store_patience_s must be >= 0, got {self.store_patience_s!r}")
        if self.burst_tokens < 0:
            raise ValueError(f"burst_tokens must be >= 0, got {self.burst_tokens!r}")
        if self.cache_l1_entries < 1:
            raise ValueError(f"cache_l1_entries must be >= 1, got {self.cache_l1_entries!r}")
        if self.context_tokens < 0 or not self.context_idle_s > 0:
            bad = f"context_tokens={self.context_tokens!r}, context_idle_s={self.context_idle_s!r}"
            raise ValueError(f"need context_tokens >= 0 and context_idle_s > 0: {bad}")
        if self.context_layout not in LAYOUTS:
            choices = ", ".join(LAYOUTS)
            raise ValueError(f"context_layout must be one of {choices}: {self.context_layout!r}")
        if not valid_port_setting(self.metrics_port):
            raise ValueError(f"metrics_port out of range: {self.metrics_port!r}")
        if not valid_port_setting(self.health_port):
            raise ValueError(f"health_port out of range: {self.health_port!r}")
        if not self.liveness_stall_s > 0:
            raise ValueError(f"liveness_stall_s must be > 0, got {self.liveness_stall_s!r}")
        if self.drain_refresh_s < 0:
            raise ValueError(f"drain_refresh_s must be >= 0, got {self.drain_refresh_s!r}")
        if not isinstance(self.policies, MappingProxyType):
            object.__setattr__(self, "policies", _frozen_policies(self.policies))

    def __repr__(self) -> str:
        # The redis and registry passwords ride in the URLs: shown masked (workers/redaction.py).
        fields = ", ".join(
            f"{name}={mask_url(getattr(self, name)) if name in _URLS else getattr(self, name)!r}"
            for name in self.__dataclass_fields__
            if name != "sasl_password"
        )
        masked = "'***'" if self.sasl_password else "''"
        return f"Settings({fields}, sasl_password={masked})"

    # -- derived ------------------------------------------------------------------------------

    def policy(self, lang: str) -> LanguagePolicy | None:
        return self.policies.get(lang)

    def consumer_group(self) -> str:
        """The request consumer's group: `group_id`, or `<group_id>.<arm>` for an arm (each
        arm reads every request; workers of one arm share its requests)."""
        return self.group_id if self.arm is None else f"{self.group_id}.{self.arm}"

    def kafka_common(self) -> dict[str, Any]:
        """bootstrap + security properties shared by the consumer, producer and admin client."""
        conf: dict[str, Any] = {"bootstrap.servers": self.bootstrap}
        if self.security_protocol:
            conf["security.protocol"] = self.security_protocol
        if self.sasl_mechanism:
            conf["sasl.mechanism"] = self.sasl_mechanism
        if self.sasl_username:
            conf["sasl.username"] = self.sasl_username
        if self.sasl_password:
            conf["sasl.password"] = self.sasl_password
        if self.ssl_ca_location:
            conf["ssl.ca.location"] = self.ssl_ca_location
        if not self.ssl_endpoint_identification:
            conf["ssl.endpoint.identification.algorithm"] = "none"
        return conf

    def kafka_security(self) -> dict[str, Any]:
        """`kafka_common()` without the bootstrap: what a `TranslationClient` takes as
        `kafka_config` to reach the same (secured) broker."""
        return {k: v for k, v in self.kafka_common().items() if k != "bootstrap.servers"}

    def replace(self, **changes: Any) -> Settings:
        """A copy with some fields changed (dataclasses.replace, re-validated)."""
        from dataclasses import replace

        return replace(self, **changes)

    # -- the edge -----------------------------------------------------------------------------

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read `TOLK_*` variables (from `env`, default os.environ); keyword overrides win."""
        e = os.environ if env is None else env

        def get(name: str) -> str | None:
            value = e.get(f"TOLK_{name}")
            return value if value not in (None, "") else None

        kw: dict[str, Any] = {}
        text_fields = {
            "BOOTSTRAP": "bootstrap",
            "REDIS_URL": "redis_url",
            "GROUP_ID": "group_id",
            "ARM": "arm",
            "MODEL": "model",
            "WORKER_ID": "worker_id",
            "TOPIC_PREFIX": "topic_prefix",
            "GROUP_PROTOCOL": "group_protocol",
            "TRACING": "tracing",
            "CONTEXT_LAYOUT": "context_layout",
            "SECURITY_PROTOCOL": "security_protocol",
            "SASL_MECHANISM": "sasl_mechanism",
            "SASL_USERNAME": "sasl_username",
            "SASL_PASSWORD": "sasl_password",
            "SSL_CA_LOCATION": "ssl_ca_location",
            "CACHE_DIR": "cache_dir",
            "SCHEMA_REGISTRY_URL": "schema_registry_url",
        }
        for env_name, attr in text_fields.items():
            value = get(env_name)
            if value is not None:
                kw[attr] = value
        int_fields = {
            "MAX_TEXT_BYTES": "max_text_bytes",
            "RESULT_TTL_S": "result_ttl_s",
            "MAX_IN_FLIGHT": "max_in_flight",
            "BURST_TOKENS": "burst_tokens",
            "MAX_ATTEMPTS": "max_attempts",
            "REPLY_ATTEMPTS": "reply_attempts",
            "DELIVERY_TIMEOUT_MS": "delivery_timeout_ms",
            "CONTEXT_TOKENS": "context_tokens",
        }
        for env_name, attr in int_fields.items():
            value = get(env_name)
            if value is not None:
                try:
                    kw[attr] = int(value)
                except ValueError:
                    raise ValueError(f"TOLK_{env_name}={value!r} is not an integer") from None
        for env_name, attr in (("METRICS_PORT", "metrics_port"), ("HEALTH_PORT", "health_port")):
            value = get(env_name)
            if value is not None:
                kw[attr] = parse_port(value, f"TOLK_{env_name}")
        store_timeout = get("STORE_TIMEOUT_S")
        if store_timeout is not None:
            try:
                kw["store_timeout_s"] = float(store_timeout)
            except ValueError:
                bad = f"TOLK_STORE_TIMEOUT_S={store_timeout!r} is not a number"
                raise ValueError(bad) from None
        for env_name, attr in (
            ("LIVENESS_STALL_S", "liveness_stall_s"),
            ("DRAIN_REFRESH_S", "drain_refresh_s"),
            ("CONTEXT_IDLE_S", "context_idle_s"),
            ("STORE_PATIENCE_S", "store_patience_s"),
        ):
            value = get(env_name)
            if value is not None:
                try:
                    kw[attr] = float(value)
                except ValueError:
                    raise ValueError(f"TOLK_{env_name}={value!r} is not a number") from None
        drain = get("DRAIN_TIMEOUT_S")
        if drain is not None:
            try:
                kw["drain_timeout_s"] = float(drain)
            except ValueError:
                raise ValueError(f"TOLK_DRAIN_TIMEOUT_S={drain!r} is not a number") from None
        cache = get("CACHE")
        if cache is not None:
            kw["cache_enabled"] = cache.lower() not in ("0", "false", "no", "off")
        l1_entries = get("CACHE_L1_ENTRIES")
        if l1_entries is not None:
            try:
                kw["cache_l1_entries"] = int(l1_entries)
            except ValueError:
                bad = f"TOLK_CACHE_L1_ENTRIES={l1_entries!r} is not an integer"
                raise ValueError(bad) from None
        ttl_spec = get("CACHE_TTL")
        if ttl_spec is not None:
            kw["cache_ttl"] = parse_ttl_tiers(ttl_spec)
        verify = get("SSL_ENDPOINT_IDENTIFICATION")
        if verify is not None:
            kw["ssl_endpoint_identification"] = verify.lower() not in ("0", "false", "no", "none")
        redis_password = get("REDIS_PASSWORD")
        if redis_password is not None:
            default_url = cls.__dataclass_fields__["redis_url"].default
            kw["redis_url"] = with_password(kw.get("redis_url", default_url), redis_password)
        langs = get("LANGUAGES")
        if langs is not None:
            kw["languages"] = parse_languages(langs)
        spec = get("POLICIES")
        if spec is not None:
            kw["policies"] = {**DEFAULT_POLICIES, **parse_policies(spec)}
        kw.update(overrides)
        return cls(**kw)


def parse_languages(text: str) -> tuple[str, ...]:
    """`"de, fr,,es"` -> ("de", "fr", "es"), lower-cased, duplicates dropped, order kept."""
    out: list[str] = []
    for part in text.split(","):
        lang = part.strip().lower()
        if lang and lang not in out:
            out.append(lang)
    if not out:
        raise ValueError(f"no language in {text!r}")
    return tuple(out)
