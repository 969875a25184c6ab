"""The service fixtures' verdicts when a service cannot be reached (tests/kafka_fixtures.py).

Each case runs a one-test pytest session in a subprocess against addresses where nothing
listens, with the stack start turned off (`TOLK_START_STACK=0`), so no real stack is touched:
without `TOLK_REQUIRE_SERVICES` the test is skipped, with it the test fails, and either way
the message says why and that the start was off. The start itself (`compose/stack.sh up`
from a fixture) is exercised whenever the suite runs without a stack.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kafka_fixtures import run_stack_up

REPO = Path(__file__).resolve().parents[2]

INNER_TEST = """
import pytest
from tests.kafka_fixtures import kafka_bootstrap, redis_url  # noqa: F401

@pytest.mark.kafka
def test_needs_kafka(kafka_bootstrap):
    pass

@pytest.mark.redis
def test_needs_redis(redis_url):
    pass
"""


def closed_port() -> int:
    """A loopback port nothing listens on (bound, read, released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_inner(tmp_path: Path, require: bool) -> subprocess.CompletedProcess[str]:
    test_file = tmp_path / "test_inner.py"
    test_file.write_text(INNER_TEST)
    env = os.environ | {
        "TOLK_START_STACK": "0",
        "TOLK_REQUIRE_SERVICES": "1" if require else "0",
        "TOLK_KAFKA_BOOTSTRAP": f"127.0.0.1:{closed_port()}",
        "TOLK_REDIS_URL": f"redis://127.0.0.1:{closed_port()}/0",
        "PYTHONPATH": str(REPO),
    }
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(test_file), "-rsf", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "-c", os.devnull],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_unreachable_services_skip_without_require(tmp_path):
    result = run_inner(tmp_path, require=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 skipped" in result.stdout
    assert "Kafka is not available (nothing listens on 127.0.0.1:" in result.stdout
    assert "redis is not available" in result.stdout
    assert "starting the local stack did not work: not tried, TOLK_START_STACK=0" in result.stdout


def test_unreachable_services_fail_with_require(tmp_path):
    result = run_inner(tmp_path, require=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 errors" in result.stdout, result.stdout
    assert result.stdout.count("[TOLK_REQUIRE_SERVICES is set]") >= 2


def test_stack_start_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("TOLK_START_STACK", "0")
    start = run_stack_up(kafka_port=closed_port(), redis_port=closed_port())
    assert not start.ok and "TOLK_START_STACK=0" in start.detail


@pytest.mark.parametrize(("value", "expected"), [("", False), ("0", False), ("1", True)])
def test_services_required_reads_the_flag(monkeypatch, value, expected):
    from tests.kafka_fixtures import services_required

    monkeypatch.setenv("TOLK_REQUIRE_SERVICES", value)
    assert services_required() is expected


def test_stack_starts_never_overlap(tmp_path, monkeypatch):
    """Two sessions (xdist workers) that find the stack down at the same time run
    `stack.sh up` one after the other, never at once (the file lock of `run_stack_up`)."""
    import tempfile
    import threading

    from tests import kafka_fixtures

    script = tmp_path / "stack.sh"
    script.write_text(
        "#!/usr/bin/env bash\n"
        f"mkdir {tmp_path}/running 2>/dev/null || echo overlap >> {tmp_path}/log\n"
        "sleep 0.5\n"
        f"rmdir {tmp_path}/running 2>/dev/null\n"
        f"echo done >> {tmp_path}/log\n"
    )
    monkeypatch.setattr(kafka_fixtures, "STACK_SCRIPT", script)
    monkeypatch.setenv("TOLK_START_STACK", "1")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the lock file goes there
    ports = (closed_port(), closed_port())
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(run_stack_up(*ports))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [r.ok for r in results] == [True, True, True]
    assert (tmp_path / "log").read_text().split() == ["done", "done", "done"]
