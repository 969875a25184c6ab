"""Completion-latency prediction and deadline admission.

The most repeated ask to serving engines (vLLM, SGLang issues) is a queue deadline that expires
work *before* prefill. To refuse a request that cannot make its deadline we need a latency
estimate at admission time, from what is known then: uncached prompt tokens, expected output
tokens, the running batch size and the cached prompt tokens.

The model is linear in a small feature map that follows the engine's cost model
(step time = a + b * prefill_tokens + c * batch_size, one step per output token):

    latency ~ w0 + w1 * uncached + w2 * cached + w3 * out + w4 * batch + w5 * out * batch

`out * batch` is the decode term (each of `out` steps costs more in a bigger batch). The weights
start at a prior built from per-token constants and are refitted by ridge-regularized least
squares *towards the prior* from a bounded ring buffer of observations, every `refit_every`
observations; with few or degenerate samples (say, no cached tokens seen yet) the estimate
stays at the prior instead of going wild. Prediction error is measured prequentially: each
observation is first predicted by the model that has not seen it, so `median_abs_error()` is a
held-out number without a separate split.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from workers.engine.deadlines import expired, would_miss
from workers.engine.types import FinishReason, GenerationRequest

__all__ = [
    "FEATURE_NAMES",
    "AdmissionDecision",
    "DeadlineAdmission",
    "LatencyModel",
    "LatencyPrior",
    "Verdict",
    "prior_from_step_costs",
]

FEATURE_NAMES = ("base", "uncached", "cached", "out", "batch", "out_x_batch")


@dataclass(frozen=True, slots=True)
class LatencyPrior:
    """Per-token constants used before enough samples are seen (seconds).

    Defaults follow CPU anchors measured on the development machine (2 threads: prompt
    ~220 tok/s, decode step ~9 ms + ~2.7 ms per sequence in the batch).
    """

    base_s: float = 0.0  # fixed overhead per request
    prefill_s_per_token: float = 0.0045  # per uncached prompt token
    cached_s_per_token: float = 0.0  # per cached prompt token (block table only)
    decode_s_per_token: float = 0.009  # per output token, fixed part of a step
    batch_s: float = 0.0  # per running sequence, once
    decode_s_per_token_per_seq: float = 0.0027  # per output token per running sequence

    def as_array(self) -> np.ndarray:
        return np.array(
            [
                self.base_s,
                self.prefill_s_per_token,
                self.cached_s_per_token,
                self.decode_s_per_token,
                self.batch_s,
                self.decode_s_per_token_per_seq,
            ],
            dtype=np.float64,
        )


def prior_from_step_costs(
    step_base_s: float, prefill_s_per_token: float, batch_s_per_seq: float
) -> LatencyPrior:
    """A latency prior from measured step costs (step = a + b * prefill + c * batch, the
    simulator's `CostModel` in workers.serving.sim_config): a request decoding `out` tokens in a
    batch of B spends `out` steps of a + c * B, plus b per uncached prompt token for its
    prefill. Far closer than the generic CPU prior on another machine, so the model predicts
    well before its first refit."""
    return LatencyPrior(
        base_s=step_base_s,  # the prefill step itself
        prefill_s_per_token=prefill_s_per_token,
        cached_s_per_token=0.0,
        decode_s_per_token=step_base_s,
        batch_s=0.0,
        decode_s_per_token_per_seq=batch_s_per_seq,
    )


def _features(uncached: float, out: float, batch: float, cached: float) -> np.ndarray:
    return np.array([1.0, uncached, cached, out, batch, out * batch], dtype=np.float64)


class LatencyModel:
    """Linear latency predictor refitted online from observed completions."""

    def __init__(
        self,
        prior: LatencyPrior | None = None,
        capacity: int = 2048,
        refit_every: int = 32,
        min_samples: int = 64,
        ridge: float = 1e-6,
        holdout: int = 256,
    ) -> None:
        if capacity < len(FEATURE_NAMES) or refit_every < 1 or min_samples < 1 or holdout < 1:
            raise ValueError("capacity, refit_every, min_samples and holdout must be positive")
        # `ridge` stays tiny: out, batch and out*batch are strongly correlated, and a ridge of
        # even 1e-3 visibly biases their coefficients; it only has to pin columns the data
        # cannot identify (all-zero, say) to the prior.
        if ridge < 0:
            raise ValueError(f"ridge must be >= 0, got {ridge}")
        self._prior = (prior or LatencyPrior()).as_array()
        self._coef = self._prior.copy()
        self._x = np.zeros((capacity, len(FEATURE_NAMES)), dtype=np.float64)
        self._y = np.zeros(capacity, dtype=np.float64)
        self._capacity = capacity
        self._n = 0  # samples in the ring (<= capacity)
        self._next = 0  # ring write position
        self._since_fit = 0
        self._refit_every = refit_every
        self._min_samples = min_samples
        self._ridge = ridge
        self._errors: deque[float] = deque(maxlen=holdout)
        self.observations = 0  # total observed, ever
        self.fits = 0  # how many refits ran

    @property
    def coefficients(self) -> dict[str, float]:
        return dict(zip(FEATURE_NAMES, (float(c) for c in self._coef), strict=True))

    @property
    def fitted(self) -> bool:
        """Whether the coefficients come from data (else they are the prior)."""
        return self.fits > 0

    def predict(
        self,
        prompt_tokens_uncached: int,
        output_tokens: int,
        batch_size: int,
        cached_tokens: int = 0,
    ) -> float:
        """Predicted seconds from admission to the last token (never negative)."""
        x = _features(prompt_tokens_uncached, output_tokens, batch_size, cached_tokens)
        return max(0.0, float(x @ self._coef))

    def predict_prior(
        self,
        prompt_tokens_uncached: int,
        output_tokens: int,
        batch_size: int,
        cached_tokens: int = 0,
    ) -> float:
        """`predict` by the prior alone (what the per-token constants say, whatever was fitted)."""
        x = _features(prompt_tokens_uncached, output_tokens, batch_size, cached_tokens)
        return max(0.0, float(x @ self._prior))

    def observe(
        self,
        prompt_tokens_uncached: int,
        output_tokens: int,
        batch_size: int,
        cached_tokens: int,
        latency_s: float,
    ) -> None:
        """Record one finished request (actual output tokens, batch size when admitted)."""
        if not math.isfinite(latency_s) or latency_s < 0:
            raise ValueError(f"latency_s must be a finite non-negative number, got {latency_s!r}")
        x = _features(prompt_tokens_uncached, output_tokens, batch_size, cached_tokens)
        self._errors.append(abs(max(0.0, float(x @ self._coef)) - latency_s))
        self._x[self._next] = x
        self._y[self._next] = latency_s
        self._next = (self._next + 1) % self._capacity
        self._n = min(self._n + 1, self._capacity)
        self.observations += 1
        self._since_fit += 1
        if self._n >= self._min_samples and self._since_fit >= self._refit_every:
            self.refit()

    def refit(self) -> None:
        """Ridge least squares towards the prior over the ring buffer's samples."""
        n = self._n
        if n == 0:
            return
        x, y = self._x[:n], self._y[:n]
        # column scales, so one ridge strength suits tokens (hundreds) and the intercept (1)
        scale = np.sqrt(np.mean(x * x, axis=0))
        scale[scale == 0] = 1.0
        resid = y - x @ self._prior
        lam = math.sqrt(self._ridge * n)
        a = np.vstack([x, lam * np.diag(scale)])
        b = np.concatenate([resid, np.zeros(len(FEATURE_NAMES))])
        delta, *_ = np.linalg.lstsq(a, b, rcond=None)
        self._coef = self._prior + delta
        self._since_fit = 0
        self.fits += 1

    def median_abs_error(self) -> float:
        """Median |predicted - measured| over the recent held-out observations (nan if none)."""
        if not self._errors:
            return math.nan
        return float(np.median(np.fromiter(self._errors, dtype=np.float64)))


class Verdict(enum.StrEnum):
    ADMIT = "admit"
    REJECTED = "rejected"  # it would miss its deadline: refuse before spending prefill on it
    EXPIRED = "expired"  # the deadline has already passed


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    verdict: Verdict
    reason: str  # human-readable, goes on the REJECTED/EXPIRED reply
    predicted_s: float = 0.0  # predicted queue wait + service latency
    slack_s: float = math.inf  # deadline - (now + predicted), before the safety margin

    @property
    def admitted(self) -> bool:
        return self.verdict is Verdict.ADMIT

    @property
    def finish_reason(self) -> FinishReason | None:
        """The FinishReason for the reply when refused, None when admitted."""
        if self.verdict is Verdict.REJECTED:
            return FinishReason.REJECTED
        if self.verdict is Verdict.EXPIRED:
            return FinishReason.EXPIRED
        return None


class DeadlineAdmission:
    """Refuses requests that are already late or would be by the model's estimate.

    A request is rejected when now + queue_wait + service * (1 + margin_ratio) + margin_s
    exceeds its deadline: the margin keeps a slightly optimistic model from admitting work that
    then finishes late, which costs more (its prefill and decode are wasted) than a refusal.
    """

    def __init__(self, model: LatencyModel, margin_s: float = 0.05, margin_ratio: float = 0.1):
        if margin_s < 0 or margin_ratio < 0:
            raise ValueError("margins must be >= 0")
        self.model = model
        self.margin_s = margin_s
        self.margin_ratio = margin_ratio

    def decide(
        self,
        *,
        now: float,
        deadline: float | None,
        prompt_tokens_uncached: int,
        expected_output_tokens: int,
        batch_size: int,
        cached_tokens: int = 0,
        queue_wait_s: float = 0.0,
    ) -> AdmissionDecision:
        if deadline is None:
            return AdmissionDecision(Verdict.ADMIT, "no deadline")
        if expired(deadline, now):  # the deadline rule, workers/engine/deadlines.py
            return AdmissionDecision(
                Verdict.EXPIRED,
                f"deadline passed {now - deadline:.3f}s ago",
                slack_s=deadline - now,
            )
        service = self.model.predict(
            prompt_tokens_uncached, expected_output_tokens, batch_size, cached_tokens
        )
        predicted = max(0.0, queue_wait_s) + service
        slack = deadline - (now + predicted)
        needed = predicted + service * self.margin_ratio + self.margin_s
        if would_miss(deadline, now, needed):
            return AdmissionDecision(
                Verdict.REJECTED,
                f"would miss deadline: needs ~{needed:.3f}s (queue {queue_wait_s:.3f}s + "
                f"service {service:.3f}s + margin), {deadline - now:.3f}s left",
                predicted_s=predicted,
                slack_s=slack,
            )
        return AdmissionDecision(
            Verdict.ADMIT, f"fits with {slack:.3f}s slack", predicted_s=predicted, slack_s=slack
        )

    def decide_request(
        self,
        request: GenerationRequest,
        *,
        now: float,
        batch_size: int,
        cached_tokens: int = 0,
        queue_wait_s: float = 0.0,
    ) -> AdmissionDecision:
        """`decide()` for an engine request; expected output falls back to max_new_tokens."""
        out = request.expected_output_tokens or request.params.max_new_tokens
        return self.decide(
            now=now,
            deadline=request.deadline,
            prompt_tokens_uncached=max(0, len(request.prompt_ids) - cached_tokens),
            expected_output_tokens=out,
            batch_size=batch_size,
            cached_tokens=cached_tokens,
            queue_wait_s=queue_wait_s,
        )
