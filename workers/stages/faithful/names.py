"""Dropped names: proper names of the source that its translation lost. A pure function.

A small model rewrites what it cannot place: "... wollen heute Abend Aquaman sehen." -> "... go
to the beach today." (issue #28: the film's name gone). Names, brands and places are copied
between the languages tolk serves, so one that the translation does not hold is a lost fact.
`dropped_names(source, translation, source_lang, target_lang)` returns them, in source order:

- **candidates**: words of the source that start with a capital letter, not at a sentence start
  (after `.!?:;` or a line break, quotes and brackets skipped), at least `MIN_NAME_CHARS` long,
  not all capitals (acronyms such as "EU" or "USA" are translated as often as copied), not a
  unit after a number ("54 Mbit"), and outside the protected spans (`#NAME#`, URLs, e-mail
  addresses, ids: `spans.py` checks those); plus words with a capital after a small letter
  anywhere ("iPhone", "eBay": always names, tests 1-4 below skipped); a possessive "'s" is
  cut ("Korea's" -> "Korea");
- **not common words** of the source language: German capitalises every noun ("heute *Abend*"),
  English its days, months and languages ("on *Monday*"), and those are translated, not
  copied. Four tests, any one enough:
  1. the packaged lists (`common_words.json`, built by `bench/common_words.py` from the
     training sides of data/: BConTrasT train and Tatoeba, never the dev or FLORES sets the
     check is measured on): every word seen there less the names its human translations copied
     ("Tom", "Berlin"); in German also with a noun ending off ("Tischen");
  2. word frequencies of the languages (`wordfreq`, Zipf scale: 3 = once per million words):
     a word of `COMMON_ZIPF` or more in the source language ("The", "Court", "September");
  3. a word the target language writes far less often than the source does (`COPY_GAP` Zipf
     or more, for words of `KNOWN_ZIPF` or more): a noun of the source language ("Erdbeben":
     German 4.0, English 0) or a name the target spells its own way ("Moldova" -> "Moldawien":
     English 3.2, German 2.0). Names that are copied are written as often in both ("Aquaman",
     "Starbucks", "Katrina": within 0.8); a rare word (under `KNOWN_ZIPF`, "Cuddeback") is a
     name unless test 4 calls it a compound;
  4. in German, listed or frequent (`PART_ZIPF`) words of 4+ letters run together
     ("Ersatz|gerät", "Keim|bahn|zellen", a linking "s" allowed); a hyphenated word is judged
     part by part;
- **kept**: the name in the translation after case and accent folding (umlauts as "ae" too),
  also inside a longer word ("Aquaman-Film", "Annas"), or, for names of 6+ letters, its first
  all-but-two letters ("Berlin" in "Berliner"), or a word of the translation one letter away
  from it, for names of 4+ letters (transliterations: "Bishkek" / "Bichkek", "Iraq" / "Irak").

A language without a list gets no candidates (the check cannot tell its names from its nouns).
What it misses by design: names that are also frequent words ("Rose", "Paris", "Tom"), names at
a sentence start, a name mangled by one letter, and a name of `KNOWN_ZIPF` or more that the
target's list does not hold ("Okafor": English 2.55, German 0; test 3 cannot tell it from a noun
of the source language, and taking such words as names tripled the false alarms). The
frequencies come from the `wordfreq` package (its data inside the wheel; 0.1-0.25 s to load a
language on first use, about 40 MB of memory per language).
Measured in docs/PROMPTS.md ("Dropped names"): the false-alarm rate on human translations and
the precision on judged model answers decide whether the faithfulness stage retries for it.
No model, no Kafka.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable, Mapping
from functools import cache, lru_cache
from importlib import resources

from wordfreq import zipf_frequency

from workers.text.spans import find_spans

__all__ = [
    "COMMON_ZIPF",
    "COPY_GAP",
    "MIN_NAME_CHARS",
    "common_words",
    "dropped_names",
    "fold",
    "is_sentence_start",
    "name_candidates",
    "words",
    "zipf",
]

MIN_NAME_CHARS = 3  # shorter capitalised words ("Mr", "OK") are never names here
MIN_PART_CHARS = 4  # each part of a compound of common words
PREFIX_FROM_CHARS = 6  # from this length on, a name's stem (all but 2 letters) counts as kept
ONE_OFF_FROM_CHARS = 4  # from this length on, a translation word one letter away counts as kept
MAX_COMPOUND_CHARS = 64  # longer words are not split into listed parts
# Zipf frequencies (wordfreq: log10 of uses per billion words); chosen on human translations
# (FLORES-200 devtest, BConTrasT dev) and judged model answers, docs/PROMPTS.md
COMMON_ZIPF = 4.0  # a word this frequent in the source language is a common word
KNOWN_ZIPF = 2.0  # below this a word is too rare for its frequencies to compare
COPY_GAP = 0.8  # source minus target frequency from which the target writes it otherwise
PART_ZIPF = 2.5  # a compound's part this frequent in the source language is a word

_WORD = re.compile(r"[^\W\d_][\w'’-]*")
_QUOTES = "\"'“”„‚‘’«»‹›()[]{}¿¡*-–—•·>"  # skipped when looking for a sentence's end
COMPOUNDING = ("de",)  # languages that write compounds as one word ("Ersatzgerät")
SUFFIXES = ("n", "en", "s", "es", "e", "er", "ern")  # German noun endings tried off a word
_ENDS = ".!?:;…\n"
_CAMEL = re.compile(r"[a-zà-ÿ][A-ZÀ-Þ][a-zà-ÿ]")  # "iPhone", "eBay"; not a typo "yoU"
_POSSESSIVE = re.compile(r"['’]s$")
_AFTER_NUMBER = re.compile(r"\d[\d.,]*\s*$")
_FOLDED_WORD = re.compile(r"\w+")


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
        if _AFTER_NUMBER.search(source[max(0, offset - 24) : offset]):  # "54 Mbit", "600Mbit/s"
            continue
        for i, part in enumerate(p for p in word.split("-") if p):
            part = _POSSESSIVE.sub("", part)
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


@lru_cache(maxsize=1 << 16)  # bounded: the texts are untrusted
def zipf(word: str, lang: str) -> float:
    """`word`'s frequency in `lang` on the Zipf scale (0: unknown), casefolded."""
    return float(zipf_frequency(word, lang))


