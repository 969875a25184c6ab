"""Every panel of deploy/grafana/tolk.json returns data from a real Prometheus after a load.

A private Prometheus (compose/stack.sh `observability-up`: its own state dir and port 19590,
a 1 s scrape interval) scrapes a real worker and `tolk load`. The worker runs the real engine
(SmolLM2-135M, `build_fair_engine`: VTC queue, admission, KV cache, prefix cache) behind the
exact-match translation cache, as `tolk worker` composes them, on the local broker with a
topic prefix of its own. `tolk load` sends a few real support texts per language at a fixed
rate, cycling, so the cache also hits. Then each panel's every PromQL target goes through the
HTTP API (`$__rate_interval` -> 1m, `$lang` -> `.+`); a target with no series fails.

A panel whose metric the worker does not export at all (no `# HELP` line on its metrics page)
fails the test, naming it: a dashboard is not done while a panel shows nothing (this used to be
an expected failure, which a green run hid). The same check runs without any service in
`test_every_panel_names_a_metric_the_worker_or_the_load_test_exports` (the registries'
exposition, no Prometheus), so a panel naming an unexported metric fails the default run too.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tests.kafka_fixtures import kafka_bootstrap, redis_url, services_required  # noqa: F401
from tests.workers.fakes import create_prefixed_topics
from workers.fairness.policy import LanguagePolicy
from workers.loadtest.cli import run_load
from workers.loadtest.texts import support_mix
from workers.settings import Settings
from workers.worker import Worker

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "tolk.json"
STACK = ROOT / "compose" / "stack.sh"
PROMETHEUS_PORT = 19590
LANGS = ("de", "fr")
RATES = {"de": 2.0, "fr": 1.0}
LOAD_S = 12.0
MAX_NEW_TOKENS = 48


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def panel_targets(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every query panel's targets."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["refId"], target["expr"]))
    return out


def concrete(expr: str) -> str:
    """The expression as Grafana would send it with every language selected."""
    return expr.replace("$__rate_interval", "1m").replace("$lang", ".+")


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(tolk_[a-z0-9_]+?)(?:_bucket|_count|_sum)?\b(?=[{\[\s)]|$)", expr))


def not_exported(dashboard: dict[str, Any], exposition: str) -> list[str]:
    """`title [refId]: metrics` of every panel target naming a metric without a `# HELP` line
    in `exposition` (the load test's `tolk_load_*` too, when its page is part of it)."""
    out = []
    for title, ref, expr in panel_targets(dashboard):
        missing = sorted(m for m in metric_names(expr) if f"# HELP {m} " not in exposition)
        if missing:
            out.append(f"{title} [{ref}]: {', '.join(missing)}")
    return out


def query(expr: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/query?" + urllib.parse.urlencode(
        {"query": expr}
    )
    body = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def test_dashboard_json_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    targets = panel_targets(dashboard)
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in (
        "p50",
        "throughput",
        "errors",
        "queue depth",
        "vtc",
        "jain",
        "slo",
        "kv cache",
        "prefix",
        "cache hit rate",
        "lag",
        "time to drain",
        "cascade",
    ):
        assert topic in titles, topic
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for title, _ref, expr in targets:
        assert metric_names(expr), (title, expr)
        assert "$lang" in expr or "lang" not in expr or "by (lang" in expr, (title, expr)


def _load_exposition() -> str:
    """The metrics page of `tolk load` (every metric it registers, no samples needed)."""
    from workers.loadtest.locustfile import LoadMetrics

    return generate_latest(LoadMetrics().registry).decode()


def test_every_panel_names_a_metric_the_worker_or_the_load_test_exports() -> None:
    from workers.metrics import WorkerMetrics

    registry = CollectorRegistry()
    WorkerMetrics(registry)  # every metric the worker registers, before any request
    exposition = generate_latest(registry).decode() + _load_exposition()
    dashboard = json.loads(DASHBOARD.read_text())
    assert not_exported(dashboard, exposition) == []
    # and the check bites: a panel on a metric nobody exports is named
    bogus = {"title": "Bogus", "targets": [{"refId": "A", "expr": "rate(tolk_nowhere_total[1m])"}]}
    doctored = {**dashboard, "panels": [*dashboard["panels"], bogus]}
    assert not_exported(doctored, exposition) == ["Bogus [A]: tolk_nowhere_total"]


@pytest.fixture
def prometheus(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[dict[str, int]]:
    """A private Prometheus scraping a worker port and a load-generator port (both free)."""
    ports = {"worker": _free_port(), "load": _free_port()}
    env = {
        **os.environ,
        "TOLK_STATE_DIR": str(tmp_path / "stack"),
        "TOLK_PROMETHEUS_PORT": str(PROMETHEUS_PORT),
        "TOLK_PROMETHEUS_TARGETS": f"127.0.0.1:{ports['worker']}",
        "TOLK_PROMETHEUS_LOAD_TARGETS": f"127.0.0.1:{ports['load']}",
        "TOLK_PROMETHEUS_SCRAPE_INTERVAL": "1s",
    }
    up = subprocess.run(
        ["bash", str(STACK), "observability-up"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if up.returncode != 0:
        why = f"prometheus did not start: {up.stderr[-800:]}"
        if services_required():
            pytest.fail(why)
        pytest.skip(why)
    try:
        yield ports
    finally:
        subprocess.run(["bash", str(STACK), "observability-down"], env=env, timeout=60)


@pytest.mark.kafka
@pytest.mark.redis
@pytest.mark.slow
def test_every_panel_returns_data_after_a_short_load(
    smollm2: Any,
    kafka_bootstrap: str,  # noqa: F811
    redis_url: str,  # noqa: F811
    prometheus: dict[str, int],
    tmp_path: Path,
) -> None:
    from workers.engine.engine import Engine, EngineConfig
    from workers.serving.fair_engine import build_fair_engine
    from workers.serving.pipeline import ServingOptions, build_served_engine
    from workers.stages.cascade.rules import CascadeThresholds
    from workers.stages.cascade.stage import CascadeSetup

    prefix = f"t{uuid.uuid4().hex[:10]}."
    create_prefixed_topics(kafka_bootstrap, prefix, LANGS)
    policies = {lang: LanguagePolicy(1.0, 20.0, 64, MAX_NEW_TOKENS) for lang in LANGS}
    settings = Settings(
        bootstrap=kafka_bootstrap,
        redis_url=redis_url,
        group_id=f"tolk-test-{uuid.uuid4().hex[:10]}",
        languages=LANGS,
        topic_prefix=prefix,
        metrics_port=prometheus["worker"],
        worker_id="w-dashboard",
        policies=policies,
        drain_timeout_s=10.0,
    )
    fair = build_fair_engine(
        smollm2,
        policies,
        config=EngineConfig(kv_cache_tokens=4096, max_new_tokens=MAX_NEW_TOKENS),
    )
    fair.engine.warm(LANGS)
    # the cascade's panels need a cascade: a second engine on the same weights as its "large"
    # model, every answer deferred (a total log-probability is never above 0)
    large = Engine(smollm2, EngineConfig(kv_cache_tokens=4096, max_new_tokens=MAX_NEW_TOKENS))
    defer_all = CascadeThresholds("smollm2-135m", "smollm2-135m", "small_total", {}, pooled=0.0)
    options = ServingOptions.of(
        settings,
        faithful=False,
        cache=True,
        cache_variant=f"test={uuid.uuid4().hex[:8]}",
        cascade=CascadeSetup(large, defer_all),
    )
    engine = build_served_engine(fair, options, base=fair.engine)
    worker = Worker(settings, engine, registry=CollectorRegistry())
    thread = worker.run_in_thread()
    try:
        assert worker.assigned_event.wait(30), "worker got no assignment"
        # the 3 shortest texts, cycled: they finish (STOP, cacheable), so the cache hits too;
        # answered once first (run_load waits for every reply), so the hits do not depend on
        # the host answering a text before its repeats arrive (on an AMD EPYC Zen 3 CI host
        # every copy was in flight at once: no hit, the hit-rate panel empty)
        texts = {lang: sorted(support_mix(lang), key=lambda t: len(t.text))[:3] for lang in LANGS}
        run_load(
            {lang: 1.0 for lang in LANGS},
            3.0,
            tmp_path / "warm",
            bootstrap=kafka_bootstrap,
            topic_prefix=prefix,
            deadline_s=30.0,
            timeout_s=40.0,
            metrics_port=0,  # no page of its own: the port stays the measured run's
            texts=texts,
        )
        summary = run_load(
            RATES,
            LOAD_S,
            tmp_path / "load",
            bootstrap=kafka_bootstrap,
            topic_prefix=prefix,
            deadline_s=30.0,
            timeout_s=40.0,
            metrics_port=prometheus["load"],
            texts=texts,
        )
        assert all(row["ok"] > 0 for row in summary["languages"]), summary
        time.sleep(3.0)  # a few more scrapes of the worker's gauges
        exposition = (
            urllib.request.urlopen(f"http://127.0.0.1:{prometheus['worker']}/metrics", timeout=5)
            .read()
            .decode()
        )
        empty: list[str] = []
        dashboard = json.loads(DASHBOARD.read_text())
        # the load test's page is gone with its run: its metrics' names from its registry
        missing = not_exported(dashboard, exposition + _load_exposition())
        for title, ref, expr in panel_targets(dashboard):
            if not query(concrete(expr)):
                empty.append(f"{title} [{ref}]: {concrete(expr)}")
    finally:
        worker.stop()
        thread.join(30)
    assert not missing, "panels on metrics the worker does not export:\n" + "\n".join(missing)
    assert not empty, "panels without data:\n" + "\n".join(empty)
