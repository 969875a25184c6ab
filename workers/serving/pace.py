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
get faster still as the batch shrinks.

The decode-only step is the one **at the running batch's size** (`decode_steps`: seconds by
batch size, linear between the sizes given, the nearest one's outside them): from the start-up
probe's figures up to the running batch's cap (`workers.engine.batch_cap`), else the latency
prior's per-token constants. Under overload the batch is at its cap, so the threshold is the
cap's step as before. It was the cap's step at every load: at 1-2 req/s on a 2-vCPU AMD EPYC
(Zen 3), where a step at batch 1-2 took ~20 ms, the hook counted 73-130 ms (the step at a
batch of 16-32), so a German request of 20 expected tokens (2 s SLO: 100 ms a token) read as
at risk from its first step and every newcomer of the other language waited for it to finish.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from workers.engine.types import GenerationRequest

__all__ = ["MIXED_STEP_FACTOR", "SloPace"]

MIXED_STEP_FACTOR = 2.0  # a step with a newcomer's prefill, in decode-only steps (measured ~2-5)


class SloPace:
    """The pace hook: which groups may send a newcomer into this step (None: any)."""

    def __init__(
        self, slo_s: Mapping[str, float], decode_steps: Mapping[int, float] | float
    ) -> None:
        """`decode_steps`: a decode-only step's seconds by running batch size (a number: the
        same at every size)."""
        self.slo_s = dict(slo_s)
        self.decode_steps = decode_steps  # (validated by the setter)
        self.held_steps = 0  # steps in which some group was held back (a gauge's source)

    @property
    def decode_steps(self) -> dict[int, float]:
        return self._steps

    @decode_steps.setter
    def decode_steps(self, steps: Mapping[int, float] | float) -> None:
        steps = {1: steps} if isinstance(steps, int | float) else dict(steps)
        if not steps or any(b < 1 or not s > 0 for b, s in steps.items()):
            raise ValueError(f"decode steps must be > 0 at batch sizes >= 1, got {steps!r}")
        self._steps = dict(sorted(steps.items()))

    def step_s(self, batch: int) -> float:
        """A decode-only step at `batch` rows: linear between the sizes given, the nearest
        one's outside them."""
        sizes = list(self._steps)
        if batch <= sizes[0]:
            return self._steps[sizes[0]]
        if batch >= sizes[-1]:
            return self._steps[sizes[-1]]
        hi = next(b for b in sizes if b >= batch)
        lo = max(b for b in sizes if b <= batch)
        if hi == lo:
            return self._steps[lo]
        w = (batch - lo) / (hi - lo)
        return self._steps[lo] * (1 - w) + self._steps[hi] * w

    def __call__(
        self, running: Sequence[tuple[GenerationRequest, int]], now: float
    ) -> frozenset[str] | None:
        threshold = MIXED_STEP_FACTOR * self.step_s(len(running))
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
