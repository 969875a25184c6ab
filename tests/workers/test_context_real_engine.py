"""Conversation context on the real engine (Gemma 3 270M): turn k+1 of a conversation finds
turn k's prompt and generated answer in the prefix cache and prefills only its own tokens.

The pure parts (window, order, budget, the prefix property on the tokenizer, the cache bypass)
are in test_context.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from workers.engine.engine import Engine, EngineConfig
from workers.engine.types import GenerationResult, TranslationRequest
from workers.stages.context.rules import ConversationMemory
from workers.stages.context.stage import CONTEXT_NOTE, ContextEngine

pytestmark = pytest.mark.slow


def _turn(ctx: ContextEngine, engine: Engine, rid: str, text: str, conv: str) -> GenerationResult:
    handle = ctx.submit_translation(
        TranslationRequest(
            request_id=rid, text=text, source_lang="de", target_lang="en", conversation_id=conv
        )
    )
    engine.run_until_done()
    return handle.result(0)


def test_turn_k_plus_1_hits_the_prefix_cache_for_its_whole_history(gemma3: Any) -> None:
    engine = Engine(gemma3, EngineConfig(max_new_tokens=32))
    engine.warm(["en"])
    ctx = ContextEngine(engine, prompts=engine.prompts, memory=ConversationMemory(512))
    prefix = len(engine.prompts.prefix_ids("en"))

    first = _turn(ctx, engine, "k", "Hallo, ich suche ein günstiges Restaurant.", "conv")
    assert first.ok and first.text and first.cached_tokens == prefix  # the language prefix
    second = _turn(ctx, engine, "k+1", "Gibt es dort vegetarische Gerichte?", "conv")
    assert second.ok and second.notes[CONTEXT_NOTE] == "turns=1"
    # every position whose KV turn k computed (its prompt and answer, all but the last
    # sampled token) comes from the prefix cache: turn k+1 prefills only what is new
    assert second.cached_tokens >= first.tokens_in + first.tokens_out - 1
    new_tokens = second.tokens_in - second.cached_tokens
    plain, _ = engine.prompts.build("Gibt es dort vegetarische Gerichte?", "de", "en")
    assert new_tokens < len(plain) - prefix + 4  # the query, the answer's end, one token
    assert second.tokens_in > len(plain) + first.tokens_out  # and the history is in the prompt

    # another conversation with the same words has no history: the language prefix hits, and
    # at most the query's opening label ("German:"), which turn k's prompt also had there
    other = _turn(ctx, engine, "other", "Gibt es dort vegetarische Gerichte?", "conv-2")
    assert other.tokens_in == len(plain) and prefix <= other.cached_tokens < prefix + 4
    assert CONTEXT_NOTE not in other.notes
