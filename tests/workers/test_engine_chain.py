"""The worker's wrapper order (workers/engine_chain.py, what `tolk worker` serves): a drill
changes every reply of its arm, also a turn with history on a `--context` arm (which goes
around the cache to the uncached chain) and a cache hit.

The drill once sat inside the context engine: a context arm's turns with history skipped it,
so a rollback drill injected less than it said. The chain here is the real one (the fake
engine stands for the fair engine; the context engine builds prompts with the real Gemma 3
tokenizer; the cache's L2 is in memory).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from tests.workers.fakes import FakeEngine
from workers.context_engine import CONTEXT_NOTE, ContextEngine
from workers.drill_engine import DRILL_NOTE_KEY, DrillEngine
from workers.engine.prompts import PromptBuilder
from workers.engine.types import FinishReason, GenerationResult
from workers.engine_chain import ChainOptions, compose_served
from workers.settings import Settings
from workers.tm.redis_cache import InMemoryTranslationCache


@pytest.fixture(scope="module")
def gemma_prompts() -> PromptBuilder:
    from transformers import AutoTokenizer

    from workers.engine.loader import checkpoint_dir

    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir("gemma3-270m"))
    return PromptBuilder(tokenizer, "gemma3", tokenizer.bos_token_id, {tokenizer.eos_token_id})


def _chain(prompts: PromptBuilder, **options: Any) -> tuple[Any, FakeEngine]:
    engine = FakeEngine(languages=("en", "de"))
    base = SimpleNamespace(prompts=prompts, prompt_history=None)
    settings = Settings(languages=("en", "de"), cache_l1_entries=100)
    opts = ChainOptions(
        faithful=False, cache=True, cache_l2=InMemoryTranslationCache(), context=True, **options
    )
    served = compose_served(engine, base, settings, opts)
    served.start()
    return served, engine


def _turn(served: Any, rid: str, conversation: str, text: str) -> GenerationResult:
    return served.submit_translation(
        request_id=rid, text=text, source_lang="en", target_lang="de",
        conversation_id=conversation,
    ).result(10)  # fmt: skip


def test_the_drill_is_outermost_and_the_context_engine_next(gemma_prompts: PromptBuilder) -> None:
    served, _ = _chain(gemma_prompts, drill_errors=("de:1.0",))
    try:
        assert isinstance(served, DrillEngine)
        assert isinstance(served.inner, ContextEngine)
    finally:
        served.stop()


def test_an_error_drill_fails_every_turn_of_a_context_arm(gemma_prompts: PromptBuilder) -> None:
    served, engine = _chain(gemma_prompts, drill_errors=("de:1.0",))
    try:
        first = _turn(served, "a1", "conv-A", "Hello there.")  # no history: through the cache
        in_context = _turn(served, "a2", "conv-A", "How can I help?")  # history: around it
        hit = _turn(served, "b1", "conv-B", "Hello there.")  # a cache hit (a1's answer)
    finally:
        served.stop()
    assert in_context.notes[CONTEXT_NOTE] == "turns=1"  # it did take the contextual path
    assert hit.notes["tolk.cache"] == "l1"
    assert engine.submitted == ["a1", "a2"]  # the engine ran both, and answered OK
    for result in (first, in_context, hit):
        assert result.finish_reason == FinishReason.ERROR, result
        assert result.error == "drill: injected error"
        assert result.notes[DRILL_NOTE_KEY] == "error"


def test_a_latency_drill_delays_a_turn_with_history(gemma_prompts: PromptBuilder) -> None:
    served, _ = _chain(gemma_prompts, drill_latency=("de:1.0:400",))
    try:
        _turn(served, "a1", "conv-A", "Hello there.")
        started = time.monotonic()
        in_context = _turn(served, "a2", "conv-A", "How can I help?")
        waited = time.monotonic() - started
    finally:
        served.stop()
    assert in_context.ok and in_context.notes[CONTEXT_NOTE] == "turns=1"
    assert in_context.notes[DRILL_NOTE_KEY] == "latency"
    assert waited >= 0.4


def test_no_drill_no_context_no_cache_is_the_engine_itself(gemma_prompts: PromptBuilder) -> None:
    engine = FakeEngine(languages=("en", "de"))
    opts = ChainOptions(faithful=False)
    assert compose_served(engine, None, Settings(languages=("en", "de")), opts) is engine
