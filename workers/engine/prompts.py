"""Translation prompts: `(text, source_lang, target_lang) -> token ids`, cut into prefix + query.

Templates live in `prompts.json` beside this file (data, not code): a few-shot template for base
models (Gemma 3 270M) and a ChatML template for instruct models (SmolLM2-Instruct). The prefix,
i.e. instructions plus few-shot examples, depends only on the *target* language, so each
per-language topic has one prompt prefix whose KV blocks the prefix cache shares across all of
its requests (and the engine warms at start-up).

Prefix and query are tokenized separately and concatenated, so the prefix's token ids are the
same for every request whatever text follows (a joint tokenization could merge tokens across the
boundary and break sharing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Protocol

from workers.engine.types import UnsupportedLanguage


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def convert_tokens_to_ids(self, tokens: str) -> int | None: ...

    def get_vocab(self) -> dict[str, int]: ...


@cache
def _templates() -> dict[str, Any]:
    with resources.files("workers.engine").joinpath("prompts.json").open(encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


@dataclass(frozen=True, slots=True)
class StopRules:
    eos_ids: frozenset[int]  # token ids that end generation (dropped from the output)
    stop_at_newline: bool
    stop_strings: tuple[str, ...]


class PromptBuilder:
    """Builds translation prompts for one model; caches the tokenized prefix per language."""

    def __init__(self, tokenizer: Tokenizer, arch: str, bos_id: int | None, eos_ids: set[int]):
        data = _templates()
        self.language_names: dict[str, str] = data["languages"]
        name = data["models"].get(arch, "fewshot")
        if name == "chatml" and "<|im_start|>" not in tokenizer.get_vocab():
            name = "fewshot"  # a Llama checkpoint without ChatML tokens: base-model prompt
        self.template_name = name
        self._t: dict[str, Any] = data["templates"][name]
        self._examples: list[dict[str, str]] = data["examples"]
        self._example_sources: dict[str, list[str]] = data["example_sources"]
        self.tokenizer = tokenizer
        self.bos_id = bos_id
        stop_ids = set(eos_ids)
        for tok in self._t.get("stop_tokens", []):
            tid = tokenizer.convert_tokens_to_ids(tok)
            if tid is not None:
                stop_ids.add(tid)
        self.stop_rules = StopRules(
            frozenset(stop_ids), bool(self._t.get("stop_at_newline", True)), ()
        )
        self._prefix_cache: dict[str, list[int]] = {}

    @property
    def languages(self) -> tuple[str, ...]:
        return tuple(self.language_names)

    def _name(self, lang: str) -> str:
        try:
            return self.language_names[lang]
        except KeyError:
            known = ", ".join(self.language_names)
            raise UnsupportedLanguage(f"unsupported language {lang!r} (known: {known})") from None

    def prefix_text(self, target_lang: str) -> str:
        tgt_name = self._name(target_lang)
        parts = [self._t["prefix"].format(tgt_name=tgt_name)]
        for example, src in zip(self._examples, self._example_sources[target_lang], strict=False):
            parts.append(
                self._t["example"].format(
                    src_name=self.language_names[src],
                    tgt_name=tgt_name,
                    src_text=example[src],
                    tgt_text=example[target_lang],
                )
            )
        return "".join(parts)

    def query_text(self, text: str, source_lang: str, target_lang: str) -> str:
        src_name = self._name(source_lang) if source_lang else "Text"
        tgt_name = self._name(target_lang)
        return self._t["query"].format(src_name=src_name, tgt_name=tgt_name, text=text)

    def prefix_ids(self, target_lang: str) -> list[int]:
        ids = self._prefix_cache.get(target_lang)
        if ids is None:
            ids = self.tokenizer.encode(self.prefix_text(target_lang), add_special_tokens=False)
            if self.bos_id is not None and self._t.get("add_bos", True):
                ids = [self.bos_id, *ids]
            self._prefix_cache[target_lang] = ids
        return ids

    def build(self, text: str, source_lang: str, target_lang: str) -> tuple[list[int], int]:
        """Token ids of the full prompt and the length of its shareable prefix."""
        prefix = self.prefix_ids(target_lang)
        query = self.tokenizer.encode(
            self.query_text(text, source_lang, target_lang), add_special_tokens=False
        )
        return [*prefix, *query], len(prefix)

    def finish_text(self, generated: str) -> str:
        """Cut decoded output at the stop rule and trim the space the template leaves."""
        if self.stop_rules.stop_at_newline:
            generated = generated.split("\n", 1)[0]
        for s in self.stop_rules.stop_strings:
            generated = generated.split(s, 1)[0]
        return generated.strip()
