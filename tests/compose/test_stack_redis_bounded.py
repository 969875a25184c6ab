"""The stack's redis is bounded (issue #15): `maxmemory` with LRU eviction over all keys.

Runs `compose/stack.sh up` on a private state directory and private ports (redis from 36380,
Kafka 19192/19193; never the shared 9092 / 6379), asks the redis it started for its
`maxmemory` and `maxmemory-policy`, and takes the stack down and cleans it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.workers.test_store_outage import _free_port

STACK = Path(__file__).resolve().parents[2] / "compose" / "stack.sh"

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.redis]


def test_stack_redis_has_maxmemory_and_lru_eviction(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None or shutil.which("java") is None:
        pytest.skip("redis-server or java missing")
    redis_port = _free_port(36380)
    env = {
        **os.environ,
        "TOLK_STATE_DIR": str(tmp_path / "state"),
        "TOLK_REDIS_PORT": str(redis_port),
        "TOLK_KAFKA_PORT": "19192",
        "TOLK_KAFKA_CONTROLLER_PORT": "19193",
        "TOLK_REDIS_MAXMEMORY": "64mb",
    }

    def stack(command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(STACK), command], env=env, capture_output=True, text=True, timeout=300
        )

    try:
        up = stack("up")
        assert up.returncode == 0, up.stderr[-3000:]
        import redis

        client = redis.Redis(host="127.0.0.1", port=redis_port)
        assert client.config_get("maxmemory") == {"maxmemory": str(64 * 1024 * 1024)}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        client.close()
    finally:
        stack("clean")
