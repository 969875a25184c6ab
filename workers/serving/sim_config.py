"""What a simulation is given: its config, step costs, languages' loads and scenarios.

The inputs of `workers/serving/simulate.py`'s `simulate()` (see its notes for what the run
does with them), apart from the loop so that the loop's helpers (`sim_admission.py`,
`sim_results.py`) and the loop itself import them from here, not from each other:

- `CostModel`: an engine step's time, `a + b * prefill_tokens + c * batch_size`; the defaults
  are CPU anchors measured on the development machine, a benchmark passes its own measured ones.
- `LanguageLoad` (Poisson rate, weight, SLO, prompt/output length ranges, cached prefix,
  burst), `ScriptedArrival` (one request at a set time) and `SimConfig` (languages, queue
  kind, durations, the scheduler's budget and batch cap, KV pool, deadline admission).
- `make_queue`: the fair-share queue (`VTCQueue`) or the FCFS baseline for a run.
- `estimate_capacity_rps`: requests per second a saturated engine finishes, and
  `issue_scenario`: the fairness issue's four languages at a multiple of that capacity.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from workers.fairness.policy import DEFAULT_POLICIES
from workers.fairness.vtc import FCFSQueue, VTCQueue

__all__ = [
    "CostModel",
    "LanguageLoad",
    "ScriptedArrival",
    "SimConfig",
    "estimate_capacity_rps",
    "issue_scenario",
    "make_queue",
]


@dataclass(frozen=True, slots=True)
class CostModel:
    """Engine step time = step_base_s + prefill_s_per_token * prefill + batch_s_per_seq * batch."""

    step_base_s: float = 0.009  # a: fixed cost of a forward (weights read once)
    prefill_s_per_token: float = 0.0045  # b: per prompt token computed in the step
    batch_s_per_seq: float = 0.0027  # c: per sequence in the batch (its decode token, its KV)

    def step_time(self, prefill_tokens: int, batch_size: int) -> float:
        return (
            self.step_base_s
            + self.prefill_s_per_token * prefill_tokens
            + self.batch_s_per_seq * batch_size
        )


@dataclass(frozen=True, slots=True)
class LanguageLoad:
    """Offered load and shape of one language's traffic."""

    rate_rps: float  # Poisson arrival rate, requests per second (0 = none)
    weight: float = 1.0  # fair-share weight given to the queue
    slo_s: float = 5.0  # latency target; with drop_expired also each request's deadline
    prompt_tokens: tuple[int, int] = (60, 100)  # uniform, inclusive
    output_tokens: tuple[int, int] = (20, 40)  # uniform, inclusive
    # the language's shared prompt prefix, warmed into the prefix cache at start-up; a prompt
    # is this prefix + max(1, prompt_tokens - cached_prefix_tokens) tokens of its own
    cached_prefix_tokens: int = 0
    burst: int = 0  # requests already waiting at t = 0
    group_size: int = 1  # requests per Poisson arrival (a chat turn split into segments)


@dataclass(frozen=True, slots=True)
class ScriptedArrival:
    """One request at a set time (in addition to the Poisson and burst arrivals)."""

    at_s: float  # arrival time
    lang: str  # must be one of SimConfig.languages (its prefix, SLO and weight apply)
    prompt_tokens: int  # as LanguageLoad.prompt_tokens: the cached prefix included
    output_tokens: int  # exact output length
    request_id: str = ""  # "" = f"{lang}-s{index in SimConfig.scripted}"


