"""Faithfulness checks of one translation, and the per-pair length cap: pure functions.

Small models translate by continuing a prompt, and they fail in ways seen in real chat
turns (issue #18): they copy a few-shot example's target instead of translating ("Thanks" ->
"Vielen Dank für Ihre Geduld. Ihr Ersatzgerät wird morgen verschickt."), they wrap a short
source in invented text (three times its length), and they loop ("... und und und ...") until
a cap stops them. Each has a detector here, and `check` runs them all:

- `leaked_example`: the translation reproduces most of an example's target (60 % of the
  target's characters in common blocks of 4+ characters, after case and space folding) while
  the source is not that example's source in any language (close as a string, or holding 60 %
  of the example's words). A source that *is* an example
  (a customer typing "My order has not arrived yet.") may get the example's translation; an
  example target under 20 characters ("Danke!") is an ordinary answer and never a leak.
- `ratio_outlier`: characters of translation / characters of source outside [0.3, 3]
  (the issue's bounds), with `SHORT_SLACK_CHARS` more allowed on top: a very short source
  has normal translations past 3x ("Ok." -> "In Ordnung.", 3.7x), and 4 characters cover
  99.5 % of the references of sources under 12 characters in data/ (BConTrasT train, Tatoeba).
  That slack is what catches a fluent answer that is not a translation of a one-word turn
  ("Ja." -> "I'm sorry for your loss", 23 characters for 3; a floor of 12 source characters
  let it through until the third round of issue #18). The lower bound applies from
  `MIN_RATIO_CHARS` source characters on; an empty translation of a non-empty source is an
  outlier.
- `ngram_loop`: a word n-gram (n = 1..6) repeated back to back at least 3 times covering at
  least 6 words, or a 3+-word n-gram occurring 3+ times anywhere, when the source does not
  repeat it as often itself.
- `invented_numbers` (issue #28, `workers/stages/faithful/numbers.py`): numbers in digits in
  the translation that no number of the source supports ("we can offer compensation" -> "eine
  120€-Entschädigung"), after normalising separators, clock times and number words.
- `dropped_spans` (issue #28, `workers/stages/faithful/spans.py`): placeholders, links, e-mail
  addresses and ids of the source missing from the translation ("Hi #NAME#, thanks for
  contacting #PRS_ORG#." -> "Hallo, #NAME#, ich freue mich auf dich!").
- `language_problem` (issue #28, `workers/text/language.py`): the translation is
  confidently in the source language ("untranslated") or a third one ("wrong_language"), by
  lingua among the pair's and a few common languages; short texts are never called. Only when
  the caller gives the source language.
- `dropped_names` (issue #28, `workers/stages/faithful/names.py`): proper names of the source
  missing from the translation ("... heute Abend Aquaman sehen." -> "... go to the beach
  today."). Only with the source language. The mildest problem: the stage retries for it but,
  its precision being 0.80 on judged answers, sends an answer that still lacks a name flagged,
  never withheld (`stage.FLAG_ONLY`).

`LengthCaps` is the length guard: per language pair, a cap of `ceil(slope * source tokens +
intercept)` output tokens fitted on the parallel data in `data/` so that it covers
`COVERAGE` (99.5 %) of the human references (`fit_length_cap`; `bench/length_caps.py` fits
and writes `workers/length_caps.json`, one table per tokenizer). The wrapper
(`workers/stages/faithful/stage.py`) applies the tighter of it and the language's `max_new_tokens`.

No Kafka, no model, no threads: the worker's wrapper, the benchmark and replay share it.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from workers.stages.faithful.names import dropped_names
from workers.stages.faithful.numbers import invented_numbers
from workers.stages.faithful.spans import dropped_spans
from workers.text.language import language_problem

__all__ = [
    "COVERAGE",
    "LEAK_SHARE",
    "MIN_RATIO_CHARS",
    "RATIO_HIGH",
    "RATIO_LOW",
    "SHORT_SLACK_CHARS",
    "Check",
    "LengthCap",
    "LengthCaps",
    "check",
    "fit_length_cap",
    "leaked_example",
    "length_ratio",
    "ngram_loop",
    "ratio_outlier",
]

LEAK_SHARE = 0.6  # share of an example target's characters a leak reproduces
# a shorter example target ("Danke!", "Ja, bitte.") is an ordinary answer, not a leak
LEAK_MIN_CHARS = 20
SOURCE_MATCH = 0.8  # similarity at which a source counts as the example's own source
SOURCE_WORDS = 0.6  # ... or the share of the example's words the source holds
RATIO_LOW, RATIO_HIGH = 0.3, 3.0  # normal range of translation / source characters
MIN_RATIO_CHARS = 12  # the lower bound applies from this many source characters on
# characters allowed past RATIO_HIGH x the source: 99.5 % of the references of sources under
# 12 characters in data/ stay within it (residual len(ref) - 3 len(src), quantile 0.995: 3.3)
SHORT_SLACK_CHARS = 4
LOOP_MIN_REPEATS = 3
LOOP_MIN_WORDS = 6
COVERAGE = 0.995  # share of the references a fitted length cap must cover
SLOPES = tuple(1.0 + 0.05 * i for i in range(61))  # the fit's candidate slopes, 1.0 to 4.0

_WORD = re.compile(r"\w+", re.UNICODE)


def _fold(text: str) -> str:
    return " ".join(text.casefold().split())


def _similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, _fold(a), _fold(b), autojunk=False).ratio()


def _covered_share(target: str, translation: str) -> float:
    """Share of `target`'s characters found in `translation` in blocks of 4+ characters."""
    t, h = _fold(target), _fold(translation)
    if not t:
        return 0.0
    blocks = difflib.SequenceMatcher(None, t, h, autojunk=False).get_matching_blocks()
    return sum(b.size for b in blocks if b.size >= 4) / len(t)


