"""Dropped names: proper names of the source that its translation lost. A pure function.

A small model rewrites what it cannot place: "... wollen heute Abend Aquaman sehen." -> "... go
to the beach today." (issue #28: the film's name gone). Names, brands and places are copied
between the languages tolk serves, so one that the translation does not hold is a lost fact.
`dropped_names(source, translation, source_lang)` returns them, in source order:

- **candidates**: words of the source that start with a capital letter, not at a sentence start
  (after `.!?:;` or a line break, quotes and brackets skipped), at least `MIN_NAME_CHARS` long,
  not all capitals (acronyms such as "EU" or "USA" are translated as often as copied), and
  outside the protected spans (`#NAME#`, URLs, e-mail addresses, ids: `spans.py` checks
  those); plus words with a capital after a small letter anywhere ("iPhone", "eBay");
- **not common words** of the source language: German capitalises every noun ("heute *Abend*"),
  English its days, months and languages ("on *Monday*"), and those are translated, not
  copied. The lists (`common_words.json`, built by `bench/common_words.py` from the training
  sides of data/: BConTrasT train and Tatoeba, never the dev or FLORES sets the check is
  measured on) hold every word seen in a language's text there, less the capitalised words
  that the aligned human translation copied *capitalised* at least half the time (names: "Tom",
  "Berlin"; not "Moment" -> "moment"); in German also a listed word with a noun ending
  ("Tischen") and listed words of 4+ letters run together ("Ersatz|gerät", "Preis|gestaltung",
  a linking "s" allowed); a hyphenated word is judged part by part;
- **kept**: the name in the translation after case and accent folding (umlauts as "ae" too),
  also inside a longer word ("Aquaman-Film", "Annas"), or, for names of 6+ letters, its first
  all-but-two letters ("Berlin" in "Berliner").

A language without a list gets no candidates (the check cannot tell its names from its nouns).
What it misses by design: names that are also common words ("Rose"), names at a sentence
start, and exonyms ("München" -> "Munich" is called dropped unless the list knows the pair).
The faithfulness stage counts what it finds (`tolk_faithful_checks_total{check="name"}`) and,
until its precision on a judged sample is known, does not retry or withhold for it
(docs/PROMPTS.md). No model, no Kafka.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Mapping
from functools import cache
from importlib import resources

from workers.stages.protected.rules import find_spans

__all__ = [
    "MIN_NAME_CHARS",
    "common_words",
    "dropped_names",
    "fold",
    "is_sentence_start",
    "name_candidates",
    "words",
]

MIN_NAME_CHARS = 3  # shorter capitalised words ("Mr", "OK") are never names here
MIN_PART_CHARS = 4  # each part of a compound of common words
PREFIX_FROM_CHARS = 6  # from this length on, a name's stem (all but 2 letters) counts as kept
MAX_COMPOUND_CHARS = 64  # longer words are not split into listed parts

_WORD = re.compile(r"[^\W\d_][\w'’-]*")
_QUOTES = "\"'“”„‚‘’«»‹›()[]{}¿¡*-–—•·>"  # skipped when looking for a sentence's end
COMPOUNDING = ("de",)  # languages that write compounds as one word ("Ersatzgerät")
SUFFIXES = ("n", "en", "s", "es", "e", "er", "ern")  # German noun endings tried off a word
_ENDS = ".!?:;…\n"
_CAMEL = re.compile(r"[a-zà-ÿ][A-ZÀ-Þ]")


def words(text: str) -> list[tuple[int, str]]:
    """(offset, word) of every word of `text` that starts with a letter (trailing apostrophes
    and hyphens cut)."""
    out = []
    for m in _WORD.finditer(text):
        word = m.group().rstrip("'’-")
        if word:
            out.append((m.start(), word))
    return out


def is_sentence_start(text: str, offset: int) -> bool:
    """Whether the word at `offset` opens a sentence (or the text)."""
    before = text[:offset].rstrip(" \t\r").rstrip(_QUOTES + " ")
    return not before or before[-1] in _ENDS


def fold(text: str) -> str:
    """Case and accents folded, ß as ss: the form names are compared in."""
    decomposed = unicodedata.normalize("NFKD", text.casefold().replace("ß", "ss"))
    return "".join(c for c in decomposed if not unicodedata.combining(c))


def _umlauts_spelled(text: str) -> str:
    return text.casefold().replace("ä", "ae").replace("ö", "oe").replace("ü", "ue")


def name_candidates(source: str) -> list[str]:
    """The source's words that look like names before the common-word test (see above); a
    hyphenated word counts part by part ("Starbucks-Abholauftrag")."""
    masked = source
    for span in find_spans(source):  # placeholders, URLs, ids: spans.py's to check
        masked = masked.replace(span.text, " " * len(span.text))
    out = []
    for offset, word in words(masked):
        start = is_sentence_start(masked, offset)
        for i, part in enumerate(p for p in word.split("-") if p):
            if len(part) < MIN_NAME_CHARS or part.isupper():
                continue
            if _CAMEL.search(part) or (part[0].isupper() and not (start and i == 0)):
                out.append(part)
    return out


@cache
def _packaged() -> dict[str, frozenset[str]]:
    path = resources.files("workers.stages.faithful").joinpath("common_words.json")
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return {lang: frozenset(ws) for lang, ws in data["languages"].items()}


def common_words(lang: str) -> frozenset[str] | None:
    """The packaged common words of `lang` (casefolded), None for a language without a list."""
    return _packaged().get(lang)


def _is_common(word: str, common: frozenset[str], compounding: bool) -> bool:
    """In the list; for a compounding language also with a noun ending off, or as words of the
    list run together (any number, each of 4+ letters, a linking "s" allowed)."""
    w = word.casefold()
    if not compounding:
        return w in common
    return _listed(w, common) or _compound(w, common)


def _listed(w: str, common: frozenset[str]) -> bool:
    """In the list as it is or with a noun ending off."""
    return w in common or any(w.endswith(x) and w[: -len(x)] in common for x in SUFFIXES)


def _compound(w: str, common: frozenset[str]) -> bool:
    """`w` as listed words run together; each suffix of `w` is judged once (the texts are
    untrusted: without the memo a crafted word of overlapping listed parts takes exponential
    time), and words over `MAX_COMPOUND_CHARS` are not split."""
    if len(w) > MAX_COMPOUND_CHARS:
        return False
    memo: dict[int, bool] = {}

    def from_(i: int) -> bool:  # whether w[i:] splits into listed parts (two at least overall)
        if i in memo:
            return memo[i]
        found = False
        for cut in range(i + MIN_PART_CHARS, len(w) - MIN_PART_CHARS + 1):
            head, rest = w[i:cut], w[cut:]
            linked = head.endswith("s") and head[:-1] in common
            if (_listed(head, common) or linked) and (_listed(rest, common) or from_(cut)):
                found = True
                break
        memo[i] = found
        return found

    return from_(0)


def _kept(name: str, folded_translation: str, spelled_translation: str) -> bool:
    f = fold(name)
    if f in folded_translation or _umlauts_spelled(name) in spelled_translation:
        return True
    if f.endswith("s") and len(f) > 4 and f[:-1] in folded_translation:  # "Annas" / "Anna's"
        return True
    return len(f) >= PREFIX_FROM_CHARS and f[:-2] in folded_translation


def dropped_names(
    source: str,
    translation: str,
    source_lang: str,
    lists: Mapping[str, frozenset[str]] | None = None,
) -> tuple[str, ...]:
    """The names of `source` missing from `translation` (module docstring); `lists`: common
    words per language instead of the packaged ones (tests)."""
    common = (lists if lists is not None else _packaged()).get(source_lang)
    if common is None:
        return ()
    folded, spelled = fold(translation), _umlauts_spelled(translation)
    dropped: list[str] = []
    for name in name_candidates(source):
        if name in dropped or _is_common(name, common, source_lang in COMPOUNDING):
            continue
        if not _kept(name, folded, spelled):
            dropped.append(name)
    return tuple(dropped)
