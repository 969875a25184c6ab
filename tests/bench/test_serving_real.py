"""The serving benchmark end to end on the real stack: a handful of requests through a real
`tolk worker` (and, when `bench/build_llama_server.sh` has built it, through llama-server
over HTTP and behind the bolt-on Kafka consumer). Slow: the worker loads Gemma 3 270M."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.serving import main
from bench.serving_llamaserver import BUILD_SCRIPT, find_llama_server
from tests.kafka_fixtures import kafka_bootstrap, redis_url  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.redis]


def _run(systems: str, bootstrap: str, redis: str, tmp_path: Path) -> dict:
    return main([
        "--systems", systems, "--rates", "1", "--mix", "de=1,en=1", "--duration", "4",
        "--repeats", "1", "--warmup", "0", "--settle", "0", "--timeout", "180",
        "--deadline", "180", "--slo", "180", "--bootstrap", bootstrap, "--redis-url", redis,
        "--logs", str(tmp_path / "logs"), "--out", str(tmp_path / "s.json"),
    ])  # fmt: skip


def _check(run: dict) -> None:
    every = run["languages"]["all"]
    assert every["offered"] == 4  # 0.5 req/s per language for 4 s, constant arrivals
    assert every["statuses"] == {"OK": 4}, run
    assert every["goodput"] == 1.0
    for lang in ("de", "en"):
        f = run["languages"][lang]
        assert f["offered"] == 2 and f["p50_s"] is not None
        assert f["ttft_p50_s"] is not None and 0 < f["ttft_p50_s"] <= f["p99_s"]
        assert 0 < f["mean_tokens_out"] <= 64


def test_a_few_requests_through_a_real_worker(
    kafka_bootstrap: str,  # noqa: F811
    redis_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    result = _run("tolk", kafka_bootstrap, redis_url, tmp_path)
    assert "error" not in result["starts"][0], result["starts"]
    assert "--duration 4" in result["command"]
    (run,) = result["runs"]
    _check(run)
    assert result["starts"][0]["start_to_assigned_s"] > 0
    assert result["max_rate_within_slo"] == {"tolk": 1.0}
    assert Path(result["plot"]).read_bytes()[:4] == b"\x89PNG"


def test_the_same_requests_through_llama_server(
    kafka_bootstrap: str,  # noqa: F811
    redis_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    if find_llama_server() is None:
        pytest.skip(f"llama-server not built (bash {BUILD_SCRIPT})")
    result = _run("llama-http,llama-kafka", kafka_bootstrap, redis_url, tmp_path)
    assert all("error" not in s for s in result["starts"]), result["starts"]
    assert [r["system"] for r in result["runs"]] == ["llama-http", "llama-kafka"]
    for run in result["runs"]:
        _check(run)