@dataclass(frozen=True)
class SimConfig:
    languages: Mapping[str, LanguageLoad]  # lang -> load
    queue: str = "vtc"  # "vtc" or "fcfs" (ignored when simulate() is given a queue)
    duration_s: float = 300.0  # arrivals stop here; measurement window ends here
    warmup_s: float = 30.0  # measurement window starts here
    drain_s: float = 0.0  # keep stepping this long after duration_s
    token_budget: int = 256  # tokens per step (decode + prefill), the scheduler's budget
    max_batch: int = 32  # sequences per step, the scheduler's max_num_seqs
    cost: CostModel = field(default_factory=CostModel)
    seed: int = 0
    window_s: float = 30.0  # SLO attainment window (by arrival time)
    drop_expired: bool = False  # give requests deadlines: expired ones are dropped at admission
    backlog_fraction: float = 0.9  # share of measured time waiting to count as backlogged
    burst_tokens: float = 0.0  # VTC burst credit (see VTCQueue); the worker's default is 256
    scripted: tuple[ScriptedArrival, ...] = ()  # requests at set times
    block_size: int = 16  # tokens per KV block (EngineConfig.block_size)
    kv_cache_tokens: int = 0  # KV pool size as EngineConfig's; 0 = enough for a full batch
    max_model_len: int = 2048  # prompt + output cap per sequence (EngineConfig.max_model_len)
    # the worker's deadline admission (sim_admission.py): deadlines = arrival + SLO, a precheck
    # at submission (refused: REJECTED, never queued), the scheduler's hook, learning on finish
    admission: bool = False


def make_queue(
    kind: str, weights: Mapping[str, float], burst_tokens: float = 0.0
) -> VTCQueue | FCFSQueue:
    if kind == "vtc":
        return VTCQueue(weights, burst_tokens=burst_tokens)
    if kind == "fcfs":
        return FCFSQueue(weights)
    raise ValueError(f"unknown queue kind {kind!r} (expected 'vtc' or 'fcfs')")


def estimate_capacity_rps(
    prompt_tokens: float,
    output_tokens: float,
    token_budget: int = 256,
    max_batch: int = 32,
    cost: CostModel | None = None,
) -> float:
    """Requests per second a saturated engine finishes, for mean prompt/output lengths.

    Steady state with a full batch: a request holds a slot for `output_tokens` steps (its
    prefill step yields the first token), so max_batch / output_tokens requests finish and
    start per step, each prefilling `prompt_tokens`; the token budget may cap that.
    """
    cost = cost or CostModel()
    out = max(1.0, output_tokens)
    starts = max_batch / out  # admissions per step when decode-bound
    if prompt_tokens > 1 and (max_batch - starts) + starts * prompt_tokens > token_budget:
        starts = max(1e-9, (token_budget - max_batch) / (prompt_tokens - 1))  # prefill-bound
    step = cost.step_time(int(round(starts * prompt_tokens)), max_batch)
    return starts / step


def issue_scenario(
    queue: str = "vtc",
    *,
    overload: float = 3.0,
    light_fraction: float = 0.05,
    duration_s: float = 300.0,
    warmup_s: float = 30.0,
    seed: int = 0,
    cost: CostModel | None = None,
    token_budget: int = 256,
    max_batch: int = 32,
    prompt_tokens: tuple[int, int] = (60, 100),
    output_tokens: tuple[int, int] = (20, 40),
    burst_tokens: float = 0.0,
) -> SimConfig:
    """The issue's scenario: weights de 4, fr 3, es 2, it 1; de, fr and es together offer
    `overload` x the engine's capacity (equal rates), Italian is light (`light_fraction` of
    capacity). SLOs from DEFAULT_POLICIES."""
    cost = cost or CostModel()
    cap = estimate_capacity_rps(
        sum(prompt_tokens) / 2, sum(output_tokens) / 2, token_budget, max_batch, cost
    )
    heavy = overload * cap / 3
    rates = {"de": heavy, "fr": heavy, "es": heavy, "it": light_fraction * cap}
    weights = {"de": 4.0, "fr": 3.0, "es": 2.0, "it": 1.0}
    langs = {
        g: LanguageLoad(
            rate_rps=rates[g],
            weight=weights[g],
            slo_s=DEFAULT_POLICIES[g].slo_p99_s,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
        )
        for g in rates
    }
    return SimConfig(
        languages=langs,
        queue=queue,
        duration_s=duration_s,
        warmup_s=warmup_s,
        token_budget=token_budget,
        max_batch=max_batch,
        cost=cost,
        seed=seed,
        burst_tokens=burst_tokens,
    )
