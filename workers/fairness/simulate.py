"""A fast, deterministic simulation of a continuous-batching engine fed by a RequestQueue.

It answers "what does VTC buy over FCFS" without a model or Kafka: per-language weighted service,
throughput, latency percentiles, SLO attainment per window, and Jain's index of weight-normalized
service over the backlogged languages. `bench/fairness.py` drives it with measured constants.

The engine model follows vLLM v1's scheduler, step by step:

- A step has a token budget and a maximum batch size. Running requests go first: each decoding
  request takes one token, each partially prefilled request its next prefill chunk. Then new
  requests are admitted from the queue (`peek()` / `pop()`) while a batch slot and budget are
  left; each gets a prefill chunk of what remains of the budget.
- The step that finishes a request's prefill also yields its first output token; every later
  step yields one more, until its output length is reached.
- Step time = a + b * prefill_tokens + c * batch_size (`CostModel`; the defaults are the CPU
  anchors of PITFALLS, a benchmark passes its measured ones).
- After the step, each scheduled request is charged `charge(req, prefill_chunk, tokens_out)`,
  as the engine does; prompt tokens covered by the language's cached prefix are neither computed
  nor charged.
- Arrivals are open loop (PITFALLS: no coordinated omission): Poisson per language with its own
  seeded generator, plus an optional burst already waiting at t = 0. A request's deadline is
  arrival + the language's SLO; with `drop_expired` the admission loop drops requests whose
  deadline passed before prefill (the deadline rule of the engine).

Measurement: service and throughput count steps that start inside [warmup_s, duration_s);
latency and SLO numbers count requests arriving in that window. A request still unfinished when
the run ends enters the latency percentiles with its age at the end (a lower bound) rather than
being censored away, so an ever-growing FCFS queue shows in the tail. A language counts as
backlogged when requests of it were left waiting after admission for at least
`backlog_fraction` of the measured time.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from workers.engine.types import GenerationRequest, RequestQueue
from workers.fairness.policy import DEFAULT_POLICIES
from workers.fairness.vtc import OUTPUT_TOKEN_COST, FCFSQueue, VTCQueue, jain_index

__all__ = [
    "CostModel",
    "LanguageLoad",
    "LanguageResult",
    "SimConfig",
    "SimResult",
    "estimate_capacity_rps",
    "issue_scenario",
    "make_queue",
    "simulate",
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
    slo_s: float = 5.0  # latency target; also sets each request's deadline
    prompt_tokens: tuple[int, int] = (60, 100)  # uniform, inclusive
    output_tokens: tuple[int, int] = (20, 40)  # uniform, inclusive
    cached_prefix_tokens: int = 0  # prompt tokens served by the prefix cache (not computed)
    burst: int = 0  # requests already waiting at t = 0


@dataclass(frozen=True)
class SimConfig:
    languages: Mapping[str, LanguageLoad]  # lang -> load
    queue: str = "vtc"  # "vtc" or "fcfs" (ignored when simulate() is given a queue)
    duration_s: float = 300.0  # arrivals stop here; measurement window ends here
    warmup_s: float = 30.0  # measurement window starts here
    drain_s: float = 0.0  # keep stepping this long after duration_s
    token_budget: int = 256  # tokens per step (decode + prefill)
    max_batch: int = 32  # sequences per step
    cost: CostModel = field(default_factory=CostModel)
    seed: int = 0
    window_s: float = 30.0  # SLO attainment window (by arrival time)
    drop_expired: bool = False  # drop requests whose deadline passed before admission
    backlog_fraction: float = 0.9  # share of measured time waiting to count as backlogged
    burst_tokens: float = 0.0  # VTC burst credit (see VTCQueue); the worker's default is 256


@dataclass(slots=True)
class LanguageResult:
    weight: float
    slo_s: float
    arrived: int  # arrivals inside the measurement window
    completed: int  # of those, finished
    expired: int  # of those, dropped at admission (drop_expired)
    unfinished: int  # of those, still waiting or running at the end
    service: float  # weighted tokens served in the window (prefill + 2 * output)
    normalized_service: float  # service / weight
    output_tokens: int  # tokens generated in the window
    backlogged_fraction: float  # share of measured time with requests left waiting
    latency_p50_s: float
    latency_p95_s: float
    latency_p99_s: float
    latency_p999_s: float
    queue_p50_s: float  # arrival -> admission, admitted requests only
    queue_p99_s: float
    slo_attainment: float  # met / decided (nan if none decided)
    window_attainment: list[float]  # per window_s window, by arrival (nan: none decided)


@dataclass(slots=True)
class SimResult:
    queue: str
    sim_end_s: float
    steps: int
    throughput_tokens_s: float  # output tokens per second in the window
    service_tokens_s: float  # weighted service per second in the window
    completed_rps: float  # requests finished per second in the window
    backlogged: list[str]  # languages backlogged for >= backlog_fraction of the window
    jain_index: float  # over the backlogged languages' normalized service
    service_ratio: dict[str, float]  # backlogged lang -> normalized service / their mean
    languages: dict[str, LanguageResult]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: nan and inf become None."""
        return _jsonable(asdict(self))


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def make_queue(
    kind: str, weights: Mapping[str, float], burst_tokens: float = 0.0
) -> VTCQueue | FCFSQueue:
    if kind == "vtc":
        return VTCQueue(weights, burst_tokens=burst_tokens)
    if kind == "fcfs":
        return FCFSQueue(weights)
    raise ValueError(f"unknown queue kind {kind!r} (expected 'vtc' or 'fcfs')")


