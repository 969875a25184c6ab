"""The local stack: compose/docker-compose.yml is valid, compose/stack.sh sees the services."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

COMPOSE_DIR = Path(__file__).resolve().parents[2] / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"


def _compose_command() -> list[str] | None:
    """`docker compose` (v2 plugin), else the standalone `docker-compose`, else None."""
    if shutil.which("docker"):
        probe = subprocess.run(
            ["docker", "compose", "version"], capture_output=True, text=True, timeout=30
        )
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_compose_file_is_valid():
    command = _compose_command()
    if command is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    result = subprocess.run(
        [*command, "-f", str(COMPOSE_FILE), "config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    for service in ("kafka:", "redis:", "worker:", "prometheus:"):
        assert service in result.stdout
    assert "tolk" in result.stdout and "worker" in result.stdout


def test_compose_runs_the_kafka_version_of_the_pom():
    pom = (COMPOSE_DIR / "pom.xml").read_text()
    version = re.search(r"<kafka.version>(.+?)</kafka.version>", pom)
    assert version is not None
    assert version.group(1).startswith("4.")
    assert f"image: apache/kafka:{version.group(1)}" in COMPOSE_FILE.read_text()


def test_prometheus_scrapes_the_worker_metrics_port():
    assert '"worker:9400"' in (COMPOSE_DIR / "prometheus.yml").read_text()


def test_stack_script_is_strict_bash():
    script = (COMPOSE_DIR / "stack.sh").read_text()
    assert "set -euo pipefail" in script
    subprocess.run(["bash", "-n", str(COMPOSE_DIR / "stack.sh")], check=True)
    usage = subprocess.run(
        ["bash", str(COMPOSE_DIR / "stack.sh"), "bogus"], capture_output=True, text=True
    )
    assert usage.returncode == 2 and "usage:" in usage.stderr


@pytest.mark.kafka
@pytest.mark.redis
def test_status_reports_running_services(kafka_bootstrap, redis_url):
    result = subprocess.run(
        ["bash", str(COMPOSE_DIR / "stack.sh"), "status"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^kafka: running .*127\.0\.0\.1:\d+", result.stdout, re.M), result.stdout
    assert re.search(r"^redis: running .*127\.0\.0\.1:\d+", result.stdout, re.M), result.stdout


@pytest.mark.redis
def test_redis_answers(redis_url):
    import redis

    from tests.kafka_fixtures import unique_name

    client = redis.Redis.from_url(redis_url)
    key = unique_name("tolk-test")
    try:
        assert client.set(key, b"v", ex=60)
        assert client.get(key) == b"v"
    finally:
        client.delete(key)
        client.close()
