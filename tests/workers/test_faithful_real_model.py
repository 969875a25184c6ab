"""The length guard and the stop rule on the real models (Gemma 3 270M and SmolLM2-135M-Instruct,
greedy): issue #18's cases. "Thanks" (en -> de) and "Thank you" (en -> fr) copied a few-shot
example's target under the prompt before the issue (form `support8`) and no longer do under
the default form; a translation ends at the template's end of line (Gemma) or turn marker
(SmolLM2); the guard's cap stops a generation and the reply says so; SmolLM2's chat replies to
short German turns are caught (a one-word turn too) and withheld, the default policy."""

from __future__ import annotations

from typing import Any

import pytest

from workers.engine.engine import Engine, EngineConfig
from workers.engine.prompts import prompt_examples
from workers.engine.types import FinishReason, TranslationRequest
from workers.stages.faithful.rules import LengthCaps, leaked_example
from workers.stages.faithful.stage import (
    CANDIDATE_KEY,
    FINISH_REASON_KEY,
    GUARD_REASON,
    NOTE_KEY,
    FaithfulEngine,
)

pytestmark = pytest.mark.slow

AGENT_TURN = (
    "Okay, I will check that for you and get back to you in a moment with the available "
    "options for your stay at the hotel next weekend."
)


@pytest.fixture(scope="module")
def engine(gemma3: Any) -> Engine:
    return Engine(gemma3, EngineConfig(max_new_tokens=256))


def test_the_old_prompt_leaks_and_the_default_does_not(engine: Engine) -> None:
    examples = prompt_examples()
    old, new = engine.generate(
        [
            engine.translation_request("Thanks", "en", "de", prompt_form="support8"),
            engine.translation_request("Thanks", "en", "de"),
        ]
    )
    assert leaked_example("Thanks", old.text, examples, "de") is not None, old.text
    assert leaked_example("Thanks", new.text, examples, "de") is None, new.text
    assert "dank" in new.text.casefold()


def test_the_french_default_keeps_the_thanks_leak_away(engine: Engine) -> None:
    # the French prompt's own example ("Aspetto una risposta ..." -> "J'attends une réponse
    # ...", docs/PROMPTS.md): "Thank you" copied the patience example under `support8`
    examples = prompt_examples()
    old, new = engine.generate(
        [
            engine.translation_request("Thank you", "en", "fr", prompt_form="support8"),
            engine.translation_request("Thank you", "en", "fr"),
        ]
    )
    assert leaked_example("Thank you", old.text, examples, "fr") is not None, old.text
    assert leaked_example("Thank you", new.text, examples, "fr") is None, new.text
    assert "merci" in new.text.casefold()


def test_a_translation_stops_at_the_end_of_its_line(engine: Engine) -> None:
    (result,) = engine.generate([engine.translation_request("Go to your Home screen.", "en", "fr")])
    assert result.finish_reason is FinishReason.STOP
    # the stop token is the template's newline: nothing of a next example was generated
    assert "\n" in engine.tokenizer.decode(result.token_ids[-1:])
    assert "\n" not in result.text and "English" not in result.text
    assert result.tokens_out < 30


def test_the_packaged_cap_holds_a_long_turn_and_a_tight_cap_stops_it(engine: Engine) -> None:
    packaged = FaithfulEngine(engine, default_max_new_tokens=256)
    cap = packaged.length_cap(AGENT_TURN, "en", "de")
    assert 20 < cap < 256  # the source's tokens x the en-de slope, far under the language's 256
    tight = FaithfulEngine(
        engine,
        caps=LengthCaps({"gemma3": {"en-de": {"slope": 0.0, "intercept": 5.0}}}),
        policy="flag",
        retry_form=engine.prompts.retry_form,  # as the builder gives it
    )
    engine.start()
    try:
        result = tight.submit_translation(
            TranslationRequest(request_id="g1", text=AGENT_TURN, source_lang="en", target_lang="de")
        ).result(timeout=600)
    finally:
        engine.stop(drain=True, timeout=60)
    # the first run and the retry both stop at 5 tokens: answered, flagged, and said so
    assert result.finish_reason is FinishReason.LENGTH
    assert len(result.token_ids) == 5
    assert result.notes[NOTE_KEY] == "flagged"
    assert result.notes[FINISH_REASON_KEY] == GUARD_REASON


# -- SmolLM2-135M-Instruct (ChatML template) --------------------------------------------------


@pytest.fixture(scope="module")
def smol(smollm2: Any) -> Engine:
    return Engine(smollm2, EngineConfig(max_new_tokens=256))


def test_smollm2_stops_at_the_turn_end(smol: Engine) -> None:
    im_end = smol.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in smol.prompts.stop_rules.eos_ids
    assert smol.prompts.default_form == "short_mix8_instructed"
    (result,) = smol.generate([smol.translation_request("Where is my order?", "en", "de")])
    # ended by the turn marker (dropped from the output), not by a cap: no next turn follows
    assert result.finish_reason is FinishReason.STOP
    assert result.tokens_out < 30
    assert result.text and "\n" not in result.text
    assert "im_start" not in result.text and "user" not in result.text


@pytest.mark.parametrize("source", ["Ja, um 19:10 Uhr.", "Ja."])
def test_smollm2_chat_reply_is_retried_then_withheld(smol: Engine, source: str) -> None:
    # short German customer turns SmolLM2 answers as a chat partner under the default form
    # ("Ja." -> "I'm sorry for your loss"); the retry form does no better: no translation goes
    # out, the reply says why and carries the candidate
    (first,) = smol.generate([smol.translation_request(source, "de", "en")])
    assert first.text.startswith("I'm sorry")
    guarded = FaithfulEngine(smol, retry_form=smol.prompts.retry_form)
    smol.start()
    try:
        result = guarded.submit_translation(
            TranslationRequest(request_id="s1", text=source, source_lang="de", target_lang="en")
        ).result(timeout=600)
    finally:
        smol.stop(drain=True, timeout=60)
    assert result.finish_reason is FinishReason.WITHHELD and result.text == ""
    assert result.error and result.error.startswith("unfaithful translation withheld")
    assert result.notes[NOTE_KEY] == "withheld"
    assert "ratio" in result.notes[f"{NOTE_KEY}.first"]
    assert result.notes[f"{NOTE_KEY}.retry"] == "suspect too"
    assert result.notes[CANDIDATE_KEY]
    assert len(result.token_ids) <= guarded.length_cap(source, "de", "en")


def test_smollm2_tight_cap_stops_the_generation_and_says_so(smol: Engine) -> None:
    tight = FaithfulEngine(
        smol,
        caps=LengthCaps({"smollm2": {"en-de": {"slope": 0.0, "intercept": 4.0}}}),
        policy="flag",
        retry_form=smol.prompts.retry_form,
    )
    smol.start()
    try:
        result = tight.submit_translation(
            TranslationRequest(request_id="s2", text=AGENT_TURN, source_lang="en", target_lang="de")
        ).result(timeout=600)
    finally:
        smol.stop(drain=True, timeout=60)
    assert len(result.token_ids) == 4
    assert result.notes[NOTE_KEY] == "flagged"
    assert result.notes[FINISH_REASON_KEY] == GUARD_REASON