@dataclass(slots=True)
class _Req:
    request: GenerationRequest
    lang: str
    uncached: int  # prompt tokens to compute
    out_len: int
    arrival: float
    slo_s: float
    prefill_left: int = 0
    out_done: int = 0
    admitted: float = math.nan
    finish: float = math.nan
    expired: bool = False


def _arrivals(config: SimConfig) -> list[_Req]:
    reqs: list[_Req] = []
    for lang in sorted(config.languages):
        load = config.languages[lang]
        rng = random.Random(f"{config.seed}:{lang}")  # str seeds are stable across runs
        times = [0.0] * load.burst
        t = 0.0
        if load.rate_rps > 0:
            while True:
                t += rng.expovariate(load.rate_rps)
                if t >= config.duration_s:
                    break
                times.append(t)
        for i, at in enumerate(times):
            prompt = rng.randint(*load.prompt_tokens)
            out = max(1, rng.randint(*load.output_tokens))
            uncached = max(1, prompt - load.cached_prefix_tokens)  # the last token is computed
            request = GenerationRequest(
                request_id=f"{lang}-{i}",
                prompt_ids=[],  # lengths live in _Req; the queues never read the ids
                group=lang,
                deadline=at + load.slo_s,
                arrival=at,
                expected_output_tokens=out,
            )
            reqs.append(_Req(request, lang, uncached, out, at, load.slo_s, prefill_left=uncached))
    reqs.sort(key=lambda r: (r.arrival, r.lang, r.request.request_id))
    return reqs


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def simulate(config: SimConfig, queue: RequestQueue | None = None) -> SimResult:
    """Run the simulation; deterministic for a given config (and queue state)."""
    if config.token_budget < config.max_batch or config.max_batch < 1:
        raise ValueError("need max_batch >= 1 and token_budget >= max_batch")
    if not 0 <= config.warmup_s < config.duration_s:
        raise ValueError("need 0 <= warmup_s < duration_s")
    langs = sorted(config.languages)
    kind = config.queue if queue is None else type(queue).__name__
    if queue is None:
        queue = make_queue(
            config.queue, {g: config.languages[g].weight for g in langs}, config.burst_tokens
        )
    arrivals = _arrivals(config)
    end = config.duration_s + config.drain_s
    cost = config.cost
    warm, stop = config.warmup_s, config.duration_s

    service = dict.fromkeys(langs, 0.0)
    out_tokens = dict.fromkeys(langs, 0)
    waiting_time = dict.fromkeys(langs, 0.0)
    waiting: dict[str, int] = dict.fromkeys(langs, 0)  # queued (not running) per language
    measured_time = 0.0
    completed_in_window = 0
    by_id = {r.request.request_id: r for r in arrivals}

    t = 0.0
    ai = 0
    steps = 0
    running: list[_Req] = []
    while True:
        while ai < len(arrivals) and arrivals[ai].arrival <= t:
            r = arrivals[ai]
            queue.push(r.request)
            waiting[r.lang] += 1
            ai += 1
        if t >= end:
            break
        if not running and len(queue) == 0:
            if ai >= len(arrivals):
                break
            t = arrivals[ai].arrival  # idle: jump to the next arrival
            continue

        # -- schedule one step: running first, then admissions --------------------------------
        budget = config.token_budget
        scheduled: list[tuple[_Req, int]] = []  # (request, prefill chunk)
        prefill = 0
        for r in running:
            if r.prefill_left == 0:
                budget -= 1
                scheduled.append((r, 0))
        for r in running:
            if r.prefill_left > 0 and budget > 0:
                chunk = min(r.prefill_left, budget)
                budget -= chunk
                prefill += chunk
                scheduled.append((r, chunk))
        while len(running) < config.max_batch and budget > 0:
            head = queue.peek()
            if head is None:
                break
            queue.pop()
            r = by_id[head.request_id]
            waiting[r.lang] -= 1
            if config.drop_expired and head.deadline is not None and head.deadline <= t:
                r.expired = True
                continue
            r.admitted = t
            running.append(r)
            chunk = min(r.prefill_left, budget)
            budget -= chunk
            prefill += chunk
            scheduled.append((r, chunk))

        dt = cost.step_time(prefill, len(scheduled))
        t_start = t
        t += dt
        steps += 1
        in_window = warm <= t_start < stop
        if in_window:
            measured_time += dt
            for g in langs:
                if waiting[g] > 0:
                    waiting_time[g] += dt

        # -- finish the step: tokens out, charges, completions -------------------------------
        finished = False
        for r, chunk in scheduled:
            r.prefill_left -= chunk
            produced = 1 if r.prefill_left == 0 else 0
            r.out_done += produced
            queue.charge(r.request, chunk, produced)
            if in_window:
                service[r.lang] += chunk + OUTPUT_TOKEN_COST * produced
                out_tokens[r.lang] += produced
            if r.out_done >= r.out_len:
                r.finish = t
                finished = True
                if in_window:
                    completed_in_window += 1
        if finished:
            running = [r for r in running if math.isnan(r.finish)]

    return _summarize(
        config,
        kind,
        arrivals,
        t,
        steps,
        service,
        out_tokens,
        waiting_time,
        measured_time,
        completed_in_window,
    )


