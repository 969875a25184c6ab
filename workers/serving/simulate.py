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
  defaults are CPU anchors measured on a 2-thread CPU: prompt ~220 tok/s, decode step ~9 ms +
  ~2.7 ms per sequence; a benchmark passes its measured ones). A step's
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
- Arrivals are open loop (no coordinated omission: a slow engine does not slow the arrivals):
  Poisson per language with its own seeded generator, an optional burst already waiting at
  t = 0, and optional scripted arrivals (`ScriptedArrival`). They are pushed in order of (arrival
  time, language, request id) before the first step that starts at or after their arrival. A
  request's SLO is the language's; with `drop_expired` its deadline is arrival + SLO and the
  scheduler expires it if that passed before admission (the engine's deadline rule), otherwise
  it has no deadline.

What a run is given lives in `sim_config.py` (the `SimConfig`, its `CostModel` and
`LanguageLoad`s, the queue it builds, the capacity estimate and the issue's scenario);
measurement (what counts, in which window, backlog, the unfinished requests' latency) is
`sim_results.py`'s part: its `summarize` turns the loop's counters and `RequestRecord`s into
the `SimResult`; deadline admission is `sim_admission.py`'s. This module is the loop alone.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator

from workers.engine.kv_cache import KVCacheManager, KVGroupSpec
from workers.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, SequenceState
from workers.engine.types import FinishReason, GenerationRequest, RequestQueue, SamplingParams
from workers.fairness.vtc import OUTPUT_TOKEN_COST
from workers.serving.sim_admission import SimAdmission
from workers.serving.sim_config import SimConfig, make_queue
from workers.serving.sim_results import RequestRecord, SimResult, summarize

__all__ = ["simulate"]

_OUTPUT_TOKEN_ID = 0  # what every simulated step samples; prompt ids start at 1
_DONE = (FinishReason.STOP, FinishReason.LENGTH)


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


def _sampled(out: SchedulerOutput) -> dict[str, list[int]]:
    return {c.seq.request_id: [_OUTPUT_TOKEN_ID] for c in out.chunks if c.samples}


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
