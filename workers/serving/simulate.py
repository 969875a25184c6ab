"""A fast, deterministic simulation of the engine fed by a RequestQueue: the real scheduler,
no model.

It answers "what does VTC buy over FCFS" without a model or Kafka: per-language weighted service,
throughput, latency percentiles, SLO attainment per window, and Jain's index of weight-normalized
service over the backlogged languages. `bench/fairness.py` drives it with measured constants.

What runs is the engine's own `Scheduler` (workers/engine/scheduler.py) over its own
`KVCacheManager`, driven the way `Engine.step` drives them, so the simulation cannot drift from
the engine's admission rules (token budget, batch cap, chunked prefill, running requests first,
prefix-cache hits, expiry before prefill, preemption when KV blocks run out). Only the model is
replaced:

- The clock is simulated: the scheduler reads it (admission times, deadlines) and each step
  advances it by the step's cost, `a + b * prefill_tokens + c * batch_size` (`CostModel`; the
  defaults are the CPU anchors of PITFALLS, a benchmark passes its measured ones). A step's
  prefill tokens are counted as the engine's stats count them: every computed token except one
  per decoding sequence.
- Every sequence whose chunk reaches the end of its known tokens gets one output token (so the
  step that finishes a prefill yields the first one), until its output length is reached (the
  engine's `max_new_tokens` stop rule with `ignore_eos`). Token ids are synthetic: each prompt is
  its language's prefix followed by `max(1, prompt_tokens - cached_prefix_tokens)` fresh ids, so
  the prefix cache shares exactly the language prefixes.
- Start-up: each language's prefix is computed once before t = 0 (as `Engine.warm` does, through
  the same scheduler and queue, charged to group ""), without advancing the clock.
- The KV pool has one full-attention group with `block_size`-token blocks: `kv_cache_tokens` as
  the engine sizes it, or (0, the default) big enough for a full batch of the longest requests,
  so nothing is preempted. Prefix caching (partial blocks included) is on as in the engine, and
  skipped when no language has a prefix (no hit is possible then; hashing would only cost time).
- The queue is charged by the scheduler, as in the engine: uncached prompt tokens at admission,
  output tokens as decoded.
- Arrivals are open loop (PITFALLS: no coordinated omission): Poisson per language with its own
  seeded generator, an optional burst already waiting at t = 0, and optional scripted arrivals
  (`ScriptedArrival`). They are pushed in order of (arrival time, language, request id) before
  the first step that starts at or after their arrival. A request's SLO is the language's; with
  `drop_expired` its deadline is arrival + SLO and the scheduler expires it if that passed
  before admission (the engine's deadline rule), otherwise it has no deadline.

Measurement (what counts, in which window, backlog, the unfinished requests' latency) is
`sim_results.py`'s part: its `summarize` turns the loop's counters and `RequestRecord`s into
the `SimResult`, whose records this module re-exports.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from workers.engine.kv_cache import KVCacheManager, KVGroupSpec
from workers.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, SequenceState
from workers.engine.types import FinishReason, GenerationRequest, RequestQueue, SamplingParams
from workers.fairness.policy import DEFAULT_POLICIES
from workers.fairness.vtc import OUTPUT_TOKEN_COST, FCFSQueue, VTCQueue
from workers.serving.sim_admission import SimAdmission
from workers.serving.sim_results import LanguageResult, RequestRecord, SimResult, summarize

__all__ = [
    "CostModel",
    "LanguageLoad",
    "LanguageResult",
    "ScriptedArrival",
    "SimConfig",
    "SimResult",
    "estimate_capacity_rps",
    "issue_scenario",
    "make_queue",
    "simulate",
]

_OUTPUT_TOKEN_ID = 0  # what every simulated step samples; prompt ids start at 1
_DONE = (FinishReason.STOP, FinishReason.LENGTH)


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


class _Clock:
    """The scheduler's clock: simulated seconds, set by the loop."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _prefixes(config: SimConfig, ids: Iterator[int]) -> dict[str, list[int]]:
    return {
        lang: [next(ids) for _ in range(config.languages[lang].cached_prefix_tokens)]
        for lang in sorted(config.languages)
    }