def _summarize(
    config: SimConfig,
    kind: str,
    arrivals: list[_Req],
    sim_end: float,
    steps: int,
    service: dict[str, float],
    out_tokens: dict[str, int],
    waiting_time: dict[str, float],
    measured_time: float,
    completed_in_window: int,
) -> SimResult:
    warm, stop = config.warmup_s, config.duration_s
    n_windows = max(1, math.ceil((stop - warm) / config.window_s))
    per_lang: dict[str, LanguageResult] = {}
    for lang in sorted(config.languages):
        load = config.languages[lang]
        lat: list[float] = []
        waits: list[float] = []
        arrived = completed = expired = unfinished = met = decided = 0
        win_met = [0] * n_windows
        win_decided = [0] * n_windows
        for r in arrivals:
            if r.lang != lang or not warm <= r.arrival < stop:
                continue
            arrived += 1
            if not math.isnan(r.admitted):
                waits.append(r.admitted - r.arrival)
            w = min(n_windows - 1, int((r.arrival - warm) // config.window_s))
            if r.expired:
                expired += 1
                ok: bool | None = False
            elif not math.isnan(r.finish):
                completed += 1
                lat.append(r.finish - r.arrival)
                ok = r.finish - r.arrival <= r.slo_s
            else:
                unfinished += 1
                age = sim_end - r.arrival
                lat.append(age)  # lower bound on its latency
                ok = False if age > r.slo_s else None  # None: can still make it
            if ok is not None:
                decided += 1
                win_decided[w] += 1
                if ok:
                    met += 1
                    win_met[w] += 1
        per_lang[lang] = LanguageResult(
            weight=load.weight,
            slo_s=load.slo_s,
            arrived=arrived,
            completed=completed,
            expired=expired,
            unfinished=unfinished,
            service=service[lang],
            normalized_service=service[lang] / load.weight,
            output_tokens=out_tokens[lang],
            backlogged_fraction=waiting_time[lang] / measured_time if measured_time else 0.0,
            latency_p50_s=_percentile(lat, 50),
            latency_p95_s=_percentile(lat, 95),
            latency_p99_s=_percentile(lat, 99),
            latency_p999_s=_percentile(lat, 99.9),
            queue_p50_s=_percentile(waits, 50),
            queue_p99_s=_percentile(waits, 99),
            slo_attainment=met / decided if decided else math.nan,
            window_attainment=[
                m / d if d else math.nan for m, d in zip(win_met, win_decided, strict=True)
            ],
        )
    backlogged = [
        g for g, res in per_lang.items() if res.backlogged_fraction >= config.backlog_fraction
    ]
    norm = [per_lang[g].normalized_service for g in backlogged]
    mean = sum(norm) / len(norm) if norm else 0.0
    span = measured_time or math.nan
    return SimResult(
        queue=kind,
        sim_end_s=sim_end,
        steps=steps,
        throughput_tokens_s=sum(out_tokens.values()) / span,
        service_tokens_s=sum(service.values()) / span,
        completed_rps=completed_in_window / span,
        backlogged=backlogged,
        jain_index=jain_index(norm),
        service_ratio={
            g: (per_lang[g].normalized_service / mean if mean else math.nan) for g in backlogged
        },
        languages=per_lang,
    )


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