def _is_source_of(source: str, example_text: str) -> bool:
    """The source is (a paraphrase of) the example: close as a string, or it holds most of the
    example's words ("Hi there, how can I help today?" for "Hello, how can I help you today?")."""
    if _similarity(source, example_text) >= SOURCE_MATCH:
        return True
    example_words = {w.casefold() for w in _WORD.findall(example_text)}
    source_words = {w.casefold() for w in _WORD.findall(source)}
    return bool(example_words) and len(example_words & source_words) >= SOURCE_WORDS * len(
        example_words
    )


def leaked_example(
    source: str, translation: str, examples: Sequence[Mapping[str, str]], target_lang: str
) -> int | None:
    """Index of the example whose `target_lang` text the translation copies while the source
    is not that example (in any of its languages); None when there is no such leak."""
    for i, example in enumerate(examples):
        target = example.get(target_lang, "")
        if len(target) < LEAK_MIN_CHARS or _covered_share(target, translation) < LEAK_SHARE:
            continue
        if any(_is_source_of(source, text) for text in example.values()):
            continue  # the source is this example: its translation is the right answer
        return i
    return None


def length_ratio(source: str, translation: str) -> float:
    """Characters of translation per character of source (stripped)."""
    src, hyp = source.strip(), translation.strip()
    return len(hyp) / max(1, len(src))


def ratio_outlier(source: str, translation: str) -> bool:
    """Translation length outside [RATIO_LOW, RATIO_HIGH] x the source's (see module notes)."""
    src, hyp = len(source.strip()), len(translation.strip())
    if src == 0:
        return False
    if hyp == 0:
        return True
    if hyp > RATIO_HIGH * src + SHORT_SLACK_CHARS:
        return True
    return src >= MIN_RATIO_CHARS and hyp < RATIO_LOW * src


def _max_tandem(words: Sequence[str]) -> tuple[int, int]:
    """(n, repeats) of the longest back-to-back run of one n-gram, by words covered."""
    best = (0, 0)
    for n in range(1, 7):
        for start in range(len(words) - n):
            reps = 1
            while words[start + reps * n : start + (reps + 1) * n] == words[start : start + n]:
                reps += 1
            if reps > 1 and n * reps > best[0] * best[1]:
                best = (n, reps)
    return best


def _max_ngram_count(words: Sequence[str], n: int = 3) -> int:
    grams = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    return max(grams.values(), default=0)


def ngram_loop(source: str, translation: str) -> bool:
    """A repeated n-gram loop in the translation that the source does not have itself."""
    words = [w.casefold() for w in _WORD.findall(translation)]
    n, reps = _max_tandem(words)
    src_words = [w.casefold() for w in _WORD.findall(source)]
    if reps >= LOOP_MIN_REPEATS and n * reps >= LOOP_MIN_WORDS:
        src_n, src_reps = _max_tandem(src_words)
        if src_reps < reps:
            return True
    count = _max_ngram_count(words)
    return count >= LOOP_MIN_REPEATS and _max_ngram_count(src_words) < count


@dataclass(frozen=True, slots=True)
class Check:
    """What the detectors found on one translation."""

    leaked_example: int | None = None  # index of the copied example
    ratio_outlier: bool = False
    ngram_loop: bool = False
    length_guard: bool = False  # generation stopped at the length cap
    invented_numbers: tuple[str, ...] = ()  # digits the source does not hold (numbers.py)
    dropped_spans: tuple[str, ...] = ()  # placeholders, links, ids it lost (spans.py)
    language: str | None = None  # "untranslated" / "wrong_language" (language.py)
    dropped_names: tuple[str, ...] = ()  # names it lost (names.py)

    @property
    def problems(self) -> tuple[str, ...]:
        """Names of what fired, in a fixed order ("" when nothing did)."""
        names = []
        if self.leaked_example is not None:
            names.append("leak")
        if self.ratio_outlier:
            names.append("ratio")
        if self.ngram_loop:
            names.append("loop")
        if self.length_guard:
            names.append("length_guard")
        if self.invented_numbers:
            names.append("number")
        if self.dropped_spans:
            names.append("dropped")
        if self.language is not None:
            names.append(self.language)
        if self.dropped_names:
            names.append("name")
        return tuple(names)

    @property
    def suspect(self) -> bool:
        return bool(self.problems)


