"""Wrong language and untranslated: is a translation in its target language? A pure function.

A small model asked for Spanish sometimes answers in German ("His cheeks were burning with
shame." -> "Suche suche suche."), or repeats the source in its own language (SmolLM2 answered
13 % of German->English turns in German: issue #28). `language_problem` names it:

- `"untranslated"`: the translation is confidently in the *source* language;
- `"wrong_language"`: confidently in a third language;
- None: in the target language, or too short or too mixed to call.

lingua (`lingua-language-detector`, its models ship in the wheel; nothing is downloaded) scores
the text among a fixed candidate set: the pair's two languages, the engine's, and a few common
European ones (`COMMON_LANGUAGES`): a set that small is what makes short support turns callable
at all. Before it scores, what carries no language is taken out: placeholders (`#NAME#`,
`{{x}}`, `<x1>`), URLs, e-mail addresses, numbers, and the capitalised words the source has too
(names and brands copied over: "Arroyo Burro Beach", "BJ's Restaurant and Brewhouse"; German
nouns of a German copy go too, its function words still say German). What it never calls,
because a wrong call withholds a good answer:

- texts with fewer than `MIN_LETTERS` letters left ("OK.", "Danke!", "Netflix", an order id);
- texts where another language does not lead clearly: the leader must hold at least
  `LEAD_CONFIDENCE` of lingua's confidence and the target under 1/`LEAD_RATIO` of the leader's.

Measured on the human references of data/ as if they were answers (BConTrasT train + dev, 15,747
chat turns en<->de, and 2,400 Tatoeba pairs en<->de/fr/it/es; `bench/faithful_language.py`):
2 of 18,147 references called ("caramel macchiato." and "Let me get a quad espresso campana."
as Italian), and none of FLORES-200's 20,240 references in the 20 directions among en, de, fr,
es, it. The thresholds were 16 letters and 0.6 until 2026-12-05: lingua's confidence spread over
seven languages left plain English at 0.58 ("ok, your total will come out to $72, is that ok?"
sent as German) and the issue's "Suche suche suche." (15 letters, German for Spanish) uncalled;
at 12 / 0.45 both are called, with one more false alarm on the references (docs/PROMPTS.md).
Stricter than the replay report's off-target measure (`replay/quality.py`: target under 0.1),
which counts rather than withholds.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache
from typing import Any

__all__ = [
    "COMMON_LANGUAGES",
    "LEAD_CONFIDENCE",
    "LEAD_RATIO",
    "MIN_LETTERS",
    "detector",
    "language_problem",
    "scored_text",
]

COMMON_LANGUAGES = ("en", "de", "fr", "es", "it", "pt", "nl")
MIN_LETTERS = 12  # letters left after the masks below: shorter texts are not called
LEAD_CONFIDENCE = 0.45  # another language's share of lingua's confidence at least this ...
LEAD_RATIO = 5.0  # ... and this many times the target's: the text is not in the target language

# what carries no language: placeholders, markup, URLs, e-mail addresses, numbers
_NEUTRAL = re.compile(
    r"#[A-Z_]+#|\{\{[^}]*\}\}|\{[^}]*\}|<[^>]{1,40}>|https?://\S+|www\.\S+|\S+@\S+|\d+"
)


@cache
def detector(codes: tuple[str, ...]) -> Any:
    """A lingua detector over these ISO 639-1 codes (unknown codes left out), built once."""
    from lingua import IsoCode639_1, LanguageDetectorBuilder

    known = [getattr(IsoCode639_1, c.upper()) for c in codes if hasattr(IsoCode639_1, c.upper())]
    return LanguageDetectorBuilder.from_iso_codes_639_1(*known).build()


_WORDS = re.compile(r"[^\W\d_][\w'’-]*", re.UNICODE)


def _letters(text: str) -> int:
    return sum(ch.isalpha() for ch in text)


def scored_text(translation: str, source: str = "") -> str:
    """What lingua scores: the translation without placeholders, URLs, addresses, numbers and
    its capitalised words that `source` has too, in any case (see the module notes)."""
    seen = {w.casefold() for w in _WORDS.findall(source)}  # chat sources are often lower case

    def name(m: re.Match[str]) -> str:
        word = m.group(0)
        return " " if word[0].isupper() and word.casefold() in seen else word

    return _WORDS.sub(name, _NEUTRAL.sub(" ", translation))


def language_problem(
    translation: str,
    source_lang: str,
    target_lang: str,
    languages: Sequence[str] = (),
    source: str = "",
) -> str | None:
    """ "untranslated", "wrong_language" or None (see the module notes); `source`: the text
    translated, whose capitalised words are not scored."""
    text = scored_text(translation, source)
    if _letters(text) < MIN_LETTERS:
        return None
    src, tgt = source_lang.lower(), target_lang.lower()
    codes = tuple(sorted({*COMMON_LANGUAGES, src, tgt, *(c.lower() for c in languages)}))
    values = detector(codes).compute_language_confidence_values(text)
    if not values:
        return None
    shares = {str(v.language.iso_code_639_1.name).lower(): float(v.value) for v in values}
    lead = max(shares, key=shares.__getitem__)
    if lead == tgt or shares[lead] < LEAD_CONFIDENCE:
        return None
    if shares.get(tgt, 0.0) * LEAD_RATIO >= shares[lead]:
        return None
    return "untranslated" if lead == src else "wrong_language"
