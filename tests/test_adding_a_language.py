"""docs/ARCHITECTURE.md's checklist "Adding a language", carried out once (issue 27 item 7).

Portuguese is not one of the shipped languages. The test adds it the way the checklist says
and checks what each step buys, before and after:

1. its policy through `TOLK_POLICIES` and its code in `TOLK_LANGUAGES` (settings at the edge);
2. its name and its side of every few-shot example in the prompt data (`prompts.json`, here a
   patched copy): the prompt builder refuses `pt` before (`UnsupportedLanguage`, an ERROR reply
   for the requester) and builds its prefix after, with the Portuguese examples in it;
3. its topics from the catalog, and the topic read back as the language.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.fake_tokenizer import CharTokenizer
from topics.catalog import catalog, language_of, request_topic
from workers.engine import prompts
from workers.engine.prompts import PromptBuilder
from workers.engine.types import UnsupportedLanguage
from workers.settings import Settings


def _with_portuguese(data: dict[str, Any]) -> dict[str, Any]:
    """Step 2 on a copy of the prompt data: the name, a Portuguese side for every example
    (marked, so the test can find them in the prefix), and the sources its examples show."""
    data = copy.deepcopy(data)
    data["languages"]["pt"] = "Portuguese"
    for examples in data["example_sets"].values():
        for example in examples:
            example["pt"] = f"[pt] {example['en']}"
    data["example_sources"]["pt"] = list(data["example_sources"]["es"])
    return data


def test_adding_portuguese_follows_the_checklist(monkeypatch: pytest.MonkeyPatch) -> None:
    shipped = prompts._templates()
    assert "pt" not in shipped["languages"]  # the test adds a language that is not there

    # 1. policy and language list, read once at the edge
    settings = Settings.from_env({"TOLK_LANGUAGES": "de,pt", "TOLK_POLICIES": "pt:2:4.5:64:96"})
    assert settings.languages == ("de", "pt")
    pt = settings.policies["pt"]
    assert (pt.weight, pt.slo_p99_s, pt.max_queue, pt.max_new_tokens) == (2.0, 4.5, 64, 96)
    assert settings.policies["de"] == Settings.from_env({}).policies["de"]  # others unchanged

    # 2. the prompt data: refused before, built after
    before = PromptBuilder(CharTokenizer(), "gemma3", bos_id=None, eos_ids={0})
    with pytest.raises(UnsupportedLanguage, match="'pt'"):
        before.prefix_text("pt")
    monkeypatch.setattr(prompts, "_templates", lambda: _with_portuguese(shipped))
    after = PromptBuilder(CharTokenizer(), "gemma3", bos_id=None, eos_ids={0})
    assert "pt" in after.languages
    prefix = after.prefix_text("pt")
    assert "Portuguese" in prefix
    shown = [e["pt"] for e in after.examples(None, "pt")]
    assert shown and all(text in prefix for text in shown)
    assert after.prefix_text("de") == before.prefix_text("de")  # German's prompt byte for byte
    ids, prefix_len = after.build("Where is my parcel?", "en", "pt")
    assert ids[:prefix_len] == after.prefix_ids("pt") and prefix_len < len(ids)

    # 3. the topics, and the topic read back as the language
    names = [spec.name for spec in catalog(settings.languages, prefix="t.")]
    assert request_topic("pt", "t.") in names
    assert language_of(request_topic("pt", "t."), "t.") == "pt"
