"""Model preparation once per loaded model (workers/engine/prepare.py).

Engines over one loaded model share its preparation and give transformers' tokens while they
take turns (stepped alternately, or each on its own loop thread): each has its own KV pools, so
neither overwrites the other's blocks (both hand out the same block ids). An engine asking for
other model-changing swaps is refused before anything is touched, with an error that names
what differs; the LM-head screen is an add-on, not a conflict. Preparing twice changes nothing.
Tiny random models (tests/conftest.py) for all but the last test, which runs SmolLM2's real
weights (`slow`), as does the compiled one (it compiles graphs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kernels import cpu_ops
from workers.engine.engine import Engine, EngineConfig
from workers.engine.prepare import Preparation, PreparationMismatch, prepare_model
from workers.engine.swaps import fuse_gate_up, fuse_qkv, pack_linears
from workers.engine.types import GenerationRequest, SamplingParams

VOCAB = 256
NEW_TOKENS = 12
CONFIG = EngineConfig(kv_cache_tokens=512, block_size=4)
PARAMS = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, stop_at_newline=False)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@torch.inference_mode()
def _transformers_tokens(hf: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    out = []
    for prompt in prompts:
        x = torch.tensor([prompt])
        y = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                        max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)  # fmt: skip
        out.append(y[0, len(prompt) :].tolist())
    return out


def _interleaved(runs: list[tuple[Engine, list[GenerationRequest]]]) -> list[list[list[int]]]:
    """Submit each engine's requests, then step the engines alternately until all are done."""
    handles = [[engine.submit(r) for r in reqs] for engine, reqs in runs]
    while any(engine.has_unfinished() for engine, _ in runs):
        for engine, _ in runs:
            if engine.has_unfinished():
                engine.step()
    return [[h.result(0).token_ids for h in hs] for hs in handles]


def _on_threads(runs: list[tuple[Engine, list[GenerationRequest]]]) -> list[list[list[int]]]:
    """Each engine on its own loop thread, all at once."""
    for engine, _ in runs:
        engine.start()
    try:
        handles = [[engine.submit(r) for r in reqs] for engine, reqs in runs]
        return [[h.result(timeout=120).token_ids for h in hs] for hs in handles]
    finally:
        for engine, _ in runs:
            engine.stop()


def _module_types(model: torch.nn.Module) -> list[tuple[str, type]]:
    return [(name, type(m)) for name, m in model.named_modules()]


@pytest.mark.parametrize("driver", [_interleaved, _on_threads], ids=["interleaved", "threads"])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_two_engines_over_one_model_give_transformers_tokens(
    arch: str, driver: Any, tiny_config: Any, tiny_models: Any
) -> None:
    hf, loaded = tiny_models(tiny_config(arch, vocab_size=VOCAB))
    first, second = Engine(loaded, CONFIG), Engine(loaded, CONFIG)
    assert second.prepared is first.prepared  # one preparation, shared
    pools = [p.data_ptr() for e in (first, second) for p in (*e.kv_pools.k, *e.kv_pools.v)]
    assert len(set(pools)) == len(pools)  # never shared
    prompts = [_prompts(1, (5, 11)), _prompts(2, (9, 14))]  # windows slide past 8 (Gemma)
    runs = [
        (engine, [GenerationRequest(f"{i}-{j}", p, PARAMS) for j, p in enumerate(ps)])
        for i, (engine, ps) in enumerate(zip((first, second), prompts, strict=True))
    ]
    got = driver(runs)
    for engine_prompts, engine_tokens in zip(prompts, got, strict=True):
        assert engine_tokens == _transformers_tokens(hf, engine_prompts, NEW_TOKENS)


@pytest.mark.parametrize(
    "swap,value", [("quantize", "int8"), ("pack_weights", False), ("fuse_projections", False)]
)
def test_an_engine_asking_for_other_swaps_is_refused(
    swap: str, value: Any, tiny_config: Any, tiny_models: Any
) -> None:
    _, loaded = tiny_models(tiny_config("llama", vocab_size=VOCAB))
    engine = Engine(loaded, CONFIG)
    before = _module_types(loaded.model)
    prepared = engine.config.preparation
    with pytest.raises(PreparationMismatch) as refused:
        Engine(loaded, dataclasses.replace(CONFIG, **{swap: value}))
    message = str(refused.value)
    assert f"{swap}: prepared {getattr(prepared, swap)!r}, asked {value!r}" in message
    assert all(other not in message for other in Preparation.MODEL_CHANGING if other != swap)
    assert _module_types(loaded.model) == before  # refused before any swap ran
    # the first engine still serves
    (res,) = engine.generate([GenerationRequest("after", [1, 2, 3], PARAMS)])
    assert res.ok and len(res.token_ids) == NEW_TOKENS


def test_a_prepared_model_is_taken_as_is_or_refused(tiny_config: Any, tiny_models: Any) -> None:
    _, loaded = tiny_models(tiny_config("llama", vocab_size=VOCAB))
    prepared = prepare_model(loaded, Preparation(quantize="int8"))
    assert prepared.int8_linears == 2 * 4 + 1  # fused qkv, o, fused gate/up, down; + the LM head
    engine = Engine(prepared, dataclasses.replace(CONFIG, quantize="int8"))
    assert engine.prepared is prepared and engine.loaded is loaded
    with pytest.raises(PreparationMismatch, match="quantize: prepared 'int8', asked None"):
        Engine(prepared, CONFIG)