def _request(
    config: SimConfig,
    rid: str,
    lang: str,
    at: float,
    prompt: int,
    out: int,
    prefix: list[int],
    ids: Iterator[int],
) -> RequestRecord:
    load = config.languages[lang]
    own = max(1, prompt - len(prefix))  # the last prompt token is always computed
    request = GenerationRequest(
        request_id=rid,
        prompt_ids=prefix + [next(ids) for _ in range(own)],
        params=SamplingParams(max_new_tokens=max(1, out), stop_at_newline=False, ignore_eos=True),
        group=lang,
        deadline=at + load.slo_s if config.drop_expired or config.admission else None,
        arrival=at,
        expected_output_tokens=max(1, out),
    )
    return RequestRecord(request, lang, at, load.slo_s)


def _arrivals(
    config: SimConfig, prefixes: dict[str, list[int]], ids: Iterator[int]
) -> list[RequestRecord]:
    reqs: list[RequestRecord] = []
    for lang in sorted(config.languages):
        load = config.languages[lang]
        rng = random.Random(f"{config.seed}:{lang}")  # str seeds are stable across runs
        times = [0.0] * load.burst
        t = 0.0
        if load.rate_rps > 0:
            while True:  # groups of group_size at rate_rps / group_size: rate_rps requests/s
                t += rng.expovariate(load.rate_rps / max(1, load.group_size))
                if t >= config.duration_s:
                    break
                times.extend([t] * max(1, load.group_size))
        for i, at in enumerate(times):
            prompt = rng.randint(*load.prompt_tokens)
            out = rng.randint(*load.output_tokens)
            reqs.append(_request(config, f"{lang}-{i}", lang, at, prompt, out, prefixes[lang], ids))
    for k, s in enumerate(config.scripted):
        if s.lang not in config.languages:
            raise ValueError(f"scripted arrival {k}: language {s.lang!r} has no LanguageLoad")
        rid = s.request_id or f"{s.lang}-s{k}"
        prefix = prefixes[s.lang]
        reqs.append(
            _request(config, rid, s.lang, s.at_s, s.prompt_tokens, s.output_tokens, prefix, ids)
        )
    reqs.sort(key=lambda r: (r.arrival, r.lang, r.request.request_id))
    return reqs


def _kv_cache(
    config: SimConfig, reqs: list[RequestRecord], prefixes: dict[str, list[int]]
) -> KVCacheManager:
    bs = config.block_size
    if config.kv_cache_tokens > 0:
        num_blocks = math.ceil(config.kv_cache_tokens / bs) + 1  # + the null block, as the engine
    else:  # a full batch of the longest requests, the prefixes, and the partial-hit copies
        longest = max(
            (len(r.request.prompt_ids) + r.request.params.max_new_tokens for r in reqs), default=1
        )
        per_seq = math.ceil(longest / bs) + 2
        prefix_blocks = sum(math.ceil(len(p) / bs) for p in prefixes.values())
        num_blocks = config.max_batch * per_seq + prefix_blocks + 2
    # Without language prefixes no two prompts share a block (their ids are unique), so hashing
    # blocks could never find a hit: prefix caching is skipped then, which changes no decision.
    sharing = any(prefixes.values())
    return KVCacheManager(
        [KVGroupSpec("full", num_blocks, bs, None)],
        enable_prefix_caching=sharing,
        share_partial_blocks=sharing,
    )


def _stop_at_length(seq: SequenceState, token: int) -> tuple[FinishReason | None, bool]:
    """The engine's stop rule for an `ignore_eos` request: stop at max_new_tokens."""
    if len(seq.output_ids) + 1 >= seq.request.params.max_new_tokens:
        return FinishReason.LENGTH, True
    return None, True


def _sampled(out: SchedulerOutput) -> dict[str, int]:
    return {c.seq.request_id: _OUTPUT_TOKEN_ID for c in out.chunks if c.samples}


def _warm(scheduler: Scheduler, prefixes: dict[str, list[int]]) -> None:
    """`Engine.warm`: compute each language's prefix once (1 output token), before t = 0."""
    for lang in sorted(prefixes):
        if prefixes[lang]:
            params = SamplingParams(max_new_tokens=1)
            warm = GenerationRequest(f"warm-{lang}", prefixes[lang], params, arrival=0.0)
            scheduler.add_request(warm)
    while scheduler.has_work():
        out = scheduler.schedule()
        _check_progress(out, scheduler)
        scheduler.update_from_output(out, _sampled(out), _stop_at_length)


