"""Compiled decode steps (workers/engine/compiled.py) give the eager engine's tokens.

Tiny random Llama and Gemma 3 (sliding windows, two KV groups, soft-caps) against transformers,
and SmolLM2's real weights against the eager engine; int8 weights with the compiled path
against float32. Each compiles two graphs (batch 1 and a dynamic batch), ~20-60 s apiece on two
cores, so all are `slow`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.conftest import staggered_greedy
from workers.engine.compiled import CompiledDecode
from workers.engine.engine import Engine, EngineConfig
from workers.engine.loader import load_model
from workers.engine.types import GenerationRequest, SamplingParams

pytestmark = pytest.mark.slow

SENTENCES = [
    "The printer on the third floor stopped working after the update.",
    "Can you tell me when my order will arrive?",
    "I would like to cancel my subscription, please.",
    "My password does not work any more.",
    "Thank you for your quick help!",
]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_compiled_decode_matches_transformers(arch: str, tiny_config: Any, tiny_models: Any):
    hf, loaded = tiny_models(tiny_config(arch, vocab_size=512))
    attempts = torch._dynamo.utils.compilation_time_metrics
    attempts.pop("compile_attempt_1", None)  # a restarted trace (workers/engine/inductor_setup.py)
    engine = Engine(
        loaded, EngineConfig(kv_cache_tokens=2048, compile_decode=True, compile_max_batch=4)
    )
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (3, 9, 14, 20)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, stop_at_newline=False)
    first = engine.generate([GenerationRequest("alone", prompts[0], params)])  # batch-1 graph
    together = engine.generate(  # batches of 2-4 (dynamic graph), windows slide past 8
        [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts[1:])]
    )
    assert engine.stats.compiled_steps >= 2 * 19  # every decode step of both runs
    kinds = engine.stats.steps_by_kind  # the prefills ran eagerly, as steps of their own kind
    assert kinds["decode"] == engine.stats.compiled_steps and kinds["prefill"] >= 2
    assert sum(kinds.values()) == engine.stats.steps
    assert engine.stats.seconds_by_kind["decode"] > 0
    assert "compile_attempt_1" not in attempts  # each graph traced once, not twice
    with torch.inference_mode():
        for prompt, result in zip(prompts, first + together, strict=True):
            x = torch.tensor([prompt])
            y = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                            max_new_tokens=20, eos_token_id=None, pad_token_id=0)  # fmt: skip
            assert y[0, len(prompt) :].tolist() == result.token_ids


def _translate(engine: Engine, batch: bool) -> list[list[int]]:
    reqs = [engine.translation_request(s, "en", "de", max_new_tokens=24) for s in SENTENCES]
    if batch:
        return [r.token_ids for r in engine.generate(reqs)]
    return [engine.generate([r])[0].token_ids for r in reqs]


def test_compiled_decode_matches_eager_on_smollm2(smollm2: Any) -> None:
    eager = Engine(smollm2, EngineConfig(kv_cache_tokens=4096))
    expected = _translate(eager, batch=False)
    del eager
    engine = Engine(smollm2, EngineConfig(kv_cache_tokens=4096, compile_decode=True))
    assert _translate(engine, batch=False) == expected
    assert _translate(engine, batch=True) == expected  # 5 rows: the dynamic-batch graph
    assert engine.stats.compiled_steps > 0
    assert engine.stats.compiled_rows_steps > 0  # the queries' prefills after the first


def test_int8_compiled_engine_stays_close_to_float32(smollm2: Any) -> None:
    reference = _translate(Engine(smollm2, EngineConfig(kv_cache_tokens=4096)), batch=True)
    fresh = load_model("smollm2-135m", dtype=torch.float32)  # the swap converts in place
    # decode graphs only (the prefill and mixed graphs are checked on float32 weights above):
    # two compilations fewer in a suite that runs in a fresh checkout
    config = EngineConfig(
        kv_cache_tokens=4096, quantize="int8", compile_decode=True, compile_max_rows=0
    )
    engine = Engine(fresh, config)
    got = _translate(engine, batch=False)
    assert engine.stats.compiled_steps > 0
    # int8 weights change the numbers, not the translation: the first tokens agree
    same_start = sum(g[:4] == r[:4] for g, r in zip(got, reference, strict=True))
    assert same_start >= 4, (got, reference)
    assert all(len(g) > 2 for g in got)


def test_background_compile_serves_eagerly_until_ready(tiny_config: Any, tiny_models: Any):
    """The worker's start: the engine serves at once, eagerly, while the graphs compile on a
    thread of their own; decode steps take the compiled path once they are ready, with the
    same tokens."""
    import threading

    _, loaded = tiny_models(tiny_config("llama", vocab_size=512))
    engine = Engine(
        loaded, EngineConfig(kv_cache_tokens=2048, compile_decode=True, compile_max_batch=4)
    )
    compiled = engine.compiled
    assert compiled is not None
    release = threading.Event()  # holds the compilation back until the eager run is done
    real_warm_up = compiled.warm_up

    def held_warm_up(batch_sizes: Any = (1, 2)) -> float:
        release.wait(timeout=600)
        return real_warm_up(batch_sizes)

    compiled.warm_up = held_warm_up  # type: ignore[method-assign]
    thread = compiled.warm_up_in_background()
    assert not compiled.ready
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, stop_at_newline=False)
    prompt = list(range(5, 17))
    eager = engine.generate([GenerationRequest("before", prompt, params)])
    assert engine.stats.compiled_steps == 0  # still compiling: every step eager
    release.set()
    thread.join(timeout=1800)  # minutes on a busy 2-core machine
    assert compiled.ready
    after = engine.generate([GenerationRequest("after", prompt, params)])
    assert engine.stats.compiled_steps >= 11
    assert after[0].token_ids == eager[0].token_ids


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_prefill_and_mixed_steps_run_compiled_with_the_eager_tokens(
    arch: str, tiny_config: Any, tiny_models: Any
):
    """`compile_max_rows`: prefill chunks and mixed steps run through the compiled graph, one row
    per token (compiled.py), and give the eager engine's tokens. An 8-token step budget splits
    the 21-token prompt into chunks, so one step samples nothing (its middle chunk)."""
    _, loaded = tiny_models(tiny_config(arch, vocab_size=512))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (6, 21, 3)]
    config = {"kv_cache_tokens": 2048, "max_num_batched_tokens": 8}
    eager = staggered_greedy(Engine(loaded, EngineConfig(**config)), prompts)
    engine = Engine(
        loaded,
        EngineConfig(**config, compile_decode=True, compile_max_batch=4, compile_max_rows=8),
    )
    assert staggered_greedy(engine, prompts) == eager
    kinds, stats = engine.stats.steps_by_kind, engine.stats
    assert kinds["prefill"] >= 1 and kinds["mixed"] >= 2
    # every step ran compiled: decode steps as decode graphs, the others as rows
    assert stats.compiled_steps == kinds["decode"]
    assert stats.compiled_rows_steps == kinds["prefill"] + kinds["mixed"]


def test_a_background_compile_starts_after_the_language_warm_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`Engine.from_config` with `compile_in_background` (the worker's start): the languages'
    prefixes are warmed eagerly first, then the graphs compile on their thread. Started the
    other way round, the compile thread's tracing held the GIL and the warm-up beside it took
    ~25 s longer (Gemma 3 on the Xeon: consuming 46 s after process start instead of ~20)."""
    events: list[tuple[object, ...]] = []
    real_warm = Engine.warm

    def warm(self: Engine, languages: Any) -> Any:
        assert self.compiled is not None
        events.append(("warm", self.compiled.ready, self.compiled.rows_ready))
        return real_warm(self, languages)

    def compile_in_background(self: CompiledDecode, *args: Any, **kwargs: Any) -> None:
        events.append(("compile",))  # recorded, not run: nothing compiles in this test

    monkeypatch.setattr(Engine, "warm", warm)
    monkeypatch.setattr(CompiledDecode, "warm_up_in_background", compile_in_background)
    config = EngineConfig(
        model="smollm2-135m", kv_cache_tokens=4096, pack_weights=False, compile_decode=True,
        compile_in_background=True, warm_languages=("de",),
    )  # fmt: skip
    engine = Engine.from_config(config, loaded=load_model("smollm2-135m", dtype=torch.float32))
    assert events == [("warm", False, False), ("compile",)]  # eager warm-up, then the compile
    assert engine.stats.compiled_steps == engine.stats.compiled_rows_steps == 0
    assert engine.stats.steps > 0  # the warm-up ran its prefill steps


