"""The worker's metrics of the engine's own statistics: `EngineMetrics`, a member of the
worker's metrics container (`WorkerMetrics.engine`) over the same injected registry.

The engine must not import prometheus_client (tests/test_architecture.py): the worker polls an
`EngineSnapshot` (workers/engine/engine_snapshot.py) every half second and `update` copies it
in, turning its cumulative counts into Prometheus counters by their increments; `update_config`
copies the tuner's `ConfigReport` into the info metric.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Info

__all__ = ["EngineMetrics"]


class EngineMetrics:
    """The engine's metrics (module notes), registered into `registry`."""

    def __init__(self, registry: CollectorRegistry, namespace: str = "tolk") -> None:
        self._register_engine_metrics(namespace, registry)

    def _register_engine_metrics(self, ns: str, registry: CollectorRegistry) -> None:
        self.engine_kv_usage = Gauge(
            "engine_kv_cache_usage_ratio",
            "Share of the fullest KV pool's blocks referenced by running sequences (0..1).",
            namespace=ns,
            registry=registry,
        )
        self.engine_running = Gauge(
            "engine_running_sequences",
            "Sequences in the engine's running batch.",
            namespace=ns,
            registry=registry,
        )
        self.engine_prefix_queries = Counter(
            "engine_prefix_cache_queries_tokens_total",
            "Prompt tokens looked up in the engine's prefix cache.",
            namespace=ns,
            registry=registry,
        )
        self.engine_prefix_hits = Counter(
            "engine_prefix_cache_hits_tokens_total",
            "Prompt tokens served from the prefix cache (hit rate: rate of this / of queries).",
            namespace=ns,
            registry=registry,
        )
        self.engine_prefix_evictions = Counter(
            "engine_prefix_cache_evictions_total",
            "Cached KV blocks evicted for room (LRU).",
            namespace=ns,
            registry=registry,
        )
        self.engine_preemptions = Counter(
            "engine_preemptions_total",
            "Running sequences preempted (recomputed later) because KV blocks ran out.",
            namespace=ns,
            registry=registry,
        )
        self.engine_steps = Counter(
            "engine_steps_total", "Model steps run by the engine.", namespace=ns, registry=registry
        )
        # by kind ("decode" steps run the compiled graph where it is on; "mixed" and "prefill"
        # run eagerly): seconds / steps per kind is the mean step time a request decodes at
        self.engine_kind_steps = Counter(
            "engine_kind_steps_total",
            "Model steps run by the engine, by kind (decode, mixed, prefill).",
            ["kind"],
            namespace=ns,
            registry=registry,
        )
        self.engine_step_seconds = Counter(
            "engine_step_seconds_total",
            "Seconds spent in model steps, by kind (decode, mixed, prefill).",
            ["kind"],
            namespace=ns,
            registry=registry,
        )
        self._engine_seen: dict[str, float] = {}
        self._register_config_metrics(ns, registry)

    def _register_config_metrics(self, ns: str, registry: CollectorRegistry) -> None:
        self.engine_config = Info(
            "engine_config",
            "The served configuration (weights, compiled decode) and why the tuner chose it "
            "(workers/engine/tuner.py).",
            namespace=ns,
            registry=registry,
        )
        self.engine_config_switches = Counter(
            "engine_config_switches",
            "Moves of the serving engine to another configuration without a restart.",
            namespace=ns,
            registry=registry,
        )

    def update_config(self, report: Any) -> None:
        """Copy a `ConfigReport` (workers/engine/autoconfig.py) into the info metric and the
        switch counter (its count is cumulative, like the engine's counters)."""
        if report is None:
            return
        self.engine_config.info(
            {
                "in_use": report.in_use,
                "reason": report.reason[:200],
                "probing": str(report.probing).lower(),
                "served_vs_probe": "" if report.served_vs_probe is None else
                f"{report.served_vs_probe:.2f}",
            }
        )  # fmt: skip
        last = int(self._engine_seen.get("config_switches", 0))
        if report.switches > last:
            self.engine_config_switches.inc(report.switches - last)
        self._engine_seen["config_switches"] = report.switches

    def update(self, snapshot: Any) -> None:
        """Copy an `EngineSnapshot` (workers/engine/engine_snapshot.py) into the engine metrics.

        Its counters are cumulative since the engine was built; each Prometheus counter grows by
        the increase since the last snapshot (a smaller value, a new engine, counts from 0)."""
        self.update_config(getattr(snapshot, "config", None))
        self.engine_kv_usage.set(snapshot.kv_usage)
        self.engine_running.set(snapshot.running)
        for name, counter in (
            ("prefix_queries_tokens", self.engine_prefix_queries),
            ("prefix_hit_tokens", self.engine_prefix_hits),
            ("prefix_evictions", self.engine_prefix_evictions),
            ("preemptions", self.engine_preemptions),
            ("steps", self.engine_steps),
        ):
            value = int(getattr(snapshot, name))
            last = self._engine_seen.get(name, 0)
            counter.inc(value - last if value >= last else value)
            self._engine_seen[name] = value
        for kind, (steps, seconds) in snapshot.steps_by_kind.items():
            for key, metric, total in (
                (f"steps:{kind}", self.engine_kind_steps, float(steps)),
                (f"seconds:{kind}", self.engine_step_seconds, float(seconds)),
            ):
                last = self._engine_seen.get(key, 0.0)
                metric.labels(kind=kind).inc(total - last if total >= last else total)
                self._engine_seen[key] = total
