"""Holding newcomers back while a running request needs fast steps to make its SLO.

Under overload a continuous-batching engine refills every free slot at once, so most steps
carry a newcomer's prefill. On a CPU such a mixed step runs eagerly and costs about twice a
compiled decode-only step plus ~2 ms per prefill token (Gemma 3 270M int8, AMD EPYC Zen 4: 36
ms decode-only at batch 8, 70-200 ms with a 12-74 token prefill chunk; docs/BENCHMARKS.md). A
light language's request, admitted first by the fair share, then decodes at the mixed steps'
pace: 76-140 ms a token at 3x overload, so its long answers missed a 3 s SLO.

`SloPace` is the scheduler's pace hook (`workers.engine.types.PaceHook`), pure logic. Each step,
for every running request with an SLO and an expected length, it computes the pace the request
needs: the time left to its SLO (arrival + the language's `slo_p99_s`) over the tokens it still
expects to generate. If that pace is under `MIXED_STEP_FACTOR` decode-only steps, a mixed step
would make the request late, so the step admits newcomers only from that request's own
language (the queue's head of another language waits a step; the fair-share order is kept).
Requests already past their SLO hold nobody (holding cannot save them), nor do requests of
unknown length.

The price: while a light request runs at risk, the heavy language's slots refill later (its
throughput dips for the light request's few hundred milliseconds); the light request's steps
get faster still as the batch shrinks. `decode_step_s` comes from the start-up probe at the
running batch's cap (`workers.engine.batch_cap`), else the latency model's per-token prior.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from workers.engine.types import GenerationRequest

__all__ = ["MIXED_STEP_FACTOR", "SloPace"]

MIXED_STEP_FACTOR = 2.0  # a step with a newcomer's prefill, in decode-only steps (measured ~2-5)


class SloPace:
    """The pace hook: which groups may send a newcomer into this step (None: any)."""

    def __init__(self, slo_s: Mapping[str, float], decode_step_s: float) -> None:
        if decode_step_s <= 0:
            raise ValueError(f"decode_step_s must be > 0, got {decode_step_s!r}")
        self.slo_s = dict(slo_s)
        self.decode_step_s = decode_step_s
        self.held_steps = 0  # steps in which some group was held back (a gauge's source)

    def __call__(
        self, running: Sequence[tuple[GenerationRequest, int]], now: float
    ) -> frozenset[str] | None:
        threshold = MIXED_STEP_FACTOR * self.decode_step_s
        at_risk = set()
        for request, generated in running:
            slo = self.slo_s.get(request.group)
            expected = request.expected_output_tokens
            if slo is None or expected <= 0:
                continue
            time_left = request.arrival + slo - now
            if time_left <= 0:
                continue  # already late: holding others cannot save it
            tokens_left = max(1, expected - generated)
            if time_left / tokens_left < threshold:
                at_risk.add(request.group)
        if not at_risk:
            return None
        self.held_steps += 1
        return frozenset(at_risk)