def test_a_graph_that_fails_to_compile_is_tried_again_then_served_eagerly(
    tiny_config: Any, tiny_models: Any
) -> None:
    """A compile error (inductor's codegen failed once in CI on a graph it compiles fine
    another time) never fails the step's requests: the graph is compiled once more, and if that
    fails too the engine turns its compiled path off and serves the same tokens eagerly."""
    from torch._dynamo.exc import BackendCompilerFailed

    _, loaded = tiny_models(tiny_config("llama", vocab_size=512))
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, stop_at_newline=False)
    prompt = list(range(5, 17))
    eager = Engine(loaded, EngineConfig(kv_cache_tokens=2048)).generate(
        [GenerationRequest("eager", prompt, params)]
    )
    for failures in (1, 10**6):  # once (the retry compiles), always (eager from then on)
        engine = Engine(loaded, EngineConfig(kv_cache_tokens=2048, compile_decode=True))
        compiled = engine.compiled
        assert compiled is not None
        calls = {"n": 0}

        def flaky(
            *args: Any, failures: int = failures, c: Any = compiled, calls: Any = calls
        ) -> Any:
            calls["n"] += 1
            if calls["n"] <= failures:
                raise BackendCompilerFailed(flaky, RuntimeError("int_array_86"), None)
            return c._forward(*args)  # stands for the compiled graph: the same forward

        compiled._fn = flaky
        (result,) = engine.generate([GenerationRequest("r", prompt, params)])
        assert result.ok and result.token_ids == eager[0].token_ids
        assert compiled.ready is (failures == 1)
