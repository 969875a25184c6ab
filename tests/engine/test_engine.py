"""Engine behaviour on the real SmolLM2 weights: prefix cache, thread API, stop rules, deadlines."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kernels.int4_linear import runs_vector_loop
from kernels.int8_head_screen import Int4Screen
from workers.engine.engine import Engine, EngineConfig
from workers.engine.loader import load_model
from workers.engine.swaps import INT4_SCREEN_MIN_WEIGHTS
from workers.engine.types import (
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TranslationRequest,
    UnsupportedLanguage,
)

pytestmark = pytest.mark.slow


@pytest.fixture()
def engine(smollm2: Any) -> Engine:
    return Engine(smollm2, EngineConfig(kv_cache_tokens=4096, max_new_tokens=24))


def test_prefix_is_shared_across_requests_of_a_language(engine: Engine) -> None:
    a, na = engine.prompts.build("Where is my parcel?", "en", "de")
    b, nb = engine.prompts.build("I want to cancel my subscription.", "en", "de")
    assert na == nb and a[:na] == b[:nb]
    c, _ = engine.prompts.build("Where is my parcel?", "en", "fr")
    assert c[:na] != a[:na]  # another language, another prefix


def test_warm_language_prefills_only_its_own_tokens(engine: Engine) -> None:
    # a target language whose prompt prefix ends inside a block (which one depends on the
    # prompt set, docs/PROMPTS.md)
    lang = next(
        t
        for t in ("de", "fr", "es", "it")
        if len(engine.prompts.prefix_ids(t)) % engine.kv.block_size
    )
    engine.warm([lang])
    prefix_len = len(engine.prompts.prefix_ids(lang))
    assert prefix_len % engine.kv.block_size  # the prefix ends inside a block ...
    before = engine.stats.prefill_tokens
    req = engine.translation_request("Can you help me with my booking?", "en", lang)
    (res,) = engine.generate([req])
    assert res.ok and res.text
    assert res.cached_tokens == prefix_len  # ... whose slots are copied, not recomputed
    assert engine.stats.prefill_tokens - before == res.tokens_in - res.cached_tokens


def test_partial_block_reuse_gives_the_tokens_of_whole_block_reuse(smollm2: Any) -> None:
    texts = ["Can you help me with my booking?", "My order arrived broken."]

    def run(partial: bool) -> tuple[list[list[int]], list[int]]:
        eng = Engine(smollm2, EngineConfig(kv_cache_tokens=4096, share_partial_blocks=partial))
        eng.warm(["fr"])
        reqs = [eng.translation_request(t, "en", "fr", max_new_tokens=12) for t in texts]
        results = [eng.generate([r])[0] for r in reqs]
        return [r.token_ids for r in results], [r.cached_tokens for r in results]

    whole, whole_cached = run(False)
    partial, partial_cached = run(True)
    assert partial == whole
    assert all(p > w for p, w in zip(partial_cached, whole_cached, strict=True))


def test_screened_lm_head_gives_the_float32_heads_tokens(smollm2: Any) -> None:
    texts = ["Where is my parcel?", "I was charged twice.", "My app keeps crashing."]

    def run(screen: bool) -> tuple[list[list[int]], int]:
        eng = Engine(smollm2, EngineConfig(kv_cache_tokens=4096, screen_lm_head=screen))
        assert (eng.lm_screen is not None) == screen
        reqs = [eng.translation_request(t, "en", "it", max_new_tokens=16) for t in texts]
        return [r.token_ids for r in eng.generate(reqs)], eng.stats.screened_steps

    plain, plain_steps = run(False)
    screened, screened_steps = run(True)
    assert screened == plain
    assert plain_steps == 0 and screened_steps > 0


def test_the_int4_screen_gives_the_int8_heads_tokens() -> None:
    """With int8 weights the head's argmax comes from its int4 copy and the rescored
    candidates (kernels/int8_head_screen.py): the same tokens as the full int8 head, batched
    (more than 4 rows: the op's block loop) and alone."""
    loaded = load_model("gemma3-270m")  # a copy of its own: int8 rewrites the model
    pairs = [("en", "de"), ("de", "en"), ("en", "es")]
    texts = ["Where is my parcel?", "Ich wurde zweimal belastet.", "My app keeps crashing.",
             "Can I change the delivery address of order 4711?", "Danke für Ihre Hilfe!",
             "The refund of 25.99 EUR has not arrived yet."]  # fmt: skip

    def run(screen: bool) -> tuple[list[list[int]], int]:
        eng = Engine(loaded, EngineConfig(kv_cache_tokens=8192, quantize="int8",
                                          screen_lm_head=screen))  # fmt: skip
        assert isinstance(eng.lm_screen, Int4Screen) == (screen and runs_vector_loop())
        reqs = [eng.translation_request(t, *pairs[i % 3], max_new_tokens=24)
                for i, t in enumerate(texts)]  # fmt: skip
        batched = [r.token_ids for r in eng.generate(reqs)]
        alone = eng.generate([eng.translation_request(texts[3], "en", "de", max_new_tokens=24)])
        return batched + [alone[0].token_ids], eng.stats.screened_steps

    full, full_steps = run(False)
    screened, screened_steps = run(True)
    assert screened == full
    assert full_steps == 0 and (screened_steps > 0) == runs_vector_loop()


def test_the_int4_screen_keeps_log_probabilities_within_a_hundredth_of_the_full_heads() -> None:
    """A sequence keeping its tokens' log-probabilities (the cascade's small model) stays on the
    int8 head's screen: the same tokens as the full head, each answer's mean log-probability
    within 0.01 of the full head's (real Gemma 3 weights, int8)."""
    if not runs_vector_loop():
        pytest.skip("the int4 screen needs the C++ ops' int4 vector loop")
    loaded = load_model("gemma3-270m")  # a copy of its own: int8 rewrites the model
    texts = [("Where is my parcel?", "en", "de"), ("Ich wurde zweimal belastet.", "de", "en"),
             ("The refund of 25.99 EUR has not arrived yet.", "en", "fr")]  # fmt: skip

    def run(screen: bool) -> tuple[list[Any], int]:
        eng = Engine(loaded, EngineConfig(kv_cache_tokens=8192, quantize="int8",
                                          screen_lm_head=screen))  # fmt: skip
        reqs = [eng.translation_request(t, s, g, max_new_tokens=24, logprobs=True)
                for t, s, g in texts]  # fmt: skip
        return eng.generate(reqs), eng.stats.screened_steps

    full, full_steps = run(False)
    screened, screened_steps = run(True)
    assert full_steps == 0 and screened_steps > 0
    for f, g in zip(full, screened, strict=True):
        assert g.token_ids == f.token_ids and g.scored_tokens == f.scored_tokens > 0
        assert g.logprob == pytest.approx(f.logprob, abs=0.01)


def test_a_small_int8_head_is_read_whole() -> None:
    """SmolLM2's 28 MB int8 head stays in cache: the screen would cost more than it saves."""
    loaded = load_model("smollm2-135m")
    assert loaded.model.lm_head.weight.numel() < INT4_SCREEN_MIN_WEIGHTS
    eng = Engine(loaded, EngineConfig(kv_cache_tokens=2048, quantize="int8"))
    assert eng.lm_screen is None
    (res,) = eng.generate([eng.translation_request("Thank you!", "en", "de", max_new_tokens=6)])
    assert res.ok and eng.stats.screened_steps == 0


def test_sampled_requests_bypass_the_screen(engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=0.8, seed=3)
    ids = engine.prompts.build("Thanks a lot!", "en", "es")[0]
    (res,) = engine.generate([GenerationRequest("s1", ids, params)])
    assert res.ok and res.tokens_out > 0
    assert engine.stats.screened_steps == 0


def test_requests_of_a_warm_language_decode_with_cascade_attention(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoding rows that share the warm prefix attend to it once (cascade), with the tokens
    the plain gather-everything path gives."""
    from kernels import cascade

    texts = ["Where is my parcel?", "I was charged twice.", "My app keeps crashing.",
             "Can I change the delivery address?", "The refund has not arrived yet."]  # fmt: skip
    calls: list[int] = []
    real = cascade.cascade_attention

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(sum(s.rows.numel() for s in args[5].shared))  # rows sharing a prefix
        return real(*args, **kwargs)

    def run() -> list[list[int]]:
        reqs = [engine.translation_request(t, "en", "de", max_new_tokens=6) for t in texts]
        return [r.token_ids for r in engine.generate(reqs)]

    engine.warm(["de"])
    monkeypatch.setattr(cascade, "cascade_attention", counting)
    cascaded = run()
    assert calls and max(calls) == len(texts)
    monkeypatch.setattr(cascade, "CASCADE_MIN_ROWS", 10**9)
    calls.clear()
    assert run() == cascaded
    assert not calls


def test_cold_request_computes_everything(smollm2: Any) -> None:
    cold = Engine(smollm2, EngineConfig(kv_cache_tokens=4096, enable_prefix_caching=False))
    (res,) = cold.generate([cold.translation_request("Thank you!", "en", "es")])
    assert res.cached_tokens == 0
    assert cold.stats.prefill_tokens == res.tokens_in


def test_threaded_submit_and_callbacks(engine: Engine) -> None:
    engine.start()
    try:
        got: list[str] = []
        handles = [
            engine.submit_translation(
                TranslationRequest(request_id=f"r{i}", text=t, source_lang="en", target_lang=lang)
            )
            for i, (t, lang) in enumerate(
                [("Hello!", "de"), ("Good morning.", "fr"), ("Yes.", "it")]
            )
        ]
        for h in handles:
            h.add_done_callback(lambda r: got.append(r.request_id))
        results = [h.result(timeout=120) for h in handles]
        assert [r.request_id for r in results] == ["r0", "r1", "r2"]
        assert all(r.ok and r.tokens_out > 0 for r in results)
        assert sorted(got) == ["r0", "r1", "r2"]
        assert all(r.timings.total_s >= r.timings.decode_s >= 0 for r in results)
    finally:
        engine.stop()


def test_unknown_language_is_refused(engine: Engine) -> None:
    with pytest.raises(UnsupportedLanguage, match="xx"):
        engine.submit_translation(
            TranslationRequest(request_id="x", text="hi", source_lang="en", target_lang="xx")
        )


def test_expired_deadline_is_not_served(engine: Engine) -> None:
    req = engine.translation_request("Hi", "en", "de", deadline=time.monotonic() - 1)
    (res,) = engine.generate([req])
    assert res.finish_reason is FinishReason.EXPIRED
    assert res.tokens_out == 0 and "deadline" in res.error


def test_cancel_running_request(engine: Engine) -> None:
    req = GenerationRequest(
        "long", engine.prompts.prefix_ids("de"), SamplingParams(200, ignore_eos=True)
    )
    h = engine.submit(req)
    engine.step()
    engine.step()
    h.cancel()
    engine.run_until_done()
    res = h.result(0)
    assert res.finish_reason is FinishReason.CANCELLED
    assert engine.kv.usage() == 0.0


def test_max_new_tokens_and_exact_length(engine: Engine) -> None:
    req = engine.translation_request("Hello", "en", "de", max_new_tokens=7, ignore_eos=True)
    (res,) = engine.generate([req])
    assert res.finish_reason is FinishReason.LENGTH
    assert res.tokens_out == 7 == len(res.token_ids)


def test_a_warm_up_marks_only_the_languages_whose_prefix_was_computed(
    smollm2: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`warm` (the tuner's candidates) and the background warm-up agree: a language whose
    prefix request did not finish (here: its deadline already past, EXPIRED) is not warm."""
    engine = Engine(smollm2, EngineConfig(kv_cache_tokens=4096, max_new_tokens=8))
    build = engine._warm_request

    def expired_fr(lang: str) -> GenerationRequest:
        request = build(lang)
        if lang == "fr":
            request.deadline = time.monotonic() - 1.0
        return request

    monkeypatch.setattr(engine, "_warm_request", expired_fr)
    engine.warm(["de", "fr"])
    assert engine.warmed_languages == {"de"}


def test_a_background_warm_up_is_the_loops_first_work(smollm2: Any) -> None:
    """`warm_in_background` (the worker's start): nothing warmed when `from_config` returns;
    once the loop runs it computes the prefixes, a request submitted at once is answered
    beside them, and a later one finds its language's prefix cached."""
    config = EngineConfig(
        model="smollm2-135m", kv_cache_tokens=4096, max_new_tokens=8,
        warm_languages=("de", "fr"), warm_in_background=True,
    )  # fmt: skip
    engine = Engine.from_config(config, loaded=smollm2)
    assert engine.warmed_languages == set() and engine.stats.prefill_tokens == 0
    engine.start()
    try:
        handle = engine.submit(engine.translation_request("Where is my parcel?", "en", "de"))
        res = handle.result(120)
        deadline = time.monotonic() + 30
        while engine.warmed_languages != {"de", "fr"} and time.monotonic() < deadline:
            time.sleep(0.05)
        later = engine.submit(engine.translation_request("My order is late.", "en", "fr"))
        res_later = later.result(120)
    finally:
        engine.stop()
    assert res.ok and engine.warmed_languages == {"de", "fr"}
    assert res_later.ok and res_later.cached_tokens == len(engine.prompts.prefix_ids("fr"))
