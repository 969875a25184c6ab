"""The example bots of examples/ end to end (issue #45): each produces a request with its
platform's Schema Registry serializer (Node.js: `@kafkajs/confluent-schema-registry`; Java:
Apicurio's Avro serde), a real worker (SmolLM2-135M on the local stack's Kafka) answers it, and
the bot decodes the reply with the same library and matches its `request_id`. Schema evolution:
a newer bot registers a request schema with an optional field and is answered too; a breaking
schema is refused by the registry with its reason.

The topics and subjects are a test's own (a unique prefix), registered as `tolk topics create`
does (topics/subjects.py). The bots are built on first use (`npm ci`, `mvn package`; CI builds
them in .ci/run)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from schemas.codec import REQUEST, builtin_schemas
from schemas.registry import SchemaRegistry
from tests.kafka_fixtures import kafka_bootstrap, redis_url  # noqa: F401
from tests.registry_fixtures import schema_registry_url  # noqa: F401
from topics.admin import ensure_topics
from topics.catalog import catalog
from topics.subjects import register_subjects
from workers.fairness.policy import LanguagePolicy
from workers.settings import Settings
from workers.worker import Worker

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.redis, pytest.mark.registry]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NODE_BOT = EXAMPLES / "node-bot"
JAVA_BOT = EXAMPLES / "java-bot"
LANGS = ("de",)
BOT_TIMEOUT_MS = 90_000


@dataclasses.dataclass(frozen=True)
class Stack:
    bootstrap: str
    registry_url: str
    prefix: str

    def env(self) -> dict[str, str]:
        return os.environ | {
            "TOLK_BOOTSTRAP": self.bootstrap,
            "TOLK_SCHEMA_REGISTRY_URL": self.registry_url,
            # the same registry's own API, for Apicurio's serde
            "TOLK_APICURIO_URL": self.registry_url.replace("/apis/ccompat/v7", "/apis/registry/v2"),
            "TOLK_TOPIC_PREFIX": self.prefix,
            "BOT_TIMEOUT_MS": str(BOT_TIMEOUT_MS),
        }


@pytest.fixture(scope="module")
def stack(
    smollm2: Any,
    kafka_bootstrap: str,  # noqa: F811
    redis_url: str,  # noqa: F811
    schema_registry_url: str,  # noqa: F811
) -> Iterator[Stack]:
    """A worker on SmolLM2 serving a prefix of its own, its topics made and its subjects
    registered as `tolk topics create --registry` does."""
    from workers.engine.engine import EngineConfig
    from workers.serving.fair_engine import build_fair_engine
    from workers.serving.pipeline import ServingOptions, build_served_engine

    prefix = f"tb{uuid.uuid4().hex[:10]}."
    specs = [dataclasses.replace(s, name=prefix + s.name, partitions=1) for s in catalog(LANGS)]
    register_subjects(SchemaRegistry(schema_registry_url), specs)
    ensure_topics(kafka_bootstrap, specs, timeout=30)
    policies = {lang: LanguagePolicy(1.0, 20.0, 64, 32) for lang in LANGS}
    settings = Settings(
        bootstrap=kafka_bootstrap, redis_url=redis_url, languages=LANGS, topic_prefix=prefix,
        group_id=f"tolk-bots-{uuid.uuid4().hex[:8]}", metrics_port=0, worker_id="w-bots",
        policies=policies, schema_registry_url=schema_registry_url, drain_timeout_s=5.0,
    )  # fmt: skip
    # a small KV pool: this test shares the machine with the suite's other models
    config = EngineConfig(max_new_tokens=32, kv_cache_tokens=2048)
    fair = build_fair_engine(smollm2, policies, config=config)
    served = build_served_engine(fair, ServingOptions.of(settings, faithful=False))
    worker = Worker(settings, served, registry=CollectorRegistry())
    thread = worker.run_in_thread()
    try:
        assert worker.assigned_event.wait(60), "the worker got no partitions"
        yield Stack(kafka_bootstrap, schema_registry_url, prefix)
    finally:
        worker.stop()
        thread.join(30)


def _run(
    cmd: list[str], cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _node_bot() -> list[str]:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed (the Node.js bot needs Node 18+)")
    if not (NODE_BOT / "node_modules").is_dir():
        done = _run(["npm", "ci", "--no-audit", "--no-fund"], NODE_BOT, dict(os.environ), 600)
        assert done.returncode == 0, done.stderr[-2000:]
    return [node, "bot.js"]


def _java_bot() -> list[str]:
    if not (JAVA_BOT / "target" / "lib").is_dir():
        done = _run(["mvn", "-q", "-B", "package"], JAVA_BOT, dict(os.environ), 900)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return ["java", "-Xmx128m", "-cp", "target/classes:target/lib/*", "dev.tolk.bot.Bot"]


def _reply(done: subprocess.CompletedProcess) -> dict[str, Any]:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_node_bot_is_answered_through_the_registry(stack: Stack) -> None:
    done = _run([*_node_bot(), "Where is my order?", "de", "en"], NODE_BOT, stack.env(), 180)
    reply = _reply(done)
    assert reply["status"] == "OK" and reply["text"].strip()
    subject = f"{stack.prefix}tolk.requests.de-value"
    registered = SchemaRegistry(stack.registry_url).lookup(subject, builtin_schemas()[REQUEST])
    assert reply["schema_id"] == registered


def test_the_java_bot_is_answered_through_the_registry(stack: Stack) -> None:
    done = _run([*_java_bot(), "Where is my order?", "de", "en"], JAVA_BOT, stack.env(), 300)
    reply = _reply(done)
    assert reply["status"] == "OK" and reply["text"].strip()


def test_a_newer_bots_schema_is_answered_and_a_breaking_one_refused(stack: Stack) -> None:
    newer = _run([*_node_bot(), "Thank you!", "de", "en"], NODE_BOT,
                 stack.env() | {"BOT_SCHEMA": "v2"}, 180)  # fmt: skip
    reply = _reply(newer)
    assert reply["status"] == "OK"
    registry = SchemaRegistry(stack.registry_url)
    subject = f"{stack.prefix}tolk.requests.de-value"
    assert registry.schema_by_id(reply["schema_id"])["fields"][-1]["name"] == "channel"
    # an older bot (the schema `tolk topics create` registered, version 1) is still answered
    older = _reply(_run([*_node_bot(), "Hello", "de", "en"], NODE_BOT,
                        stack.env() | {"BOT_SCHEMA": "v1"}, 180))  # fmt: skip
    assert older["status"] == "OK" and older["schema_id"] != reply["schema_id"]
    breaking = _run([*_node_bot(), "Hello", "de", "en"], NODE_BOT,
                    stack.env() | {"BOT_SCHEMA": "breaking"}, 180)  # fmt: skip
    assert breaking.returncode == 3, breaking.stdout + breaking.stderr
    assert "refused" in breaking.stderr
    assert subject in registry.subjects()
