"""Translation prompts: `(text, source_lang, target_lang) -> token ids`, cut into prefix + query.

Templates live in `prompts.json` beside this file (data, not code): a few-shot template for base
models (Gemma 3 270M) and a ChatML template for instruct models (SmolLM2-Instruct, Qwen 2.5 and
Qwen 3 Instruct: their own default form asks, in the system turn, for the translation only with
names, numbers, codes and placeholders kept as written). The prefix,
i.e. instructions plus few-shot examples, depends only on the *target* language, so each
per-language topic has one prompt prefix whose KV blocks the prefix cache shares across all of
its requests (and the engine warms at start-up).

A *prompt form* (`forms` in the JSON) says which named example set the prefix shows, how many
of its examples, and which instruction line: `support8` (the form before issue #18, whose
"Thank you for your patience ..." example Gemma 3 copied as the translation of "Thanks"),
`short_mix8` (short chat turns among the sentences), `zero_shot` (no examples), ... A form may
also name a `layout` (where the source sits in a turn: the template's `example_<layout>` and
`query_<layout>`, e.g. SmolLM2's `instructed` turns that repeat "Translate this German text
into English:" before every source) and `examples_by_target` (another example set for one
target language, leaving every other language's prompt as it was). Each
template has a default form and a retry form (`default_form`, `retry_form`; an architecture may
override both, `default_form_by_arch`, `retry_form_by_arch`): the faithfulness
wrapper (`workers/stages/faithful/stage.py`) retries a suspect translation once with the retry form.
`build(..., form=)` takes any form; each (form, target language) prefix is cached apart.
docs/PROMPTS.md has the measured comparison that chose the defaults.

Prefix and query are tokenized separately and concatenated, so the prefix's token ids are the
same for every request whatever text follows (a joint tokenization could merge tokens across the
boundary and break sharing).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
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


@cache
def prompt_set_version() -> str:
    """The prompt set's version: a hash of `prompts.json` (templates, examples, stop rules).
    The exact-match translation cache keys on it (workers/stages/cache/key.py), so editing the
    prompt set retires every cached translation."""
    data = resources.files("workers.engine").joinpath("prompts.json").read_bytes()
    return hashlib.sha256(data).hexdigest()[:16]


def prompt_examples() -> list[dict[str, str]]:
    """Every few-shot example of every set (language -> text): what a translation must not copy
    unless its source is that example's source (`workers.stages.faithful.rules.leaked_example`)."""
    sets: dict[str, list[dict[str, str]]] = _templates()["example_sets"]
    return [dict(example) for examples in sets.values() for example in examples]


def prompt_forms() -> tuple[str, ...]:
    """The names of the prompt forms `PromptBuilder.build` takes."""
    return tuple(_templates()["forms"])


@dataclass(frozen=True, slots=True)
class StopRules:
    eos_ids: frozenset[int]  # token ids that end generation (dropped from the output)
    stop_at_newline: bool
    stop_strings: tuple[str, ...]


