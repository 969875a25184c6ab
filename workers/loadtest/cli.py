"""`tolk load`: a headless open-loop load test, per language, for a fixed time.

    tolk load --rate de=2,fr=1 --duration 60 --out load-runs/first

Runs Locust as a library (an `Environment` and a local runner, no web UI) with one
`KafkaLanguageUser` per language (workers/loadtest/locustfile.py), each sending at its rate
for `--duration` seconds. Then it stops sending, waits up to `--timeout` + 5 s for the
replies still out (a request sent in the window is measured however late its reply comes;
those that never come are TIMEOUT), and writes into `--out`:

* `summary.json` / `summary.csv`: per language P50/P95/P99 (nearest rank over the OK
  replies' exact latencies), counts per status, offered rate and throughput (report.py);
* `requests.csv`: every request (id, status, scheduled time, latency, send lag);
* `locust_stats.csv` / `locust_failures.csv`: Locust's own tables (its bucketed percentiles).

While it runs, the latency histograms are served for Prometheus on `--metrics-port` (default
9402, scraped by the stack's Prometheus, compose/stack.sh; 0: off). Settings (bootstrap,
security, topic prefix) come from the environment like every command (workers/settings.py).
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from workers.loadtest.texts import LoadText

__all__ = ["load", "parse_rates", "run_load"]

DEFAULT_METRICS_PORT = 9402  # 9400: the worker, 9401: `tolk guard`


def parse_rates(spec: str) -> dict[str, float]:
    """`de=2,fr=0.5` -> {"de": 2.0, "fr": 0.5}; rates are requests per second, > 0."""
    rates: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lang, sep, value = part.partition("=")
        lang = lang.strip().lower()
        try:
            rate = float(value)
        except ValueError:
            rate = -1.0
        if not sep or not lang or not rate > 0:
            raise ValueError(f"bad rate {part!r}: want LANG=REQUESTS_PER_SECOND, e.g. de=2")
        if lang in rates:
            raise ValueError(f"language {lang!r} given twice")
        rates[lang] = rate
    if not rates:
        raise ValueError("no rate given: e.g. --rate de=2,fr=1")
    return rates


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor()
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run_load(
    rates: dict[str, float],
    duration_s: float,
    out_dir: Path,
    *,
    bootstrap: str,
    topic_prefix: str = "",
    kafka_config: dict[str, Any] | None = None,
    deadline_s: float = 30.0,
    timeout_s: float = 35.0,
    metrics_port: int = DEFAULT_METRICS_PORT,
    seed: int = 0,
    texts: Mapping[str, Sequence[LoadText]] | None = None,
) -> dict[str, Any]:
    """Run the load test (see the module notes); returns the summary written to `out_dir`.
    `texts`: per language, the texts to cycle through (default: `support_mix(lang, seed)`)."""
    os.environ.setdefault("LOCUST_SKIP_MONKEY_PATCH", "1")  # before locust's first import
    import csv

    import gevent
    from locust import events
    from locust.env import Environment
    from locust.stats import PERCENTILES_TO_REPORT, StatsCSV
    from prometheus_client import start_http_server

    from workers.loadtest.bridge import Completion, KafkaBridge
    from workers.loadtest.locustfile import (
        LoadMetrics,
        fire_completions,
        language_user,
        observe_request,
    )
    from workers.loadtest.report import write_requests_csv, write_summary
    from workers.loadtest.texts import support_mix

    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = LoadMetrics()
    for lang, rate in rates.items():
        metrics.offered_rate.labels(lang=lang).set(rate)
    server = None
    if metrics_port:
        server, _thread = start_http_server(
            metrics_port, addr="127.0.0.1", registry=metrics.registry
        )

    bridge = KafkaBridge(
        bootstrap,
        topic_prefix=topic_prefix,
        kafka_config=kafka_config,
        deadline_s=deadline_s,
        timeout_s=timeout_s,
    )
    bridge.start()
    users = [
        language_user(
            lang,
            rate,
            texts[lang] if texts else support_mix(lang, seed=seed),
            bridge,
            duration_s=duration_s,
        )
        for lang, rate in rates.items()
    ]
    env = Environment(user_classes=list(users), events=events)
    done: list[Completion] = []
    listener = observe_request(metrics)
    env.events.request.add_listener(listener)

    def keep(request_type: str, context: Any = None, **_: Any) -> None:
        if request_type == "kafka" and context and "completion" in context:
            done.append(context["completion"])

    env.events.request.add_listener(keep)
    runner = env.create_local_runner()
    started = time.monotonic()
    try:
        runner.start(len(users), spawn_rate=len(users))
        gevent.sleep(duration_s)
        # Each user sends its schedule's fixed count; a busy host may run the last ones late.
        late_by = time.monotonic() + timeout_s
        while not all(u.finished for u in users) and time.monotonic() < late_by:
            gevent.sleep(0.01)
        runner.stop()  # no more sends; replies still out are collected below
        window_s = time.monotonic() - started
        end = time.monotonic() + timeout_s + 5.0
        while bridge.outstanding and time.monotonic() < end:
            fire_completions(env, bridge.drain())
            gevent.sleep(0.02)
    finally:
        bridge.close(wait_s=0.0)
        fire_completions(env, bridge.drain())
        runner.quit()
        env.events.request.remove_listener(listener)
        env.events.request.remove_listener(keep)
        if server is not None:
            server.shutdown()

    stats_csv = StatsCSV(env, PERCENTILES_TO_REPORT)
    with (out_dir / "locust_stats.csv").open("w", newline="", encoding="utf-8") as f:
        stats_csv.requests_csv(csv.writer(f))
    with (out_dir / "locust_failures.csv").open("w", newline="", encoding="utf-8") as f:
        stats_csv.failures_csv(csv.writer(f))
    write_requests_csv(out_dir / "requests.csv", done)
    run = {
        "command": "tolk load",
        "rates": rates,
        "duration_s": duration_s,
        "deadline_s": deadline_s,
        "timeout_s": timeout_s,
        "bootstrap": bootstrap,
        "topic_prefix": topic_prefix,
        "arrivals": "open loop: one timer-driven Locust user per language (constant rate)",
        "latency_from": "scheduled send time",
        "sent": bridge.sent,
        "cpu_model": _cpu_model(),
        "locust_requests": env.stats.total.num_requests,
        "locust_failures": env.stats.total.num_failures,
    }
    return write_summary(out_dir, done, rates, window_s, run)


def load(
    rate: Annotated[str, typer.Option(help="Requests per second per language: de=2,fr=1.")],
    duration: Annotated[float, typer.Option(help="Seconds of sending.")] = 60.0,
    out: Annotated[Path, typer.Option(help="Directory for summary.json/csv, requests.csv.")] = (
        Path("load-runs") / "latest"
    ),
    deadline: Annotated[float, typer.Option(help="Deadline on each request, seconds.")] = 30.0,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each reply.")] = 35.0,
    metrics_port: Annotated[
        int, typer.Option(help="Serve the latency histograms for Prometheus here (0 = off).")
    ] = DEFAULT_METRICS_PORT,
    bootstrap: Annotated[
        str | None, typer.Option("--bootstrap", "-b", help="Kafka bootstrap servers.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Shuffles each language's texts.")] = 0,
) -> None:
    """Open-loop load test over Kafka: per-language rates for a fixed time; writes P50/P95/P99
    and throughput per language (JSON, CSV)."""
    from workers.settings import Settings

    try:
        rates = parse_rates(rate)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    settings = Settings.from_env(bootstrap=bootstrap) if bootstrap else Settings.from_env()
    summary = run_load(
        rates,
        duration,
        out,
        bootstrap=settings.bootstrap,
        topic_prefix=settings.topic_prefix,
        kafka_config=settings.kafka_security(),
        deadline_s=deadline,
        timeout_s=timeout,
        metrics_port=metrics_port,
        seed=seed,
    )
    for row in summary["languages"]:
        typer.echo(
            f"{row['lang']}: sent {row['sent']} ok {row['ok']} "
            f"P50 {row['p50_ms']} ms P95 {row['p95_ms']} ms P99 {row['p99_ms']} ms "
            f"throughput {row['throughput_per_s']}/s {row['statuses']}"
        )
    typer.echo(f"written: {out}/summary.json, summary.csv, requests.csv, locust_stats.csv")