def check(
    source: str,
    translation: str,
    examples: Sequence[Mapping[str, str]],
    target_lang: str,
    *,
    length_guard: bool = False,
    source_lang: str | None = None,
    languages: Sequence[str] = (),
) -> Check:
    """Every detector on one translation; `length_guard`: it was stopped by the length cap;
    `source_lang` turns the language check on (`languages`: more candidates for it, the
    worker's)."""
    return Check(
        leaked_example=leaked_example(source, translation, examples, target_lang),
        ratio_outlier=ratio_outlier(source, translation),
        ngram_loop=ngram_loop(source, translation),
        length_guard=length_guard,
        invented_numbers=invented_numbers(source, translation),
        dropped_spans=dropped_spans(source, translation),
        language=(
            language_problem(translation, source_lang, target_lang, languages, source)
            if source_lang
            else None
        ),
        dropped_names=(
            dropped_names(source, translation, source_lang, target_lang) if source_lang else ()
        ),
    )


# --- the length guard ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LengthCap:
    """`ceil(slope * source tokens + intercept)` output tokens for one language pair."""

    slope: float
    intercept: float

    def tokens(self, source_tokens: int) -> int:
        return max(1, math.ceil(self.slope * source_tokens + self.intercept))


def fit_length_cap(
    counts: Sequence[tuple[int, int]],
    coverage: float = COVERAGE,
    slopes: Sequence[float] = SLOPES,
    margin: int = 2,
) -> LengthCap:
    """The cap over (source tokens, reference tokens) pairs that covers `coverage` of them with
    the smallest mean cap: for each slope, the intercept is the `coverage` quantile of
    `reference - slope * source`; `margin` tokens more for what generation adds around the
    text (the leading space, the stop token)."""
    if not counts:
        raise ValueError("no (source, reference) token counts to fit")
    best: tuple[float, float, float] | None = None  # (mean cap, slope, intercept)
    for slope in slopes:
        residuals = sorted(ref - slope * src for src, ref in counts)
        k = min(len(residuals) - 1, math.ceil(coverage * len(residuals)) - 1)
        intercept = math.ceil(residuals[k]) + margin
        mean_cap = sum(slope * src + intercept for src, _ in counts) / len(counts)
        if best is None or mean_cap < best[0]:
            best = (mean_cap, slope, intercept)
    assert best is not None
    return LengthCap(round(best[1], 2), float(best[2]))


class LengthCaps:
    """Fitted caps per tokenizer and language pair (`length_caps.json`)."""

    def __init__(self, tables: Mapping[str, Mapping[str, Mapping[str, float]]]) -> None:
        self._tables = {
            tok: {
                pair: LengthCap(float(c["slope"]), float(c["intercept"])) for pair, c in t.items()
            }
            for tok, t in tables.items()
        }

    @classmethod
    def packaged(cls) -> LengthCaps:
        return cls(_packaged_tables())

    @property
    def tokenizers(self) -> tuple[str, ...]:
        return tuple(self._tables)

    def for_model(self, model_version: str) -> str | None:
        """The table of a model: the tokenizer key its name starts with ("gemma3-270m@A" ->
        "gemma3"); None when none fits (the caller then uses `loosest`)."""
        name = model_version.casefold()
        for tok in self._tables:
            if name.startswith(tok):
                return tok
        return None

    def cap(self, tokenizer: str | None, source_lang: str, target_lang: str) -> LengthCap:
        """The pair's cap in `tokenizer`'s table; for an unknown tokenizer or pair, the loosest
        cap of any table for the pair, else of any pair."""
        pair = f"{source_lang}-{target_lang}"
        table = self._tables.get(tokenizer or "", {})
        if pair in table:
            return table[pair]
        return self.loosest(pair)

    def loosest(self, pair: str | None = None) -> LengthCap:
        caps = [t[pair] for t in self._tables.values() if pair in t] if pair else []
        if not caps:
            caps = [c for t in self._tables.values() for c in t.values()]
        if not caps:
            return LengthCap(4.0, 16.0)  # no table at all: a generous default
        return LengthCap(max(c.slope for c in caps), max(c.intercept for c in caps))


@cache
def _packaged_tables() -> dict[str, Any]:
    with resources.files("workers").joinpath("length_caps.json").open(encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return {k: v for k, v in data["tokenizers"].items()}
