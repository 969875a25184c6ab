"""The fixture for tests that need the local Schema Registry (`bash compose/stack.sh
registry-up`, issue #45): `schema_registry_url`, the Confluent-compatible API's URL, after
checking that it answers. Like `tests/kafka_fixtures.py`'s services: an unreachable registry
on loopback is started once (the first start builds it with mvn: minutes), under a file lock
shared by the pytest-xdist processes; one that still does not answer is a skip, or a failure
with `TOLK_REQUIRE_SERVICES=1` (CI). `TOLK_SCHEMA_REGISTRY_URL` points the tests elsewhere.
Mark the tests `@pytest.mark.registry`."""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.kafka_fixtures import LOOPBACK, STACK_SCRIPT, services_required

DEFAULT_REGISTRY_URL = "http://127.0.0.1:8085/apis/ccompat/v7"
REGISTRY_START_TIMEOUT_S = 1200  # a first start builds the registry with mvn


def registry_problem(url: str) -> str | None:
    """Why the registry at `url` is not usable, or None when it lists its subjects."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/subjects", timeout=5) as reply:
            return None if reply.status == 200 else f"{url}/subjects answered {reply.status}"
    except (urllib.error.URLError, OSError) as exc:
        return f"{url}: {exc}"


def _start_registry(port: int) -> str:
    """`bash compose/stack.sh registry-up` on `port`, one process at a time; its log's tail."""
    lock_path = Path(tempfile.gettempdir()) / f"tolk-registry-up-{port}.lock"
    with lock_path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            done = subprocess.run(
                ["bash", str(STACK_SCRIPT), "registry-up"],
                env=os.environ | {"TOLK_REGISTRY_PORT": str(port)},
                capture_output=True, text=True, timeout=REGISTRY_START_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return f"registry-up timed out after {REGISTRY_START_TIMEOUT_S}s"
    return "\n".join(done.stderr.strip().splitlines()[-15:])


@pytest.fixture(scope="session")
def schema_registry_url() -> Iterator[str]:
    url = os.environ.get("TOLK_SCHEMA_REGISTRY_URL", DEFAULT_REGISTRY_URL)
    problem = registry_problem(url)
    detail = ""
    parts = urlsplit(url)
    if (
        problem is not None
        and parts.hostname in LOOPBACK
        and os.environ.get("TOLK_START_STACK", "1") not in ("0", "false", "no")
    ):
        detail = _start_registry(parts.port or 8085)
        problem = registry_problem(url)
    if problem is not None:
        message = f"the Schema Registry is not available ({problem}) {detail}".strip()
        if services_required():
            pytest.fail(f"{message} [TOLK_REQUIRE_SERVICES is set]", pytrace=False)
        pytest.skip(message)
    yield url