def _is_common(word: str, common: frozenset[str], lang: str, target: str | None) -> bool:
    """Tests 1-4 of the module docstring."""
    w = word.casefold()
    compounding = lang in COMPOUNDING
    if w in common or (compounding and _with_ending_off(w, lambda x: x in common)):
        return True
    z = zipf(w, lang)
    if z >= COMMON_ZIPF:
        return True
    if target is not None and z >= KNOWN_ZIPF and z - zipf(w, target) >= COPY_GAP:
        return True
    return compounding and _compound(w, common, lang)


def _with_ending_off(w: str, test: Callable[[str], bool]) -> bool:
    return any(w.endswith(x) and test(w[: -len(x)]) for x in SUFFIXES)


def _part(w: str, common: frozenset[str], lang: str) -> bool:
    """A compound's part: listed or frequent, as it is or with a noun ending off."""

    def word(x: str) -> bool:
        return x in common or zipf(x, lang) >= PART_ZIPF

    return word(w) or _with_ending_off(w, word)


def _compound(w: str, common: frozenset[str], lang: str) -> bool:
    """`w` as words run together (test 4); each suffix of `w` is judged once (the texts are
    untrusted: without the memo a crafted word of overlapping parts takes exponential time),
    and words over `MAX_COMPOUND_CHARS` are not split."""
    if len(w) > MAX_COMPOUND_CHARS:
        return False
    memo: dict[int, bool] = {}

    def from_(i: int) -> bool:  # whether w[i:] splits into parts (two at least overall)
        if i in memo:
            return memo[i]
        found = False
        for cut in range(i + MIN_PART_CHARS, len(w) - MIN_PART_CHARS + 1):
            head, rest = w[i:cut], w[cut:]
            linked = head.endswith("s") and _part(head[:-1], common, lang)
            if (linked or _part(head, common, lang)) and (_part(rest, common, lang) or from_(cut)):
                found = True
                break
        memo[i] = found
        return found

    return from_(0)


def _one_off(a: str, b: str) -> bool:
    """Whether `a` and `b` differ by at most one letter changed, added or removed."""
    if abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b, strict=True)) <= 1
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    return any(short == long_[:i] + long_[i + 1 :] for i in range(len(long_)))


def _kept(
    name: str, folded_translation: str, spelled_translation: str, folded_words: list[str]
) -> bool:
    f = fold(name)
    if f in folded_translation or _umlauts_spelled(name) in spelled_translation:
        return True
    if f.endswith("s") and len(f) > 4 and f[:-1] in folded_translation:  # "Annas" / "Anna's"
        return True
    if len(f) >= PREFIX_FROM_CHARS and f[:-2] in folded_translation:
        return True
    return len(f) >= ONE_OFF_FROM_CHARS and any(_one_off(f, w) for w in folded_words)


def dropped_names(
    source: str,
    translation: str,
    source_lang: str,
    target_lang: str | None = None,
    *,
    lists: Mapping[str, frozenset[str]] | None = None,
) -> tuple[str, ...]:
    """The names of `source` missing from `translation` (module docstring); without
    `target_lang` test 3 is skipped; `lists`: common words per language instead of the
    packaged ones (tests)."""
    common = (lists if lists is not None else _packaged()).get(source_lang)
    if common is None:
        return ()
    folded, spelled = fold(translation), _umlauts_spelled(translation)
    folded_words = _FOLDED_WORD.findall(folded)  # read once, for every candidate
    dropped: list[str] = []
    for name in name_candidates(source):
        if name in dropped:
            continue
        if not _CAMEL.search(name) and _is_common(name, common, source_lang, target_lang):
            continue
        if not _kept(name, folded, spelled, folded_words):
            dropped.append(name)
    return tuple(dropped)
