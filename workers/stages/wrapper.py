"""`EngineWrapper`: the pass-through half of a serving stage, a `TranslationEngine` that wraps
another.

The serving stages (`workers/stages/<name>/stage.py`: drill, context, cache, protected,
faithful, examples, cascade) each change how a request is submitted and answered; the builder,
workers/serving/pipeline.py, composes them in its declared order and is the only place that
constructs one. A subclass sets `self.inner` and implements
`submit_translation(request)`; it overrides `start` / `stop` only to add its own work around
the inner engine's. Nothing else of the inner engine shows through: the builder's
`ServedEngine` gives the worker what it reads of the engine (its queue, stats, heartbeat)
explicitly. `bind_metrics` keeps the worker's metrics for the stage's own counters; the
`ServedEngine` calls it on every stage. A stage that runs a request twice (a retry) does so
through `workers.stages.retry.RetryJob` and answers with `merged_runs`: the second run's
answer carrying the work of both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from workers.engine.types import GenerationResult, Timings, TranslationEngine

__all__ = ["EngineWrapper", "merged_runs"]


def merged_runs(
    first: GenerationResult, second: GenerationResult, request_id: str
) -> GenerationResult:
    """`second` under `request_id`, carrying the work of both runs (tokens, times and the
    reruns of stages inside summed; the queue time is the first run's)."""
    t1, t2 = first.timings, second.timings
    return dataclasses.replace(
        second,
        request_id=request_id,
        tokens_in=first.tokens_in + second.tokens_in,
        tokens_out=first.tokens_out + second.tokens_out,
        cached_tokens=first.cached_tokens + second.cached_tokens,
        retries=first.retries + second.retries,
        timings=Timings(
            queue_s=t1.queue_s,
            prefill_s=t1.prefill_s + t2.prefill_s,
            decode_s=t1.decode_s + t2.decode_s,
            total_s=t1.total_s + t2.total_s,
        ),
    )


class EngineWrapper:
    """Model version, languages, token counts, start and stop of the inner engine."""

    inner: TranslationEngine
    # what the stage's answers depend on besides its kind, for the cache's key (the
    # retrieved-examples stage: k and a digest of its TM); "" for most stages
    key_note: str = ""

    @property
    def model_version(self) -> str:
        return self.inner.model_version

    @property
    def languages(self) -> tuple[str, ...]:
        return self.inner.languages

    def count_tokens(self, text: str) -> int:
        return self.inner.count_tokens(text)

    def start(self) -> None:
        self.inner.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        self.inner.stop(drain=drain, timeout=timeout)

    def bind_metrics(self, metrics: Any) -> None:
        """Keep the worker's metrics for the stage's own counters (none here)."""
