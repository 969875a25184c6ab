"""The simulator and the real engine admit the same requests in the same order.

`workers.serving.simulate` drives the engine's own `Scheduler` and `KVCacheManager` with a
simulated clock; here the real `Engine` (a tiny random Llama, so no weights to load) runs the
same scripted arrivals through a VTC queue, step by step, and both must pop the queue in the
same order, charge each language the same service and preempt as often. The simulator's step
cost is one second flat, so its step `k` starts at t = k and a request scripted at `at_s = k`
is pushed before step `k`, exactly where the engine test submits it.

What the simulator models, the test reproduces on the engine: each language's prompt is its
prefix followed by the request's own tokens (the first one unique, so requests share nothing but
the prefix), the prefixes are computed once before the first arrival (`Engine.warm` with token
ids instead of text; the tiny model has no tokenizer) and every request generates exactly its
output length (`ignore_eos`).
"""

from __future__ import annotations

from typing import Any

import pytest

from workers.engine.engine import Engine, EngineConfig
from workers.engine.types import GenerationRequest, RequestHandle, SamplingParams
from workers.fairness.vtc import VTCQueue
from workers.serving.sim_config import CostModel, LanguageLoad, ScriptedArrival, SimConfig
from workers.serving.simulate import simulate

WEIGHTS = {"de": 3.0, "fr": 2.0, "it": 1.0}
# prefix lengths that end inside a block (16 tokens): the partial-block hit is exercised too
PREFIX_IDS = {
    "de": list(range(1, 21)),  # 20 tokens
    "fr": list(range(30, 54)),  # 24
    "it": list(range(60, 79)),  # 19
}
BATCH = 3  # max_num_seqs
BUDGET = 32  # max_num_batched_tokens: longer prompts prefill in chunks

# (step, language, own prompt tokens, output tokens): bursts that backlog all three languages,
# a pause that empties the queue, then a late burst
SCRIPT = [
    *[(0, "de", 6 + i, 3 + i % 3) for i in range(5)],
    *[(0, "fr", 9 + i, 2 + i % 4) for i in range(4)],
    *[(2, "it", 12 + i, 4) for i in range(3)],
    *[(4, "de", 3 + i, 5) for i in range(3)],
    *[(6, "fr", 25, 3) for _ in range(2)],  # a long prompt: three prefill chunks
    *[(40, "it", 5, 2) for _ in range(2)],
    *[(40, "de", 7, 3) for _ in range(3)],
    (41, "fr", 4, 6),
]


class RecordingVTC(VTCQueue):
    """VTCQueue that remembers the request ids it handed out, in order."""

    def __init__(self) -> None:
        super().__init__(WEIGHTS)
        self.popped: list[str] = []

    def pop(self) -> GenerationRequest:
        request = super().pop()
        self.popped.append(request.request_id)
        return request


def scripted() -> list[ScriptedArrival]:
    return [
        ScriptedArrival(
            at_s=float(step),
            lang=lang,
            prompt_tokens=len(PREFIX_IDS[lang]) + own,
            output_tokens=out,
            request_id=f"{lang}-{k:02d}",
        )
        for k, (step, lang, own, out) in enumerate(SCRIPT)
    ]


def push_order() -> list[ScriptedArrival]:
    """The order the simulator pushes arrivals in: (arrival, language, request id)."""
    return sorted(scripted(), key=lambda a: (a.at_s, a.lang, a.request_id))


def run_simulator(kv_cache_tokens: int) -> tuple[RecordingVTC, int]:
    queue = RecordingVTC()
    config = SimConfig(
        languages={
            g: LanguageLoad(rate_rps=0.0, weight=w, cached_prefix_tokens=len(PREFIX_IDS[g]))
            for g, w in WEIGHTS.items()
        },
        duration_s=100.0,
        warmup_s=0.0,
        drain_s=1000.0,
        token_budget=BUDGET,
        max_batch=BATCH,
        cost=CostModel(step_base_s=1.0, prefill_s_per_token=0.0, batch_s_per_seq=0.0),
        scripted=tuple(scripted()),
        kv_cache_tokens=kv_cache_tokens,
    )
    result = simulate(config, queue)
    assert queue.popped[:3] == ["warm-de", "warm-fr", "warm-it"]  # the prefixes, before t = 0
    del queue.popped[:3]
    assert sum(r.completed for r in result.languages.values()) == len(SCRIPT)
    return queue, result.preemptions


def run_engine(loaded: Any, kv_cache_tokens: int) -> tuple[RecordingVTC, int, int]:
    queue = RecordingVTC()
    engine = Engine(
        loaded,
        EngineConfig(
            kv_cache_tokens=kv_cache_tokens, max_num_seqs=BATCH, max_num_batched_tokens=BUDGET
        ),
        request_queue=queue,
    )
    warm = SamplingParams(max_new_tokens=1, ignore_eos=True, stop_at_newline=False)
    engine.generate([GenerationRequest(f"warm-{g}", PREFIX_IDS[g], warm) for g in sorted(WEIGHTS)])
    queue.popped.clear()
    pending = push_order()
    handles: list[RequestHandle] = []
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0].at_s <= step:
            a = pending.pop(0)
            # own tokens: the first one unique, so requests share nothing but their prefix
            n_own = a.prompt_tokens - len(PREFIX_IDS[a.lang])
            own = [100 + len(handles), *range(200, 200 + n_own - 1)]
            params = SamplingParams(
                max_new_tokens=a.output_tokens, ignore_eos=True, stop_at_newline=False
            )
            prompt = PREFIX_IDS[a.lang] + own
            handles.append(
                engine.submit(GenerationRequest(a.request_id, prompt, params, group=a.lang))
            )
        engine.step()
        step += 1
    prefix_hits = 0  # requests whose language prefix came from the cache, partial block too
    for a, handle in zip(push_order(), handles, strict=True):
        result = handle.result(0)
        assert result.ok and result.tokens_out == a.output_tokens
        assert result.tokens_in == a.prompt_tokens
        prefix_hits += result.cached_tokens >= len(PREFIX_IDS[a.lang])
    return queue, engine.stats.preemptions, prefix_hits


@pytest.mark.parametrize("kv_cache_tokens", [2048, 80], ids=["roomy-kv", "tight-kv"])
def test_simulator_admits_in_the_engines_order(
    kv_cache_tokens: int, tiny_config: Any, tiny_models: Any
) -> None:
    _, loaded = tiny_models(tiny_config("llama", vocab_size=512))
    engine_queue, engine_preemptions, prefix_hits = run_engine(loaded, kv_cache_tokens)
    sim_queue, sim_preemptions = run_simulator(kv_cache_tokens)

    assert sorted(engine_queue.popped) == sorted(a.request_id for a in scripted())
    assert sim_queue.popped == engine_queue.popped
    arrival_order = [a.request_id for a in push_order()]
    assert engine_queue.popped != arrival_order  # VTC reordered them: not FCFS
    # the same service charged per language (uncached prompt tokens + 2 x output tokens)
    assert sim_queue.service_by_group() == pytest.approx(engine_queue.service_by_group())
    assert sim_queue.counters() == pytest.approx(engine_queue.counters())
    assert sim_preemptions == engine_preemptions
    if kv_cache_tokens < 512:  # the tight pool: preemption, recompute, evicted prefixes
        assert engine_preemptions > 0
        assert 0 < prefix_hits < len(SCRIPT)
    else:
        assert engine_preemptions == 0
        assert prefix_hits == len(SCRIPT)