def _check_progress(out: SchedulerOutput, scheduler: Scheduler) -> None:
    if not out.chunks and not out.finished and not out.preempted:
        blocks = scheduler.kv.groups[0].num_blocks - 1
        raise ValueError(
            f"the KV cache ({blocks} blocks of {scheduler.kv.block_size} tokens) cannot hold "
            "the next waiting request: raise kv_cache_tokens"
        )


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
    ids = itertools.count(_OUTPUT_TOKEN_ID + 1)
    prefixes = _prefixes(config, ids)
    arrivals = _arrivals(config, prefixes, ids)
    by_id = {r.request.request_id: r for r in arrivals}
    clock = _Clock()
    scheduler = Scheduler(
        SchedulerConfig(config.max_batch, config.token_budget, config.max_model_len),
        _kv_cache(config, arrivals, prefixes),
        queue,
        clock=clock,
    )
    _warm(scheduler, prefixes)
    adm = None
    if config.admission:
        prefix_len = {g: len(p) for g, p in prefixes.items()}
        adm = SimAdmission(queue, clock, config.cost, prefix_len, config.block_size)
        scheduler.admission = adm.hook

    end = config.duration_s + config.drain_s
    cost = config.cost
    warm, stop = config.warmup_s, config.duration_s
    service = dict.fromkeys(langs, 0.0)
    out_tokens = dict.fromkeys(langs, 0)
    waiting_time = dict.fromkeys(langs, 0.0)
    waiting = dict.fromkeys(langs, 0)  # pushed and not yet admitted or dropped, per language
    measured_time = 0.0
    completed_in_window = 0
    preemptions = 0
    t = 0.0
    ai = 0
    steps = 0
    while True:
        while ai < len(arrivals) and arrivals[ai].arrival <= t:
            r = arrivals[ai]
            ai += 1
            if adm is not None and not adm.submit(r.request, t):
                r.expired = r.rejected = True  # answered REJECTED at once, never queued
                continue
            scheduler.add_request(r.request)
            waiting[r.lang] += 1
        if t >= end:
            break
        if not scheduler.has_work():
            if ai >= len(arrivals):
                break
            t = arrivals[ai].arrival  # idle: jump to the next arrival
            continue

        # -- one engine step: schedule, "run the model", update ---------------------------------
        clock.now = t
        out = scheduler.schedule()
        _check_progress(out, scheduler)
        preemptions += len(out.preempted)
        for seq in out.finished:  # dropped at admission: expired (or refused)
            r = by_id[seq.request_id]
            r.expired = True
            waiting[r.lang] -= 1
        for c in out.chunks:
            r = by_id[c.seq.request_id]
            if math.isnan(r.admitted) and c.seq.first_scheduled_at is not None:
                r.admitted = c.seq.first_scheduled_at
                waiting[r.lang] -= 1
        if not out.chunks:  # nothing to compute (only drops): no model step, no time passes
            scheduler.update_from_output(out, {}, _stop_at_length)
            continue

        # prefill tokens as the engine's stats count them: all but one per decoding sequence
        decoding = sum(1 for c in out.chunks if c.start >= c.seq.num_prompt_tokens)
        dt = cost.step_time(out.num_batched_tokens - decoding, len(out.chunks))
        t_start = t
        t += dt
        clock.now = t
        steps += 1
        in_window = warm <= t_start < stop
        if in_window:
            measured_time += dt
            # preempted after admission: waiting again (not in `waiting`, which counts the queue)
            resumed = {
                s.request.group for s in scheduler.preempted if s.first_scheduled_at is not None
            }
            for g in langs:
                if waiting[g] > 0 or g in resumed:
                    waiting_time[g] += dt
            for c in out.chunks:
                g = c.seq.request.group
                produced = 1 if c.samples else 0
                computed = c.num_tokens - (1 if c.start >= c.seq.num_prompt_tokens else 0)
                service[g] += computed + OUTPUT_TOKEN_COST * produced
                out_tokens[g] += produced

        for seq in scheduler.update_from_output(out, _sampled(out), _stop_at_length):
            if adm is not None:
                adm.finished(seq, t)
            if seq.finish_reason in _DONE:
                by_id[seq.request_id].finish = t
                if in_window:
                    completed_in_window += 1

    return summarize(
        config,
        kind,
        arrivals,
        t,
        steps,
        preemptions,
        service,
        out_tokens,
        waiting_time,
        measured_time,
        completed_in_window,
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
