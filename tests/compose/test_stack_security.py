"""The secured local stack: Kafka on SASL_SSL (SCRAM-SHA-512) and redis with a password.

One PRIVATE stack for the module (`compose/stack.sh up` with TOLK_KAFKA_SECURITY=sasl_ssl, its
own TOLK_STATE_DIR under pytest's tmp dir and free ports probed from 29092 / 29093 / 26379; the
shared broker on 9092 and redis on 6379 are never touched), stopped at the end. Against it:

* a worker (fake engine) and a TranslationClient configured from the credentials file the
  script wrote (`Settings.from_env` over it) translate over SASL_SSL, storing the reply in the
  password-protected redis;
* neither password appears anywhere a user could read it: the whole DEBUG log of the run
  (Python logging and the file descriptors librdkafka writes to), the worker's /metrics page,
  the replies, the reprs of the settings and the store, the stack script's own output;
* a plaintext client, and a client with a wrong password, fail at start with a message that
  names the cause (a security protocol mismatch; SASL authentication), as does `tolk worker`;
* `status` works in this mode without the variables (the mode is recorded in the state dir);
* `tolk guard` reads the replies over SASL_SSL (its faust consumer gets the same settings as
  the worker's clients) without a password in its log, and fails fast on a plaintext
  configuration as `tolk worker` does;
* the Schema Registry of this mode (TOLK_REGISTRY=1, issue #45) serves HTTPS only, with the
  stack's certificate, and asks for the client user's login: refused without it or with a
  wrong password (401), plain HTTP not answered; the credentials file's
  TOLK_SCHEMA_REGISTRY_URL registers every subject as `tolk topics create` does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tests.kafka_fixtures import services_required
from tests.workers.fakes import FakeEngine, fake_translation
from workers.client import TranslationClient, TranslationError
from workers.settings import Settings
from workers.store.results import RedisResultStore, result_key
from workers.worker import Worker

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.redis]

REPO = Path(__file__).resolve().parents[2]
STACK_SCRIPT = REPO / "compose" / "stack.sh"
STACK_UP_TIMEOUT_S = 900  # a first run gathers the jars with mvn (from ~/.m2 when cached)


def free_port(start: int, taken: set[int]) -> int:
    """The first loopback port from `start` that nothing listens on and no one else took."""
    for port in range(start, start + 500):
        if port in taken:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise RuntimeError(f"no free port in {start}..{start + 499}")


def read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


@dataclass(frozen=True)
class SecureStack:
    env: dict[str, str]  # the environment the script ran with (state dir, ports, mode)
    state_dir: Path
    kafka_port: int
    redis_port: int
    registry_port: int
    credentials_file: Path  # secrets/client.env, as printed by 'up'
    ca_file: Path  # as printed by 'up'
    up_output: str  # what 'up' printed

    @property
    def credentials(self) -> dict[str, str]:
        return read_env_file(self.credentials_file)

    def secrets(self) -> list[str]:
        c = self.credentials
        registry_password = urllib.parse.urlsplit(c["TOLK_SCHEMA_REGISTRY_URL"]).password
        assert registry_password
        return [c["TOLK_SASL_PASSWORD"], c["TOLK_REDIS_PASSWORD"], registry_password]

    def stack(self, command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(STACK_SCRIPT), command],
            env=env or self.env,
            capture_output=True,
            text=True,
            timeout=STACK_UP_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )


def _unavailable(why: str) -> None:
    message = f"the secured stack cannot run here: {why}"
    if services_required():
        pytest.fail(f"{message} [TOLK_REQUIRE_SERVICES is set]", pytrace=False)
    pytest.skip(message)


def _printed_path(output: str, marker: str) -> Path:
    line = next(line for line in output.splitlines() if marker in line)
    return Path(line.split(marker, 1)[1].split()[0])


@pytest.fixture(scope="module")
def secure_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureStack]:
    for tool in ("java", "openssl", "redis-server"):
        if shutil.which(tool) is None:
            _unavailable(f"{tool} is not installed")
    taken: set[int] = set()
    kafka_port = free_port(29092, taken)
    controller_port = free_port(29093, taken)
    redis_port = free_port(26379, taken)
    registry_port = free_port(28085, taken)
    state_dir = tmp_path_factory.mktemp("secure-stack") / "state"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TOLK_")},
        "TOLK_STATE_DIR": str(state_dir),
        "TOLK_KAFKA_PORT": str(kafka_port),
        "TOLK_KAFKA_CONTROLLER_PORT": str(controller_port),
        "TOLK_REDIS_PORT": str(redis_port),
        "TOLK_KAFKA_SECURITY": "sasl_ssl",
        "TOLK_REGISTRY": "1",  # its secured build: HTTPS and basic auth
        "TOLK_REGISTRY_PORT": str(registry_port),
        "TOLK_PYTHON": sys.executable,
    }
    probe = subprocess.run(
        ["bash", str(STACK_SCRIPT), "up"],
        env=env,
        capture_output=True,
        text=True,
        timeout=STACK_UP_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    output = probe.stdout + probe.stderr
    stack = None
    try:
        if probe.returncode != 0:
            _unavailable(f"compose/stack.sh up exited {probe.returncode}:\n{output[-3000:]}")
        stack = SecureStack(
            env=env,
            state_dir=state_dir,
            kafka_port=kafka_port,
            redis_port=redis_port,
            registry_port=registry_port,
            credentials_file=_printed_path(output, "client credentials (0600): "),
            ca_file=_printed_path(output, "CA certificate: "),
            up_output=output,
        )
        yield stack
    finally:
        down = subprocess.run(["bash", str(STACK_SCRIPT), "down"], env=env, capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)  # fmt: skip
        assert down.returncode == 0, down.stderr


def secured_settings(stack: SecureStack, **overrides: object) -> Settings:
    """Settings read from the credentials file, as `tolk worker` would after sourcing it."""
    return Settings.from_env(env=stack.credentials, **overrides)


# ---------------------------------------------------------------------- the script


def test_up_prints_the_ca_and_a_private_credentials_file(secure_stack: SecureStack) -> None:
    stack = secure_stack
    assert stack.ca_file.is_file() and stack.ca_file.read_text().startswith("-----BEGIN")
    assert stat.S_IMODE(stack.credentials_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(stack.credentials_file.parent.stat().st_mode) == 0o700
    creds = stack.credentials
    assert creds["TOLK_BOOTSTRAP"] == f"127.0.0.1:{stack.kafka_port}"
    assert creds["TOLK_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert creds["TOLK_SASL_MECHANISM"] == "SCRAM-SHA-512"
    assert creds["TOLK_SSL_CA_LOCATION"] == str(stack.ca_file)
    assert len(creds["TOLK_SASL_PASSWORD"]) >= 32 and len(creds["TOLK_REDIS_PASSWORD"]) >= 32
    for secret in stack.secrets():
        assert secret not in stack.up_output
    # The broker's config holds the keystore and inter-broker passwords: owner only.
    server_properties = stack.state_dir / "kafka" / "server.properties"
    assert stat.S_IMODE(server_properties.stat().st_mode) == 0o600
    assert "listeners=SASL_SSL://127.0.0.1:" in server_properties.read_text()


def test_status_works_in_the_secured_mode_without_the_variables(secure_stack: SecureStack):
    env = {k: v for k, v in secure_stack.env.items() if k != "TOLK_KAFKA_SECURITY"}
    status = secure_stack.stack("status", env)
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"on 127.0.0.1:{secure_stack.kafka_port}" in status.stdout
    assert "(SASL_SSL SCRAM-SHA-512, CA " in status.stdout
    assert "(password required)" in status.stdout
    for secret in secure_stack.secrets():
        assert secret not in status.stdout + status.stderr


def test_redis_refuses_commands_without_the_password(secure_stack: SecureStack) -> None:
    import redis

    anonymous = redis.Redis(host="127.0.0.1", port=secure_stack.redis_port)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()
    settings = secured_settings(secure_stack)
    password = secure_stack.credentials["TOLK_REDIS_PASSWORD"]
    assert settings.redis_url == f"redis://:{password}@127.0.0.1:{secure_stack.redis_port}/0"
    store = RedisResultStore(settings.redis_url, ttl_s=60)
    try:
        assert store.ping()
        assert password not in repr(store) and ":***@" in repr(store)
    finally:
        store.close()


# ---------------------------------------------------------------------- a full run


def test_worker_and_client_over_sasl_ssl_leak_no_secret(
    secure_stack: SecureStack, capfd: pytest.CaptureFixture[str]
) -> None:
    stack = secure_stack
    metrics_port = free_port(29400, set())
    prefix = f"sec{uuid.uuid4().hex[:8]}."
    settings = secured_settings(
        stack,
        languages=("de",),
        topic_prefix=prefix,
        group_id=f"tolk-sec-{uuid.uuid4().hex[:8]}",
        metrics_port=metrics_port,
        worker_id="w-secure",
    )
    lines: list[str] = []
    handler = _ListHandler(lines)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        replies, metrics_text = _run_worker_and_client(settings, prefix, metrics_port)
        logging.getLogger("tolk.test").info("settings: %r", settings)  # what the CLI logs
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    out, err = capfd.readouterr()  # librdkafka writes to the file descriptors directly

    ok, rejected = replies
    assert ok.ok and ok.text == fake_translation("good morning everyone", "de")
    assert ok.worker_id == "w-secure"
    assert rejected.status == "REJECTED"
    # The reply went through the password-protected redis.
    store = RedisResultStore(settings.redis_url, ttl_s=60)
    try:
        assert store.get(ok.request_id) is not None
        store._client.delete(result_key(ok.request_id))
    finally:
        store.close()

    log_text = "\n".join(lines)
    assert "w-secure" in log_text and "redis://:***@127.0.0.1" in log_text  # captured, masked
    assert "tolk_worker_requests_total" in metrics_text  # the real /metrics page
    everything = {
        "log": log_text,
        "stdout/stderr": out + err,
        "metrics": metrics_text,
        "replies": repr(replies),
        "settings repr": repr(settings),
    }
    for secret in stack.secrets():
        leaks = [where for where, text in everything.items() if secret in text]
        assert not leaks, f"a password appears in: {leaks}"


class _ListHandler(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.lines = lines
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def _run_worker_and_client(settings: Settings, prefix: str, metrics_port: int):
    import dataclasses

    from topics.admin import ensure_topics
    from topics.catalog import catalog

    specs = [dataclasses.replace(s, name=prefix + s.name, partitions=1) for s in catalog(["de"])]
    ensure_topics(settings.bootstrap, specs, timeout=30, client_config=settings.kafka_common())
    worker = Worker(settings, FakeEngine(languages=("de",)), registry=CollectorRegistry())
    thread = worker.run_in_thread()
    try:
        assert worker.assigned_event.wait(60), "the worker got no assignment over SASL_SSL"

        async def talk():
            async with TranslationClient(
                settings.bootstrap, topic_prefix=prefix, kafka_config=settings.kafka_security()
            ) as client:
                ok = await client.translate("good morning everyone", to="de", deadline=20)
                rejected = await client.translate("", to="de", raise_on_error=False)
                return ok, rejected

        replies = asyncio.run(talk())
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            metrics_text = r.read().decode()
    finally:
        worker.stop()
        thread.join(30)
    return replies, metrics_text


# ---------------------------------------------------------------------- clear failures


def test_a_plaintext_client_fails_naming_the_protocol_mismatch(secure_stack: SecureStack):
    bootstrap = f"127.0.0.1:{secure_stack.kafka_port}"

    async def start() -> None:
        async with TranslationClient(bootstrap, start_timeout=5):
            pass

    started = time.monotonic()
    with pytest.raises(TranslationError) as info:
        asyncio.run(start())
    message = str(info.value)
    assert time.monotonic() - started < 20
    assert f"Kafka at {bootstrap} (security.protocol=PLAINTEXT)" in message
    assert "expects TLS" in message and "security protocol mismatch" in message
    assert "TOLK_SECURITY_PROTOCOL" in message


def test_a_wrong_password_fails_naming_the_authentication(secure_stack: SecureStack):
    settings = secured_settings(secure_stack, sasl_password="not-the-password")

    async def start() -> None:
        async with TranslationClient(
            settings.bootstrap, start_timeout=5, kafka_config=settings.kafka_security()
        ):
            pass

    with pytest.raises(TranslationError) as info:
        asyncio.run(start())
    message = str(info.value)
    assert "SASL authentication failed for user 'tolk' (SCRAM-SHA-512)" in message
    assert "TOLK_SASL_PASSWORD" in message
    assert "not-the-password" not in message


def test_a_client_without_the_ca_fails_naming_the_tls_handshake(secure_stack: SecureStack):
    settings = secured_settings(secure_stack, ssl_ca_location="")

    async def start() -> None:
        async with TranslationClient(
            settings.bootstrap, start_timeout=5, kafka_config=settings.kafka_security()
        ):
            pass

    with pytest.raises(TranslationError, match="TLS handshake failed; TOLK_SSL_CA_LOCATION"):
        asyncio.run(start())


def test_tolk_worker_fails_fast_on_a_plaintext_configuration(secure_stack: SecureStack):
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TOLK_")},
        "TOLK_BOOTSTRAP": f"127.0.0.1:{secure_stack.kafka_port}",
        "TOLK_METRICS_PORT": "0",
    }
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "workers.cli", "worker"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "security protocol mismatch" in done.stderr
    assert time.monotonic() - started < 60  # before any model is loaded


# ---------------------------------------------------------------------- the canary guard


def _guard_reply(i: int, now_ms: int) -> bytes:
    from schemas.codec import encode_result

    return encode_result(
        {
            "request_id": f"g{i}", "status": "OK", "text": "x", "error": None,
            "model_version": "smol@stable", "source_lang": "en", "target_lang": "de",
            "timings": {"queue_ms": 1.0, "prefill_ms": 1.0, "decode_ms": 1.0, "total_ms": 300.0},
            "tokens_in": 3, "tokens_out": 3, "cached_prefix_tokens": 0, "worker_id": "w",
            "completed_at": now_ms, "conversation_id": None, "metadata": {},
        }
    )  # fmt: skip


def test_tolk_guard_reads_the_replies_over_sasl_ssl(secure_stack: SecureStack, tmp_path: Path):
    """`tolk guard` (issue 26): its faust consumer takes the worker's security settings, so on
    the secured stack it counts replies (it spoke plaintext before and read nothing); its log
    holds no password."""
    import dataclasses
    import re

    from confluent_kafka import Producer

    from topics.admin import ensure_topics
    from topics.catalog import catalog, replies_topic

    stack = secure_stack
    prefix = f"secg{uuid.uuid4().hex[:8]}."
    settings = secured_settings(stack, topic_prefix=prefix)
    specs = [dataclasses.replace(s, name=prefix + s.name, partitions=1) for s in catalog(["de"])]
    ensure_topics(settings.bootstrap, specs, timeout=30, client_config=settings.kafka_common())
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TOLK_")},
        **stack.credentials,
        "TOLK_TOPIC_PREFIX": prefix,
    }
    log_path = tmp_path / "guard.log"
    args = ["guard", "--window-s", "2", "--app-id", f"guard-{prefix}", "--metrics-port", "auto",
            "--datadir", str(tmp_path / "guard-data"), "--log-level", "info"]  # fmt: skip
    with log_path.open("wb") as log:
        guard = subprocess.Popen([sys.executable, "-m", "workers.cli", *args], cwd=REPO,
                                 env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    producer = Producer({**settings.kafka_common(), "linger.ms": 5})
    counted = 0.0
    try:
        deadline = time.monotonic() + 150
        port = None
        while time.monotonic() < deadline and guard.poll() is None:
            text = log_path.read_text(errors="replace")
            found = re.search(r"guard metrics \(/metrics\) on port (\d+)", text)
            port = int(found.group(1)) if found else None
            if port is not None and "[^Worker]: Ready" in text:
                break
            time.sleep(0.5)
        assert guard.poll() is None, log_path.read_text(errors="replace")[-3000:]
        assert port is not None and "Ready" in log_path.read_text(), "the guard never started"
        i = 0
        while time.monotonic() < deadline and counted < 5:
            now = int(time.time() * 1000)
            for _ in range(5):
                producer.produce(replies_topic(prefix), value=_guard_reply(i, now), timestamp=now)
                i += 1
            producer.flush(10)
            time.sleep(1.0)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                page = r.read().decode()
            samples = re.findall(r'tolk_guard_replies_total\{arm="stable",lang="de"\} (\S+)', page)
            counted = float(samples[0]) if samples else 0.0
    finally:
        guard.terminate()
        try:
            guard.wait(30)
        except subprocess.TimeoutExpired:
            guard.kill()
            guard.wait(10)
    output = log_path.read_text(errors="replace")
    assert counted >= 5, f"the guard counted {counted} replies over SASL_SSL:\n{output[-3000:]}"
    for secret in stack.secrets():
        assert secret not in output


def test_tolk_guard_fails_fast_on_a_plaintext_configuration(secure_stack: SecureStack):
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TOLK_")},
        "TOLK_BOOTSTRAP": f"127.0.0.1:{secure_stack.kafka_port}",
    }
    started = time.monotonic()
    command = [sys.executable, "-m", "workers.cli", "guard", "--metrics-port", "0"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "security protocol mismatch" in done.stderr
    assert time.monotonic() - started < 60


# ---------------------------------------------------------------------- the Schema Registry


def _registry_status(url: str, ca_file: Path | None, auth: tuple[str, str] | None) -> int:
    """The HTTP status of GET `url` (0: no HTTP answer at all)."""
    import base64
    import ssl

    request = urllib.request.Request(url)
    if auth is not None:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


def test_the_registry_serves_https_only_and_asks_for_the_client_login(
    secure_stack: SecureStack,
) -> None:
    creds = secure_stack.credentials
    url = urllib.parse.urlsplit(creds["TOLK_SCHEMA_REGISTRY_URL"])
    assert url.scheme == "https" and url.port == secure_stack.registry_port
    assert url.username == creds["TOLK_SASL_USERNAME"]
    assert url.password and url.password != creds["TOLK_SASL_PASSWORD"]  # a password of its own
    subjects = f"https://127.0.0.1:{secure_stack.registry_port}/apis/ccompat/v7/subjects"
    ca = secure_stack.ca_file
    assert _registry_status(subjects, ca, (url.username, url.password)) == 200
    assert _registry_status(subjects, ca, None) == 401
    assert _registry_status(subjects, ca, (url.username, "not-" + url.password)) == 401
    assert _registry_status(subjects.replace("https:", "http:"), None, None) == 0
    assert _registry_status(subjects, None, (url.username, url.password)) == 0  # unknown CA
    status = secure_stack.stack("status")
    assert "schema registry: running (pid " in status.stdout
    assert f"https://127.0.0.1:{secure_stack.registry_port}/apis/ccompat/v7" in status.stdout
    config = secure_stack.state_dir / "registry" / "config" / "application.properties"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600  # it holds the password


def test_tolk_topics_create_registers_every_subject_with_the_credentials_file(
    secure_stack: SecureStack,
) -> None:
    """`set -a; . client.env; set +a; tolk topics create`, as docs/OPERATIONS.md says: topics made
    over SASL_SSL, every subject registered over HTTPS with the login, no password printed; a
    wrong registry password stops it with the registry's 401."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TOLK_")},
        **secure_stack.credentials,
    }
    cli = [sys.executable, "-m", "workers.cli", "topics", "create"]
    done = subprocess.run(cli, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "tolk.requests.de-value: registered, id" in output
    assert "tolk.replies-value: registered, id" in output
    for secret in secure_stack.secrets():
        assert secret not in output
    url = urllib.parse.urlsplit(env["TOLK_SCHEMA_REGISTRY_URL"])
    env["TOLK_SCHEMA_REGISTRY_URL"] = env["TOLK_SCHEMA_REGISTRY_URL"].replace(
        f":{url.password}@", ":not-the-password@"
    )
    refused = subprocess.run(cli, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert refused.returncode == 1
    assert "401" in refused.stderr and "not-the-password" not in refused.stderr
