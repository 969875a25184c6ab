"""Deadline admission inside the simulator, as the worker's `FairEngine` runs it.

`simulate()` (workers.serving.simulate) with `SimConfig.admission` gives every request the
deadline arrival + its language's SLO and runs the worker's admission path on the simulated
clock, with the real `EngineAdmission` (workers.serving.admission):

1. at submission, `precheck` (what `FairEngine.submit` calls, with the same cached-prefix guess:
   the language prefix's full blocks): a refused request is REJECTED at once and never queued;
2. at admission, the same object as the scheduler's hook (deadline passed: EXPIRED by the
   scheduler; would miss it by the predicted service: REJECTED);
3. on finish, `observe` with the result the engine would report (timings on the simulated
   clock), so the latency model and the per-language output means learn as in the worker.

The latency model starts from `prior_from_step_costs` of the run's `CostModel`, as the bench
does after calibration. `overload_scenario` is the issue-25 shape in small: one heavy language
at a multiple of the engine's capacity, one light language at a fraction of its weighted share.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from workers.engine.scheduler import SequenceState
from workers.engine.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RequestQueue,
    Timings,
)
from workers.fairness.latency_model import LatencyModel, prior_from_step_costs
from workers.fairness.policy import DEFAULT_POLICIES
from workers.serving.admission import EngineAdmission
from workers.serving.sim_config import CostModel, LanguageLoad, SimConfig, estimate_capacity_rps

__all__ = ["SimAdmission", "overload_scenario"]


class SimAdmission:
    """Precheck at submission, the scheduler's hook, observe on finish (see the module notes)."""

    def __init__(
        self,
        queue: RequestQueue,
        clock: Callable[[], float],
        cost: CostModel,
        prefix_len: Mapping[str, int],
        block_size: int,
    ) -> None:
        model = LatencyModel(
            prior_from_step_costs(cost.step_base_s, cost.prefill_s_per_token, cost.batch_s_per_seq)
        )
        self.hook = EngineAdmission(model, queue=queue, clock=clock)
        self._prefix_len = dict(prefix_len)
        self._block = block_size
        self.rejected_at_submit = 0

    def submit(self, request: GenerationRequest, now: float) -> bool:
        """True when the request may be queued; False: REJECTED before it waited."""
        if request.deadline is None:
            return True
        verdict = self.hook.precheck(request, now=now, cached=self.cached_guess(request))
        if not verdict.admit:
            self.rejected_at_submit += 1
        return verdict.admit

    def cached_guess(self, request: GenerationRequest) -> int:
        """`FairEngine._cached_guess`: the language prefix's full blocks."""
        n = self._prefix_len.get(request.group, 0)
        return min(len(request.prompt_ids) - 1, (n // self._block) * self._block)

    def finished(self, seq: SequenceState, now: float) -> None:
        """`FairEngine`'s done-callback: observe the result the engine reports."""
        req = seq.request
        sched = seq.first_scheduled_at
        first = seq.first_token_at
        result = GenerationResult(
            request_id=req.request_id,
            token_ids=list(seq.output_ids),
            text="",
            finish_reason=seq.finish_reason or FinishReason.ERROR,
            tokens_in=seq.num_prompt_tokens,
            tokens_out=len(seq.output_ids),
            cached_tokens=seq.num_cached,
            timings=Timings(
                queue_s=(sched - req.arrival) if sched is not None else now - req.arrival,
                prefill_s=(first - sched) if (first is not None and sched is not None) else 0.0,
                decode_s=(now - first) if first is not None else 0.0,
                total_s=now - req.arrival,
            ),
        )
        self.hook.observe(result, group=req.group)


def overload_scenario(
    *,
    heavy: str = "de",
    light: str = "en",
    overload: float = 3.0,
    light_share_fraction: float = 0.1,
    light_group: int = 1,
    duration_s: float = 120.0,
    warmup_s: float = 20.0,
    seed: int = 0,
    cost: CostModel | None = None,
    max_batch: int = 8,
    token_budget: int = 256,
    prompt_tokens: tuple[int, int] = (40, 80),
    output_tokens: tuple[int, int] = (10, 30),
    cached_prefix_tokens: int = 32,
    burst_tokens: float = 256.0,
    admission: bool = True,
    slo_s: Mapping[str, float] | None = None,
) -> SimConfig:
    """Issue 25 in small: `heavy` offers `overload` x the engine's capacity, `light` a
    `light_share_fraction` of its weighted share of it (in groups of `light_group` requests
    arriving together: a chat turn split into segments) (weights and SLOs of DEFAULT_POLICIES
    unless `slo_s` says otherwise); every request's deadline is arrival + its SLO; the VTC queue
    with the worker's burst credit; the worker's deadline admission when `admission`."""
    cost = cost or CostModel()
    uncached = sum(prompt_tokens) / 2 - cached_prefix_tokens
    cap = estimate_capacity_rps(uncached, sum(output_tokens) / 2, token_budget, max_batch, cost)
    w = {g: DEFAULT_POLICIES[g].weight for g in (heavy, light)}
    slo = {g: DEFAULT_POLICIES[g].slo_p99_s for g in (heavy, light)} | dict(slo_s or {})
    rates = {heavy: overload * cap, light: light_share_fraction * cap * w[light] / sum(w.values())}
    langs = {
        g: LanguageLoad(
            rate_rps=rates[g],
            weight=w[g],
            slo_s=slo[g],
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            cached_prefix_tokens=cached_prefix_tokens,
            group_size=light_group if g == light else 1,
        )
        for g in (heavy, light)
    }
    return SimConfig(
        languages=langs,
        duration_s=duration_s,
        warmup_s=warmup_s,
        drain_s=max(slo.values()) * 2,
        token_budget=token_budget,
        max_batch=max_batch,
        cost=cost,
        seed=seed,
        drop_expired=True,
        burst_tokens=burst_tokens,
        admission=admission,
    )
