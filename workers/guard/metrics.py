"""The guard's Prometheus metrics: one small container over an injected registry (the pattern
of `workers/metrics.py`). Labels are languages, arms (a handful), actions, verdicts and ignore
reasons: bounded sets, never request ids."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["GuardMetrics"]


class GuardMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.replies_total = Counter(
            "tolk_guard_replies_total", "Replies counted into windows.", ["lang", "arm"], registry=r
        )
        self.ignored_total = Counter(
            "tolk_guard_ignored_total",
            "Replies not counted: malformed, no_arm, clock_skew, unknown_arm (at judging).",
            ["reason"],
            registry=r,
        )
        self.windows_total = Counter(
            "tolk_guard_windows_total", "Windows judged.", ["lang", "verdict"], registry=r
        )
        self.decisions_total = Counter(
            "tolk_guard_decisions_total", "Decisions written.", ["lang", "action"], registry=r
        )
        self.canary_share = Gauge(
            "tolk_guard_canary_share_percent", "The canary's share now.", ["lang"], registry=r
        )
        self.canary_p99_seconds = Gauge(
            "tolk_guard_canary_p99_seconds",
            "Canary P99 of the last judged window.",
            ["lang"],
            registry=r,
        )
