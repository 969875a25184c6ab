"""Fixtures for tests that need the local services (Kafka and redis of ``compose/stack.sh``).

Import them into a conftest.py (the repository root must be on sys.path, as it is under
``python -m pytest``)::

    from tests.kafka_fixtures import kafka_bootstrap, redis_url  # noqa: F401

and mark the tests ``@pytest.mark.kafka`` / ``@pytest.mark.redis``.

The fixtures make ``python -m pytest`` work from a fresh clone without a separate ``tolk up``:
when the first test that needs a service finds it unreachable on loopback, they run
``bash compose/stack.sh up`` once for the whole session (it installs redis-server with
apt-get and gathers the Kafka jars with mvn when they are missing, then waits until both
answer) and check again. The start holds a file lock (`stack_lock_path`): the suite runs in
several pytest-xdist worker processes, each a session of its own, and only one of them may run
the script at a time (the script's own lock waits 300 s at most, and a first start with
apt-get and mvn can take longer); the next finds the services up and the script returns at
once. A stack started this way is left running for the next session (a log
line and the terminal summary say so; stop it with ``bash compose/stack.sh down``); one that
was already running is used as it is. ``TOLK_START_STACK=0`` turns the start off.

A service that still cannot be reached is skipped, or, with ``TOLK_REQUIRE_SERVICES=1`` (CI),
a failure. The addresses default to the stack's and can be moved with
``TOLK_KAFKA_BOOTSTRAP`` and ``TOLK_REDIS_URL``; the stack is only started for loopback
addresses (on their ports).
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlsplit

import pytest

DEFAULT_KAFKA_BOOTSTRAP = "127.0.0.1:9092"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
STACK_SCRIPT = Path(__file__).resolve().parents[1] / "compose" / "stack.sh"
LOOPBACK = ("127.0.0.1", "localhost")
# apt-get + mvn on a fresh machine take minutes; the script waits up to 120 s per service.
STACK_START_TIMEOUT_S = 900
STACK_LEFT_RUNNING = (
    "started the local stack (Kafka + redis on 127.0.0.1) with `bash compose/stack.sh up`; "
    "it keeps running after the tests: stop it with `bash compose/stack.sh down`"
)


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.lower() not in ("0", "false", "no")


def services_required() -> bool:
    return _env_flag("TOLK_REQUIRE_SERVICES", False)


def unique_name(prefix: str) -> str:
    """A topic / group / key name no other test (or earlier run) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True, slots=True)
class StackStart:
    """What the one ``compose/stack.sh up`` of this session did."""

    ok: bool  # the script exited 0 (both services answered)
    detail: str  # the tail of its log (stderr), or why it did not run


class _Session:
    """The stack start of this test session (one pytest session is one process)."""

    stack_start: StackStart | None = None


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _kafka_address() -> str:
    return os.environ.get("TOLK_KAFKA_BOOTSTRAP", DEFAULT_KAFKA_BOOTSTRAP).split(",")[0]


def _redis_address() -> str:
    return os.environ.get("TOLK_REDIS_URL", DEFAULT_REDIS_URL)


def stack_lock_path(kafka_port: int, redis_port: int) -> Path:
    """The lock file that one ``stack.sh up`` on these ports holds while it runs."""
    return Path(tempfile.gettempdir()) / f"tolk-stack-up-{kafka_port}-{redis_port}.lock"


def run_stack_up(kafka_port: int, redis_port: int) -> StackStart:
    """``bash compose/stack.sh up`` with the given loopback ports; waits until both answer.
    One process at a time (an exclusive `flock` on `stack_lock_path`): two concurrent starts
    would both launch a broker on the same port; the second one, once it holds the lock, finds
    both services answering and returns at once."""
    if not _env_flag("TOLK_START_STACK", True):
        return StackStart(False, "not tried, TOLK_START_STACK=0")
    with stack_lock_path(kafka_port, redis_port).open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _run_stack_script(kafka_port, redis_port)


