"""The worker's metrics of its serving stages: `StageMetrics`, a member of the worker's metrics
container (`WorkerMetrics.stages`) over the same injected registry.

What is here is counted by the stages around the engine, each named next to its metric:
protected spans, the faithfulness check and its outcomes, the cascade's outcomes and scores,
translation-memory retrieval, conversation context, and the exact-match translation cache
(L1/L2 hits, joins, evictions, hit latency, L2 health). The worker binds this object to its
stages (`ServedEngine.bind_metrics(metrics.stages)`), so a stage sees its own metrics and none
of the worker's. The label rule of workers/metrics.py holds: bounded label sets only.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["StageMetrics"]

_RETRIEVAL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_RETRIEVAL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# The cascade's score: a mean log-probability per token (workers/stages/cascade/rules.py)
_SCORE_BUCKETS = (-4.0, -3.0, -2.5, -2.0, -1.5, -1.25, -1.0, -0.75, -0.5, -0.25, -0.1, 0.0)
# Seconds: a cache hit takes microseconds (L1) to a millisecond or so (L2, a Redis round trip).
_CACHE_HIT_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05)


class StageMetrics:
    """The serving stages' metrics (module notes), registered into `registry`."""

    def __init__(self, registry: CollectorRegistry, namespace: str = "tolk") -> None:
        self._register_stage_metrics(namespace, registry)
        self._register_cache_metrics(namespace, registry)

    def _register_stage_metrics(self, ns: str, registry: CollectorRegistry) -> None:
        self.protected_spans_total = Counter(  # workers/stages/protected/stage.py
            "protected_spans_total",
            "Translations with protected spans, by language and outcome: restored (masked, "
            "every span put back), retried_unmasked (restore failed; the unmasked retry kept "
            "every span), flagged (answered with spans not verified; the reply's metadata says "
            "so), skipped (the text already held mask-like tokens; translated unmasked).",
            ["lang", "outcome"],
            namespace=ns,
            registry=registry,
        )
        self.faithful_checks_total = Counter(  # workers/stages/faithful/stage.py
            "faithful_checks_total",
            "First-run translations a faithfulness check found suspect, by language and check: "
            "leak (copies a prompt example's target), ratio (length outside 0.3-3x the "
            "source's), loop (a repeated n-gram), length_guard (stopped at the source's cap).",
            ["lang", "check"],
            namespace=ns,
            registry=registry,
        )
        self.faithful_outcomes_total = Counter(  # workers/stages/faithful/stage.py
            "faithful_outcomes_total",
            "Suspect translations by language and outcome: retried (the retry with another "
            "prompt form was clean and answered), withheld (still suspect: an ERROR reply, the "
            "candidate in metadata), flagged (still suspect, answered with a flag in metadata).",
            ["lang", "outcome"],
            namespace=ns,
            registry=registry,
        )
        self.tm_retrievals_total = Counter(  # workers/stages/examples/stage.py (--tm-examples)
            "tm_retrievals_total",
            "Translation-memory look-ups for retrieved prompt examples, by target language and "
            "outcome: retrieved, no_index (no index for the language pair), error (the look-up "
            "raised; the fixed examples were used).",
            ["lang", "outcome"],
            namespace=ns,
            registry=registry,
        )
        self.tm_retrieval_seconds = Histogram(  # workers/stages/examples/stage.py
            "tm_retrieval_seconds",
            "Time of one retrieved-examples look-up (embedding + index search), before the "
            "request reaches the engine.",
            namespace=ns,
            registry=registry,
            buckets=_RETRIEVAL_BUCKETS,
        )
        self.cascade_outcomes_total = Counter(  # workers/stages/cascade/stage.py (--cascade)
            "cascade_outcomes_total",
            "Cascade requests by target language and outcome: small (the small model's answer "
            "kept), deferred (the large model answered), deadline (deferral would miss the "
            "deadline or the large run failed: the small answer, flagged).",
            ["lang", "outcome"],
            namespace=ns,
            registry=registry,
        )
        self.cascade_score = Histogram(  # workers/stages/cascade/stage.py
            "cascade_score",
            "The mean log-probability per token of each scored answer (0 is certain, lower "
            "is doubtful), by target language: the same scale whatever the deferral signal "
            "(the reply's tolk.cascade.score is the signal's own value, e.g. a total).",
            ["lang"],
            namespace=ns,
            registry=registry,
            buckets=_SCORE_BUCKETS,
        )
        self.context_turns_total = Counter(  # workers/stages/context/stage.py (--context)
            "context_turns_total",
            "Conversation turns by outcome: contextual (earlier turns in the prompt), "
            "no_history (first turn of its conversation, or its history expired), "
            "no_conversation (the request named none), history_leak (the answer copied a "
            "history turn: run again without history), recorded (kept as history).",
            ["outcome"],
            namespace=ns,
            registry=registry,
        )

    def _register_cache_metrics(self, ns: str, registry: CollectorRegistry) -> None:
        # -- the exact-match translation cache (workers/stages/cache/stage.py, workers/tm/) --
        self.cache_hits_total = Counter(
            "cache_hits_total",
            "Requests answered from the translation cache, by language and tier (l1: the "
            "worker's LRU-K, l2: Redis).",
            ["lang", "tier"],
            namespace=ns,
            registry=registry,
        )
        self.cache_misses_total = Counter(
            "cache_misses_total",
            "Requests the cache could not answer that ran the engine, by language.",
            ["lang"],
            namespace=ns,
            registry=registry,
        )
        self.cache_joined_total = Counter(
            "cache_joined_total",
            "Requests that joined an identical request's engine run (single flight), by language.",
            ["lang"],
            namespace=ns,
            registry=registry,
        )
        self.cache_evictions_total = Counter(
            "cache_evictions_total",
            "Entries the worker's L1 cache evicted for room (LRU-K), by language.",
            ["lang"],
            namespace=ns,
            registry=registry,
        )
        self.cache_hit_seconds = Histogram(
            "cache_hit_seconds",
            "Time to answer a request from the cache (key, L1, then L2), by language.",
            ["lang"],
            buckets=_CACHE_HIT_BUCKETS,
            namespace=ns,
            registry=registry,
        )
        self.cache_l2_degraded_total = Counter(
            "cache_l2_degraded_total",
            "L2 (Redis) cache calls that failed or were skipped while it is unreachable, by op "
            "(get / put); the worker serves from L1 and the engine meanwhile.",
            ["op"],
            namespace=ns,
            registry=registry,
        )
        self.cache_l2_up = Gauge(
            "cache_l2_up",
            "1 while the L2 (Redis) translation cache answers, 0 during an outage.",
            namespace=ns,
            registry=registry,
        )
