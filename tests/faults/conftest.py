"""Fixtures of the fault-injection suite: one private stack per session, worker processes.

Every test here stops or breaks a service, so none of them may use the shared stack (9092 /
6379) that the rest of the suite and other people use. `fault_stack` starts a private Kafka +
redis once per session (a broker start costs 10-20 s; the six tests share it) and stops it at
the end; each test puts its topics under its own prefix, and `stack_up` makes sure both
services run again before a test starts (a failed test may have left one stopped). A stack
that cannot start (no Java, no redis-server) skips the suite, or fails it with
`TOLK_REQUIRE_SERVICES=1` as CI sets; `TOLK_START_STACK=0` skips it.

`spawn_worker` starts worker processes (`tests/faults/worker_main.py`) and terminates what is
still running at the end of the test.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import WorkerProcess
from tests.faults.private_stack import PrivateStack, StackError
from tests.kafka_fixtures import services_required


@pytest.fixture(scope="session")
def fault_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateStack]:
    if os.environ.get("TOLK_START_STACK", "").lower() in ("0", "false", "no"):
        pytest.skip("TOLK_START_STACK=0: the fault tests need a private stack of their own")
    stack = PrivateStack(tmp_path_factory.mktemp("fault-stack"))
    try:
        stack.up()
    except (StackError, OSError) as exc:
        with contextlib.suppress(StackError, OSError):
            stack.down()
        message = f"the private fault-test stack did not start: {exc}"
        if services_required():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    yield stack
    stack.down()


@pytest.fixture
def stack_up(fault_stack: PrivateStack) -> PrivateStack:
    """The private stack with both services running."""
    fault_stack.up()
    return fault_stack


@pytest.fixture
def spawn_worker(stack_up: PrivateStack, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def spawn(**args: Any) -> WorkerProcess:
        full = {
            "bootstrap": stack_up.bootstrap,
            "redis": stack_up.redis_url,
            "delay_s": 0.05,
            "session_timeout_ms": 6000,
            "metrics_port": 0,
            **args,
        }
        proc = WorkerProcess(full, tmp_path / f"{full['worker_id']}.log")
        started.append(proc)
        return proc

    yield spawn
    for proc in started:
        proc.terminate()
