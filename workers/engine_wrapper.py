"""`EngineWrapper`: the pass-through half of a `TranslationEngine` that wraps another.

The worker's engine wrappers (`protected_engine`, `faithful_engine`, `cache_engine`,
`drill_engine`, `tm_engine`, `context_engine`) each change how a request is submitted and
answered; everything else is the inner engine's. A subclass sets `self.inner` and implements
`submit_translation`; it overrides `start` / `stop` only to add its own work around the inner
engine's, and `bind_metrics` only to keep the worker's metrics for its own counters before
passing them on (`super().bind_metrics`): the worker binds the outermost engine, and the
binding reaches every wrapper of the chain. A wrapper that runs a request twice (a retry)
answers with `merged_runs`: the second run's answer carrying the work of both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from workers.engine.types import GenerationResult, Timings, TranslationEngine

__all__ = ["EngineWrapper", "merged_runs"]


def merged_runs(
    first: GenerationResult, second: GenerationResult, request_id: str
) -> GenerationResult:
    """`second` under `request_id`, carrying the work of both runs (tokens and times summed;
    the queue time is the first run's)."""
    t1, t2 = first.timings, second.timings
    return dataclasses.replace(
        second,
        request_id=request_id,
        tokens_in=first.tokens_in + second.tokens_in,
        tokens_out=first.tokens_out + second.tokens_out,
        cached_tokens=first.cached_tokens + second.cached_tokens,
        timings=Timings(
            queue_s=t1.queue_s,
            prefill_s=t1.prefill_s + t2.prefill_s,
            decode_s=t1.decode_s + t2.decode_s,
            total_s=t1.total_s + t2.total_s,
        ),
    )


class EngineWrapper:
    """Model version, languages, token counts, start and stop of the inner engine; any other
    attribute (stats, the fair queue, `stats_snapshot`) is looked up on it too."""

    inner: TranslationEngine

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
        """Pass the worker's metrics on to the inner engine, if it counts anything."""
        bind_inner = getattr(self.inner, "bind_metrics", None)
        if callable(bind_inner):
            bind_inner(metrics)

    def __getattr__(self, name: str) -> Any:
        # only for names the wrapper lacks; `inner` itself may not be set yet (copy, pickle)
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)