def test_int4_preparation_counts_its_formats(tiny_config: Any, tiny_models: Any) -> None:
    # hidden 64: int4 for every projection whose input is a multiple of 32; down_proj's input
    # (intermediate 48) and the LM head stay int8
    _, loaded = tiny_models(tiny_config("llama", vocab_size=VOCAB, intermediate_size=48))
    prepared = prepare_model(loaded, Preparation(quantize="int4"))
    assert prepared.int4_linears == 2 * 3  # fused qkv, o, fused gate/up
    assert prepared.int8_linears == 2 * 1 + 1  # down; + the LM head


@pytest.mark.parametrize(
    "preparation",
    [
        Preparation(),
        Preparation(quantize="int8"),
        Preparation(fuse_projections=False, pack_weights=False),
    ],
    ids=["default", "int8", "plain"],
)
def test_preparing_twice_is_idempotent(
    preparation: Preparation, tiny_config: Any, tiny_models: Any
) -> None:
    _, loaded = tiny_models(tiny_config("llama", vocab_size=VOCAB))
    first = prepare_model(loaded, preparation)
    modules = dict(loaded.model.named_modules())
    counts = (first.fused_attentions, first.fused_mlps, first.int8_linears, first.packed_linears)
    again = prepare_model(loaded, preparation)
    assert again is first
    assert dict(loaded.model.named_modules()) == modules  # the very same module objects
    assert (again.fused_attentions, again.fused_mlps, again.int8_linears,
            again.packed_linears) == counts  # fmt: skip
    assert first.fused_attentions == first.fused_mlps == (2 if preparation.fuse_projections else 0)
    if preparation.fuse_projections or preparation.pack_weights:
        assert fuse_qkv(loaded.model) == 0 and fuse_gate_up(loaded.model) == 0
        assert pack_linears(loaded.model) == 0  # nothing left


def test_unknown_quantization_is_refused_before_any_swap(
    tiny_config: Any, tiny_models: Any
) -> None:
    _, loaded = tiny_models(tiny_config("llama", vocab_size=VOCAB))
    before = _module_types(loaded.model)
    with pytest.raises(ValueError, match="int3"):
        Engine(loaded, dataclasses.replace(CONFIG, quantize="int3"))
    assert _module_types(loaded.model) == before


def test_the_lm_head_screen_is_an_add_on_not_a_conflict(tiny_config: Any, tiny_models: Any) -> None:
    if not cpu_ops.load():
        pytest.skip(f"tolk's C++ CPU ops not built: {cpu_ops.error()}")
    _, loaded = tiny_models(tiny_config("llama", vocab_size=VOCAB))
    plain = Engine(loaded, dataclasses.replace(CONFIG, screen_lm_head=False))
    assert plain.lm_screen is None and plain.prepared.lm_screen is None
    screened = Engine(loaded, CONFIG)  # builds the screen onto the shared record
    assert screened.prepared is plain.prepared
    assert screened.lm_screen is not None and plain.lm_screen is None
    assert Engine(loaded, CONFIG).lm_screen is screened.lm_screen  # built once
    prompt = _prompts(3, (7,))[0]
    tokens = [
        e.generate([GenerationRequest(f"r{i}", prompt, PARAMS)])[0].token_ids
        for i, e in enumerate((plain, screened))
    ]
    assert tokens[0] == tokens[1] and screened.stats.screened_steps > 0


@pytest.mark.slow
def test_two_compiled_engines_over_one_model_give_transformers_tokens(
    tiny_config: Any, tiny_models: Any
) -> None:
    """Compiled decode graphs read whichever pools are bound: each engine's own."""
    hf, loaded = tiny_models(tiny_config("llama", vocab_size=VOCAB))
    config = dataclasses.replace(CONFIG, compile_decode=True, compile_max_batch=4)
    engines = [Engine(loaded, config), Engine(loaded, config)]
    prompts = [_prompts(4, (6, 10)), _prompts(5, (8, 13))]
    runs = [
        (engine, [GenerationRequest(f"{i}-{j}", p, PARAMS) for j, p in enumerate(ps)])
        for i, (engine, ps) in enumerate(zip(engines, prompts, strict=True))
    ]
    got = _interleaved(runs)
    assert all(e.stats.compiled_steps >= NEW_TOKENS - 1 for e in engines)
    for engine_prompts, engine_tokens in zip(prompts, got, strict=True):
        assert engine_tokens == _transformers_tokens(hf, engine_prompts, NEW_TOKENS)


@pytest.mark.slow
def test_two_engines_over_smollm2_give_transformers_tokens(
    smollm2: Any, smollm2_reference: Any
) -> None:
    config = EngineConfig(kv_cache_tokens=2048)
    first, second = Engine(smollm2, config), Engine(smollm2, config)
    assert second.prepared is first.prepared
    texts = [("Where is my parcel?", "de"), ("My app keeps crashing.", "fr"),
             ("I was charged twice.", "es"), ("Thank you for your help!", "it")]  # fmt: skip
    reqs = [
        engine.translation_request(t, "en", lang, max_new_tokens=16, ignore_eos=True)
        for engine, (t, lang) in zip((first, second, first, second), texts, strict=True)
    ]
    # one request per engine at a time (batch 1, transformers' exact path), steps alternating
    got = _interleaved([(first, reqs[0:1]), (second, reqs[1:2])])
    got += _interleaved([(first, reqs[2:3]), (second, reqs[3:4])])
    hf, _ = smollm2_reference
    want = _transformers_tokens(hf, [r.prompt_ids for r in reqs], 16)
    assert [tokens for (tokens,) in got] == want
