"""`tolk load` headless against a real worker (fake engine) on the local broker.

The run's own figures are checked against what it received: every request of `requests.csv`
has its reply on the reply topic (same id, language and status), no reply arrived before the
worker completed it, the per-language P50/P95/P99 of `summary.json` are the nearest-rank
percentiles of those requests' latencies, the send counts follow the configured rates (open
loop), Locust's own table counts the same requests, and the latency histogram was served for
Prometheus while it ran.
"""

from __future__ import annotations

import csv
import json
import math
import socket
import threading
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from schemas.codec import decode_result
from tests.kafka_fixtures import kafka_bootstrap, redis_url  # noqa: F401
from tests.workers.fakes import FakeEngine, TopicReader, create_prefixed_topics
from tests.workers.polling import wait_for
from topics.catalog import REPLIES
from workers.loadtest.cli import run_load
from workers.loadtest.report import nearest_rank
from workers.settings import Settings
from workers.worker import Worker

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow]

RATES = {"de": 4.0, "fr": 2.0}
DURATION_S = 4.0
ENGINE_DELAY_S = 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Scraper:
    """Reads the load generator's metrics page until it shows an OK de request."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.seen = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                text = urllib.request.urlopen(self.url, timeout=1).read().decode()
            except OSError:
                continue
            if 'tolk_load_latency_seconds_count{lang="de",status="OK"}' in text:
                self.seen = text
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


def test_headless_run_reports_the_replies_it_received(
    kafka_bootstrap: str,  # noqa: F811
    redis_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    create_prefixed_topics(kafka_bootstrap, prefix, tuple(RATES))
    replies = TopicReader(kafka_bootstrap, prefix + REPLIES)
    settings = Settings(
        bootstrap=kafka_bootstrap,
        redis_url=redis_url,
        group_id=f"tolk-test-{uuid.uuid4().hex[:10]}",
        languages=tuple(RATES),
        topic_prefix=prefix,
        metrics_port=0,
        worker_id="w-load",
        drain_timeout_s=5.0,
    )
    worker = Worker(settings, FakeEngine(delay_s=ENGINE_DELAY_S), registry=CollectorRegistry())
    thread = worker.run_in_thread()
    port = _free_port()
    scraper = _Scraper(port)
    try:
        assert worker.assigned_event.wait(30), "worker got no assignment"
        summary = run_load(
            RATES,
            DURATION_S,
            tmp_path,
            bootstrap=kafka_bootstrap,
            topic_prefix=prefix,
            deadline_s=10.0,
            timeout_s=10.0,
            metrics_port=port,
        )
        rows = list(csv.DictReader((tmp_path / "requests.csv").open()))
        not_ok = [r for r in rows if r["status"] != "OK"]
        print("LOAD", json.dumps({"not_ok": not_ok, "summary": summary}))  # shown on a failure
        wait_for(lambda: len(replies) >= len(rows), 15, "the replies on the reply topic")
        got: dict[str, dict[str, Any]] = {}
        for value in replies.values():
            rec = decode_result(value)
            got[rec["request_id"]] = rec
    finally:
        scraper.close()
        worker.stop()
        thread.join(20)
        replies.close()

    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    by_lang = {row["lang"]: row for row in summary["languages"]}
    assert set(by_lang) == set(RATES)
    ids = [r["request_id"] for r in rows]
    assert len(ids) == len(set(ids)) == summary["sent"]
    for lang, rate in RATES.items():
        mine = [r for r in rows if r["lang"] == lang]
        # open loop: the schedule of rate x duration sends, whatever the replies or the host took
        assert len(mine) == math.ceil(rate * DURATION_S), (lang, len(mine))
        assert {r["status"] for r in mine} == {"OK"}
        for r in mine:
            reply = got[r["request_id"]]
            assert reply["status"] == "OK" and reply["target_lang"] == lang
            received_ms = (float(r["scheduled_at"]) + float(r["latency_s"])) * 1000.0
            assert reply["completed_at"] <= received_ms + 5.0  # not received before it was made
            assert float(r["latency_s"]) >= ENGINE_DELAY_S
        latencies = sorted(float(r["latency_s"]) for r in mine)
        row = by_lang[lang]
        assert row["sent"] == row["ok"] == len(mine)
        for q in (50, 95, 99):
            expected = round(nearest_rank(latencies, q) * 1000.0, 3)
            assert row[f"p{q}_ms"] == pytest.approx(expected, abs=1e-3), (lang, q)
        assert row["throughput_per_s"] == pytest.approx(len(mine) / summary["window_s"], rel=1e-3)

    locust_rows = {r["Name"]: r for r in csv.DictReader((tmp_path / "locust_stats.csv").open())}
    for lang in RATES:
        assert int(locust_rows[lang]["Request Count"]) == by_lang[lang]["sent"]
    assert summary["locust_failures"] == 0
    assert scraper.seen, "the latency histogram never reached the metrics port"
