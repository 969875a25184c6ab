"""The Locust side of `tolk load`: one open-loop Kafka user per language.

Why a timer-driven user and not `constant_throughput`: `constant_throughput(r)` paces a
closed loop, each user waits for its reply before the next task, so a worker slower than
1/r holds the sends back and the tail latency it should show never happens (coordinated
omission). Here each language has exactly one user (`fixed_count = 1`) whose single task is a
schedule: send k goes out at `start + k / rate` for every k with `k / rate < duration`
(`ceil(rate * duration)` sends, however late a busy host runs them) through
`KafkaBridge.send`, which returns at once; the reply is awaited on the bridge's event loop,
and its latency counts from the scheduled time. The arrival rate is therefore the configured
one whatever the worker does.

While it waits for the next due time the user drains finished requests from the bridge and
fires them as Locust request events (`request_type="kafka"`, name = the language, failures
for every status but OK), so Locust's stats, CSV and the Prometheus histogram below all see
every reply. The listener `observe_request` puts them into `LoadMetrics`
(`tolk_load_latency_seconds{lang,status}`, `tolk_load_requests_total{lang,status}`), served on
a port Prometheus scrapes (`tolk load --metrics-port`, compose/prometheus*.yml).

Import this module only with gevent's monkey-patching off (`LOCUST_SKIP_MONKEY_PATCH=1`;
`workers/loadtest/cli.py` sets it before the first import of locust).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import gevent
from locust import User, task
from locust.env import Environment
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from workers.loadtest.bridge import Completion, KafkaBridge
from workers.loadtest.texts import LoadText

__all__ = ["KafkaLanguageUser", "LoadMetrics", "fire_completions", "language_user"]

# Seconds, as the worker's end-to-end histogram (workers/metrics.py), so panels compare.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 300.0)
_IDLE_POLL_S = 0.01  # how often a waiting user drains the bridge


class LoadMetrics:
    """The load generator's Prometheus metrics, in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.latency = Histogram(
            "tolk_load_latency_seconds",
            "Load test: scheduled send to reply received, by target language and status.",
            ["lang", "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "tolk_load_requests_total",
            "Load test requests finished, by target language and status.",
            ["lang", "status"],
            registry=self.registry,
        )
        self.offered_rate = Gauge(
            "tolk_load_offered_rate",
            "Load test: the configured arrival rate, requests per second, by language.",
            ["lang"],
            registry=self.registry,
        )

    def observe(self, lang: str, status: str, latency_s: float) -> None:
        self.latency.labels(lang=lang, status=status).observe(latency_s)
        self.requests.labels(lang=lang, status=status).inc()


def fire_completions(environment: Environment, done: Sequence[Completion]) -> None:
    """Report finished requests to Locust (stats, CSV, listeners such as `LoadMetrics`)."""
    for c in done:
        exception = None if c.status == "OK" else RuntimeError(f"{c.status}: {c.error or ''}")
        environment.events.request.fire(
            request_type="kafka",
            name=c.lang,
            response_time=c.latency_s * 1000.0,
            response_length=c.reply_chars,
            exception=exception,
            context={"status": c.status, "request_id": c.request_id, "completion": c},
        )


def observe_request(metrics: LoadMetrics) -> Any:
    """A Locust `request` listener that feeds `metrics` (register it on the environment)."""

    def listener(
        request_type: str, name: str, response_time: float, context: Any = None, **_: Any
    ) -> None:
        if request_type != "kafka":
            return
        status = (context or {}).get("status", "OK")
        metrics.observe(name, status, response_time / 1000.0)

    return listener


class KafkaLanguageUser(User):
    """One target language at a fixed rate; made concrete by `language_user()`."""

    abstract = True
    fixed_count = 1  # one timer per language: the rate is the user's, not the user count's
    lang: str = ""
    rate: float = 1.0  # requests per second
    duration_s: float = float("inf")  # the schedule's length: sends due before it go out
    texts: Sequence[LoadText] = ()
    bridge: KafkaBridge | None = None
    sent: int = 0
    finished: bool = False  # the whole schedule has been sent

    @task
    def open_loop(self) -> None:
        bridge = self.bridge
        if bridge is None or not self.texts or self.rate <= 0:
            raise RuntimeError(f"{type(self).__name__}: no bridge, texts or rate")
        interval = 1.0 / self.rate
        start = time.monotonic()
        items = itertools.cycle(self.texts)
        for k in itertools.count():
            if k * interval >= self.duration_s:
                break
            due = start + k * interval
            while (now := time.monotonic()) < due:
                fire_completions(self.environment, bridge.drain())
                gevent.sleep(min(due - now, _IDLE_POLL_S))
            item = next(items)
            bridge.send(self.lang, item.source_lang, item.text, due)
            type(self).sent += 1
        type(self).finished = True
        while True:  # schedule done: report replies until the runner stops this user
            fire_completions(self.environment, bridge.drain())
            gevent.sleep(_IDLE_POLL_S)


def language_user(
    lang: str,
    rate: float,
    texts: Sequence[LoadText],
    bridge: KafkaBridge,
    duration_s: float = float("inf"),
) -> type[KafkaLanguageUser]:
    """A concrete user class for `lang` (Locust counts users per class) that sends the
    schedule of `duration_s` seconds."""
    return type(
        f"Kafka_{lang}",
        (KafkaLanguageUser,),
        {
            "abstract": False,
            "lang": lang,
            "rate": rate,
            "duration_s": duration_s,
            "texts": tuple(texts),
            "bridge": bridge,
            "sent": 0,
            "finished": False,
        },
    )
