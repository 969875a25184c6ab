"""Prompt forms of workers/engine/prompts.json (issue #18's prompt review): a form's `layout`
(where the source sits in the turn), its `examples_by_target` (another example set for one
target language only), and the defaults the review chose. Pure: a character tokenizer, no
model."""

from __future__ import annotations

import pytest

from tests.fake_tokenizer import CharTokenizer
from workers.engine.prompts import PromptBuilder, prompt_forms


@pytest.fixture
def chatml() -> PromptBuilder:
    return PromptBuilder(CharTokenizer(chatml=True), "llama", None, {0})


@pytest.fixture
def fewshot() -> PromptBuilder:
    return PromptBuilder(CharTokenizer(chatml=False), "gemma3", 5, {0})


def test_the_instructed_layout_puts_the_instruction_in_every_user_turn(
    chatml: PromptBuilder,
) -> None:
    query = chatml.query_text("Ja, bitte.", "de", "en", form="short_mix8_instructed")
    assert query == (
        "<|im_start|>user\nTranslate this German text into English:\nJa, bitte.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    prefix = chatml.prefix_text("en", form="short_mix8_instructed")
    # each of the 8 examples is a user turn with the instruction, then its answer
    assert prefix.count("Translate this ") == 8
    assert "text into English:\nGrazie!<|im_end|>" not in prefix  # the sources of target en
    assert "Translate this German text into English:\nDanke!<|im_end|>\n" in prefix
    # the plain layout keeps the bare source in the user turn
    plain = chatml.query_text("Ja, bitte.", "de", "en", form="short_mix8")
    assert plain == "<|im_start|>user\nJa, bitte.<|im_end|>\n<|im_start|>assistant\n"


def test_build_tokenizes_the_query_in_the_forms_layout(chatml: PromptBuilder) -> None:
    ids, n_prefix = chatml.build("Okay.", "de", "en", form="short_mix8_instructed")
    text = CharTokenizer(chatml=True).decode(ids)
    assert text[n_prefix:].startswith("<|im_start|>user\nTranslate this German text into")
    assert text.endswith("Okay.<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_without_the_layout_keeps_its_own_turns(fewshot: PromptBuilder) -> None:
    # forms are shared by the templates: the few-shot one has no `instructed` parts
    assert fewshot.query_text("Okay.", "de", "en", form="short_mix8_instructed") == (
        "German: Okay.\nEnglish:"
    )
    assert fewshot.prefix_text("en", form="short_mix8_instructed") == fewshot.prefix_text(
        "en", form="short_mix8"
    )


def test_examples_by_target_changes_only_that_targets_prefix(fewshot: PromptBuilder) -> None:
    form = fewshot.default_form
    for lang in ("en", "de", "es", "it"):
        assert fewshot.prefix_text(lang, form) == fewshot.prefix_text(lang, "support_thanks8")
    french, before = fewshot.prefix_text("fr", form), fewshot.prefix_text("fr", "support_thanks8")
    assert french != before
    assert "French: Merci !\n" in before and "French: Merci !\n" not in french
    assert "French: J'attends une réponse depuis la semaine dernière.\n" in french
    # the other seven French examples stay where they were
    assert french.split("\n\n")[:7] == before.split("\n\n")[:7]


def test_the_reviewed_defaults() -> None:
    # docs/PROMPTS.md has the measurements that chose them
    chat = PromptBuilder(CharTokenizer(chatml=True), "llama", None, {0})
    few = PromptBuilder(CharTokenizer(chatml=False), "gemma3", 5, {0})
    assert (chat.default_form, chat.retry_form) == ("short_mix8_instructed", "short_mix8")
    assert (few.default_form, few.retry_form) == ("support_thanks8_waiting_fr", "short_mix8")
    assert set(prompt_forms()) >= {"support8", "support_thanks8", "short_mix8_instructed"}


def test_qwen_asks_for_the_translation_only_keeping_names_and_numbers() -> None:
    qwen = PromptBuilder(CharTokenizer(chatml=True), "qwen2", None, {0})
    assert qwen.template_name == "chatml"
    assert (qwen.default_form, qwen.retry_form) == ("keep_short_mix8_instructed", "keep_instructed")
    system = qwen.prefix_text("de").split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n") and "into German" in system
    assert "translation only" in system and "names, numbers, codes and placeholders" in system
    assert qwen.prefix_text("de").count("Translate this ") == 8  # the examples, instructed
    # the retry form: the same instruction, no examples
    retry = qwen.prefix_text("de", qwen.retry_form)
    assert retry == system + "<|im_end|>\n"
    ids, n_prefix = qwen.build("Order 4711 for Anna.", "en", "de")
    text = CharTokenizer(chatml=True).decode(ids)
    assert text[n_prefix:] == (
        "<|im_start|>user\nTranslate this English text into German:\nOrder 4711 for Anna."
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert qwen.answer_frame() == ("", "<|im_end|>\n")  # the answer is the assistant turn


def test_a_qwen_checkpoint_without_chat_tokens_falls_back_to_the_fewshot_forms() -> None:
    base = PromptBuilder(CharTokenizer(chatml=False), "qwen2", None, {0})
    assert base.template_name == "fewshot"
    assert (base.default_form, base.retry_form) == ("support_thanks8_waiting_fr", "short_mix8")