class PromptBuilder:
    """Builds translation prompts for one model; caches the tokenized prefix per language."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        arch: str,
        bos_id: int | None,
        eos_ids: set[int],
        form: str | None = None,
    ):
        """`form`: the default prompt form of `build` (None: the template's `default_form`)."""
        data = _templates()
        self.language_names: dict[str, str] = data["languages"]
        name = data["models"].get(arch, "fewshot")
        if name == "chatml" and "<|im_start|>" not in tokenizer.get_vocab():
            name = "fewshot"  # a Llama checkpoint without ChatML tokens: base-model prompt
        self.template_name = name
        self._t: dict[str, Any] = data["templates"][name]
        self._forms: dict[str, dict[str, Any]] = data["forms"]
        self._example_sets: dict[str, list[dict[str, str]]] = data["example_sets"]
        self._example_sources: dict[str, list[str]] = data["example_sources"]
        # an architecture's own forms (Qwen: the "keep" instruction) where it got its template
        own = arch if data["models"].get(arch) == name else ""
        self.default_form = form or data["default_form_by_arch"].get(
            own, data["default_form"][name]
        )
        self.retry_form = data["retry_form_by_arch"].get(own, data["retry_form"][name])
        for f in (self.default_form, self.retry_form):
            self._form(f)  # an unknown form fails here, not at the first request
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
        self._prefix_cache: dict[tuple[str, str], list[int]] = {}  # (form, target) -> ids

    @property
    def languages(self) -> tuple[str, ...]:
        return tuple(self.language_names)

    def _name(self, lang: str) -> str:
        try:
            return self.language_names[lang]
        except KeyError:
            known = ", ".join(self.language_names)
            raise UnsupportedLanguage(f"unsupported language {lang!r} (known: {known})") from None

    def _form(self, form: str | None) -> dict[str, Any]:
        name = form or self.default_form
        try:
            return self._forms[name]
        except KeyError:
            known = ", ".join(self._forms)
            raise ValueError(f"unknown prompt form {name!r} (known: {known})") from None

    def examples(
        self, form: str | None = None, target_lang: str | None = None
    ) -> list[dict[str, str]]:
        """The examples (language -> text) the prefix of `form` shows, in order; a form's
        `examples_by_target` gives one target language another set (the others' prompts stay
        byte for byte the same)."""
        f = self._form(form)
        name = f.get("examples_by_target", {}).get(target_lang or "", f.get("examples"))
        if not name:
            return []
        return self._example_sets[name][: int(f.get("max_examples", 8))]

    def prefix_text(self, target_lang: str, form: str | None = None) -> str:
        tgt_name = self._name(target_lang)
        instruction = self._form(form).get("instruction")
        prefix = self._t[f"prefix_{instruction}"] if instruction else self._t["prefix"]
        parts = [prefix.format(tgt_name=tgt_name)]
        examples = self.examples(form, target_lang)
        example_template = self._layout_part("example", form)
        for example, src in zip(examples, self._example_sources[target_lang], strict=False):
            parts.append(
                example_template.format(
                    src_name=self.language_names[src],
                    tgt_name=tgt_name,
                    src_text=example[src],
                    tgt_text=example[target_lang],
                )
            )
        return "".join(parts)

    def _layout_part(self, part: str, form: str | None) -> str:
        """The template's `part` ("example" or "query") in the form's layout: a form with
        `"layout": "NAME"` uses the template's `part_NAME` (where the source sits in the turn)."""
        layout = self._form(form).get("layout")  # a template without it keeps its own
        return str(self._t.get(f"{part}_{layout}", self._t[part]) if layout else self._t[part])

    def query_text(
        self, text: str, source_lang: str, target_lang: str, form: str | None = None
    ) -> str:
        src_name = self._name(source_lang) if source_lang else "Text"
        tgt_name = self._name(target_lang)
        return self._layout_part("query", form).format(
            src_name=src_name, tgt_name=tgt_name, text=text
        )

    def prefix_ids(self, target_lang: str, form: str | None = None) -> list[int]:
        key = (form or self.default_form, target_lang)
        ids = self._prefix_cache.get(key)
        if ids is None:
            text = self.prefix_text(target_lang, form)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if self.bos_id is not None and self._t.get("add_bos", True):
                ids = [self.bos_id, *ids]
            self._prefix_cache[key] = ids
        return ids

    def retrieved_examples_text(
        self,
        examples: Sequence[tuple[str, str]],
        source_lang: str,
        target_lang: str,
        form: str | None = None,
    ) -> str:
        """Request-specific (source, target) examples, e.g. the nearest translation-memory
        pairs (`workers/stages/examples/stage.py`), in the form's example layout. They go between
        the
        cached prefix and the query, in the order given (the tm wrapper puts the nearest last)."""
        src_name = self._name(source_lang) if source_lang else "Text"
        tgt_name = self._name(target_lang)
        template = self._layout_part("example", form)
        return "".join(
            template.format(src_name=src_name, tgt_name=tgt_name, src_text=src, tgt_text=tgt)
            for src, tgt in examples
        )

    def build(
        self,
        text: str,
        source_lang: str,
        target_lang: str,
        form: str | None = None,
        examples: Sequence[tuple[str, str]] = (),
    ) -> tuple[list[int], int]:
        """Token ids of the full prompt and the length of its shareable prefix; `form`: a
        prompt form of `prompts.json` (None: this builder's default form); `examples`:
        (source, target) pairs shown after the prefix, before the query (tokenized on their
        own, so the prefix's ids and its prefix-cache blocks stay those of every request)."""
        prefix = self.prefix_ids(target_lang, form)
        retrieved: list[int] = []
        if examples:
            retrieved = self.tokenizer.encode(
                self.retrieved_examples_text(examples, source_lang, target_lang, form),
                add_special_tokens=False,
            )
        query = self.tokenizer.encode(
            self.query_text(text, source_lang, target_lang, form), add_special_tokens=False
        )
        return [*prefix, *retrieved, *query], len(prefix)

    def answer_frame(self, form: str | None = None) -> tuple[str, str] | None:
        """(lead, end): what the form's example turn puts before and after the answer that
        its query leaves open, e.g. (" ", "\\n\\n") for the few-shot template and
        ("", "<|im_end|>\\n") for ChatML. A finished turn shown as conversation history
        (`workers/stages/context/rules.py`) is its query's ids, the answer's ids and then `end`, so
        the next
        prompt starts with the previous prompt and its generated answer. None when the
        example does not begin with the query (a layout that puts the source elsewhere)."""
        marks = {"src_name": "\x00S", "tgt_name": "\x00T"}
        example = self._layout_part("example", form).format(
            **marks, src_text="\x01", tgt_text="\x02"
        )
        query = self._layout_part("query", form).format(**marks, text="\x01")
        if not example.startswith(query) or "\x02" not in example[len(query) :]:
            return None
        lead, _, end = example[len(query) :].partition("\x02")
        return lead, end

    def finish_text(self, generated: str) -> str:
        """Cut decoded output at the stop rule and trim the space the template leaves."""
        if self.stop_rules.stop_at_newline:
            generated = generated.split("\n", 1)[0]
        for s in self.stop_rules.stop_strings:
            generated = generated.split(s, 1)[0]
        return generated.strip()