def _run_stack_script(kafka_port: int, redis_port: int) -> StackStart:
    env = os.environ | {
        "TOLK_KAFKA_PORT": str(kafka_port),
        "TOLK_REDIS_PORT": str(redis_port),
        "TOLK_PYTHON": sys.executable,  # the script's readiness check needs confluent_kafka
    }
    try:
        done = subprocess.run(
            ["bash", str(STACK_SCRIPT), "up"],
            env=env,
            capture_output=True,
            text=True,
            timeout=STACK_START_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return StackStart(False, f"timed out after {STACK_START_TIMEOUT_S}s\n{_tail(stderr)}")
    return StackStart(done.returncode == 0, _tail(done.stderr))


def session_stack_start() -> StackStart | None:
    """The stack start this session ran, if any (for the terminal summary)."""
    return _Session.stack_start


def _say(config: pytest.Config, line: str) -> None:
    """Print past pytest's output capture (the start can take minutes; say why)."""
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        print(line, file=sys.stderr, flush=True)
        return
    with capture.global_and_fixture_disabled():
        print(f"\n{line}", file=sys.stderr, flush=True)


def _ensure_stack(config: pytest.Config, host: str, what: str) -> StackStart | None:
    """Start the local stack, once per session, for an unreachable service on loopback; None
    when the service's address is not one the stack could serve."""
    if host not in LOOPBACK:
        return None
    if _Session.stack_start is None:
        _say(config, f"[tolk tests] {what} is not reachable: running `bash compose/stack.sh up`")
        kafka_port = int(_kafka_address().rpartition(":")[2])
        redis_port = urlsplit(_redis_address()).port or 6379
        start = _Session.stack_start = run_stack_up(kafka_port, redis_port)
        if start.ok:
            _say(config, f"[tolk tests] {STACK_LEFT_RUNNING}")
        else:
            _say(config, f"[tolk tests] compose/stack.sh up failed:\n{start.detail}")
    return _Session.stack_start


def _unavailable(what: str, why: str, start: StackStart | None = None) -> NoReturn:
    message = f"{what} is not available ({why})"
    if start is None:
        message += "; start it with `bash compose/stack.sh up`"
    elif start.ok:
        message += ", even after `bash compose/stack.sh up` reported it up"
    else:
        message += f"; starting the local stack did not work: {start.detail}"
    if services_required():
        pytest.fail(f"{message} [TOLK_REQUIRE_SERVICES is set]", pytrace=False)
    pytest.skip(message)


def _tcp_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _kafka_problem(bootstrap: str) -> str | None:
    """Why the broker at ``bootstrap`` is not usable, or None when it answers metadata."""
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    if not _tcp_open(host or "127.0.0.1", int(port)):
        return f"nothing listens on {bootstrap}"
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    try:
        metadata = admin.list_topics(timeout=10)
    except KafkaException as exc:
        return f"{bootstrap} did not answer a metadata request: {exc}"
    return None if metadata.brokers else f"{bootstrap} reported no brokers"


def _redis_problem(url: str) -> str | None:
    """Why the redis at ``url`` is not usable, or None when it answers PING."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        return f"{url}: {exc}"
    finally:
        client.close()
    return None


@pytest.fixture(scope="session")
def kafka_bootstrap(request: pytest.FixtureRequest) -> Iterator[str]:
    """``host:port`` of a Kafka broker that answers a metadata request."""
    bootstrap = os.environ.get("TOLK_KAFKA_BOOTSTRAP", DEFAULT_KAFKA_BOOTSTRAP)
    problem = _kafka_problem(bootstrap)
    if problem is not None:
        host = _kafka_address().rpartition(":")[0] or "127.0.0.1"
        start = _ensure_stack(request.config, host, "Kafka")
        problem = _kafka_problem(bootstrap) if start is not None and start.ok else problem
        if problem is not None:
            _unavailable("Kafka", problem, start)
    yield bootstrap


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """URL of a redis-server that answers PING (db 0; tests must use unique keys)."""
    url = _redis_address()
    problem = _redis_problem(url)
    if problem is not None:
        start = _ensure_stack(request.config, urlsplit(url).hostname or "127.0.0.1", "redis")
        problem = _redis_problem(url) if start is not None and start.ok else problem
        if problem is not None:
            _unavailable("redis", problem, start)
    yield url
