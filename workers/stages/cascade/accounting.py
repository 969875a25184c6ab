"""What the cascade's work costs, and who pays for it (workers/stages/cascade/stage.py).

- `LargeRunTimes`: moving averages of what a scoring and a large-model translation took, the
  estimates by which the stage tells whether a request's deadline still allows deferral; and
  `cost_ratio`, what one large-model token is worth in small-model tokens, from both models'
  measured seconds per weighted service token.
- The fair share: a deferred request's large-model tokens are charged to its language in the
  small model's queue at that ratio (`SmallQueueCharge`, built by workers/serving/pipeline.py
  over the fair engine's queue), so a language whose requests are deferred often waits its
  turn; `service_tokens` weighs a run as `workers.fairness.vtc.service_cost` does.
- `FairScoring`: the small model's scoring requests (the fallback for an answer without its
  tokens' log-probabilities) built by its `Engine` and submitted through its fair engine,
  admitted, charged and observed like its translations.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from workers.engine.types import GenerationRequest, GenerationResult, RequestHandle
from workers.fairness.vtc import service_cost

__all__ = ["FairScoring", "LargeRunTimes", "Scorer", "SmallQueueCharge", "service_tokens"]


class Scorer(Protocol):
    """An engine that scores answers (`workers.engine.engine.Engine`)."""

    def score_request(
        self,
        text: str,
        source_lang: str,
        target_lang: str,
        answer: str,
        *,
        request_id: str | None = None,
        deadline: float | None = None,
    ) -> GenerationRequest: ...

    def submit(self, request: GenerationRequest) -> RequestHandle: ...


class LargeRunTimes:
    """What the deferred path costs, to tell whether a deadline still allows it: a moving
    average of the seconds a scoring, a large-model translation and a whole small-model answer
    took, from priors (the 1.5B Qwen on 2 cores: ~0.3 s to score a turn, ~1 s to translate
    one, docs/BENCHMARKS.md);
    and what a large-model token costs in small-model tokens (`cost_ratio`, from each model's
    seconds per weighted service token, prior 4: the 1.5B's P50 was 4.2x Gemma 3's), the rate
    at which a deferred request is charged to its language's fair share.
    Thread-safe (both engines' threads record)."""

    def __init__(
        self,
        score_s: float = 0.3,
        translate_s: float = 1.0,
        weight: float = 0.2,
        cost_ratio: float = 4.0,
        small_s: float = 0.2,
    ):
        # "small": a whole small-model answer (Gemma 3 270M: ~0.1-0.2 s a turn), the fallback
        # after an early deferral whose large run failed (workers/stages/cascade/stage.py)
        self._s = {"score": score_s, "translate": translate_s, "small": small_s}
        self._per_token: dict[str, float] = {}  # "small" / "large" -> s per service token
        self._ratio_prior = cost_ratio
        self.weight = weight
        self._lock = threading.Lock()

    def estimate(self, kind: str) -> float:
        with self._lock:
            return self._s[kind]

    def record(self, kind: str, seconds: float) -> None:
        with self._lock:
            self._s[kind] += self.weight * (seconds - self._s[kind])

    def fits(self, deadline: float | None, now: float, *kinds: str) -> bool:
        """Whether `kinds` run one after another finish before `deadline` (None: always)."""
        return deadline is None or now + sum(self.estimate(k) for k in kinds) <= deadline

    def record_run(self, model: str, result: GenerationResult) -> None:
        """One finished run of `model` ("small" / "large"): its service seconds per weighted
        token (uncached prompt + 2 x output, as the fair share counts them)."""
        tokens = service_tokens(result)
        seconds = result.timings.total_s - result.timings.queue_s
        if tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            old = self._per_token.get(model)
            per = seconds / tokens
            self._per_token[model] = per if old is None else old + self.weight * (per - old)

    def cost_ratio(self) -> float:
        """Small-model tokens one large-model token is worth (the prior until both ran)."""
        with self._lock:
            small, large = self._per_token.get("small"), self._per_token.get("large")
        if not small or not large:
            return self._ratio_prior
        return large / small


def service_tokens(result: GenerationResult) -> float:
    """The weighted tokens of service a run took (`workers.fairness.vtc.service_cost`)."""
    uncached = max(0, result.tokens_in - result.cached_tokens)
    return service_cost(uncached, max(0, result.tokens_out))


# charges (language, prefill tokens, output tokens) to the small model's fair share
SmallQueueCharge = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class FairScoring:
    """The small model's scoring path: requests built by its `Engine`, submitted through its
    fair engine, so a scoring is admitted by the deadline rule, charged to its language's fair
    share and observed by the latency model like any run of that model. (Submitted to the
    `Engine` directly, the fair engine's admission hook saw them admitted and never finished:
    it took them for a growing running batch and began refusing translations.)"""

    # the small model's `Engine.score_request`, and its fair engine's `submit`
    score_request: Callable[..., GenerationRequest]
    submit: Callable[[GenerationRequest], RequestHandle]
