"""Invented numbers: figures in a translation that its source does not hold. A pure function.

A small model asked to translate a customer-service turn sometimes adds an amount ("we can offer
compensation" -> "... eine 120€-Gutschrift"), a time or a count that nobody said (issue #28).
`invented_numbers(source, translation)` returns the numbers written in digits in the translation
that no number of the source supports, after normalising the forms a faithful translation may
change:

- separators: "1,000" / "1.000" / "1 000" (also with the no-break spaces of French typography)
  and "3.5" / "3,5" are read both ways (thousands and decimal), so "EUR 1,000.50" supports
  "1.000,50 EUR"; zero cents drop ("15,00 €" = "€15");
- times: "7:10pm" supports "19:10" and "7.10", and its hour and minutes written as a clock
  time (French "10 h 08", "10h00", "11 heures" for "11:35 pm"); an hour followed by a clock
  word ("7pm", "seven o'clock", "19 Uhr") also supports the same hour on the other 12-hour
  clock and as h:00 (a plain "3 items" does not support "15");
- a year supports its last two digits after an apostrophe ("the 1980s" -> "gli anni '80"), and
  a decade of the source ("anni '70", "años 60", "60er") supports its year ("the 1970s", "1960");
- a number at the very end of the translation that begins a number of the source is a loop cut
  by the output cap ("... 1976, 1976, 19"), not a new figure (the loop check names the loop);
- number words of the source, in the languages the worker serves (en, de, fr, es, it, pt, nl):
  "fifteen" / "fünfzehn" / "quinze" support 15, "first" supports 1 ("1." in German), "a
  dozen" 12, "half" 0.5; tens and units written as one word or with a hyphen ("twenty-five",
  "fünfundzwanzig", "vijfentwintig") too, and each part of a hyphenated word ("one-third");
- Roman numerals of the source ("XIIIe siècle" supports "13th century", "siglo XV" 15), of
  two letters or more, or one with a century's suffix ("Xe siècle"): "I", "L'" and "Le" are
  words;
- a token whose every part is a number of the source is supported (a date written with other
  separators, "05/12/2024" -> "12.05.2024"); digit runs inside identifiers ("A-12345") are
  numbers like any other, but not digits glued to a letter ("CO2" for "carbon dioxide").

Only digits in the *translation* are checked: a number written as a word there ("ein", "one")
is too often an article or a pronoun to call invented. The result is the offending tokens as
written, in order; empty when every number is supported. No model, no Kafka: the faithfulness
stage (`workers/stages/faithful/rules.py`, `check`) and the benchmarks share it.
"""

from __future__ import annotations

import re
from functools import lru_cache

__all__ = ["invented_numbers", "number_values"]

# a run of digits with inner separators: 15, 15,00, 1.000, 1 000, 7:10, 3.5
# not glued to a letter before it (a formula or a model name: "CO2", "MP3"); "1 000e" reads 1000
_NUMBER = re.compile(r"(?<![^\W_])\d+(?:(?:[.,:]|(?<=\d)[ \u00a0\u202f](?=\d{3}(?!\d)))\d+)*")
# a century or a ruler in Roman numerals ("XIIIe siècle", "siglo XV", "Louis XIV")
_ROMAN = re.compile(r"\b([IVXL]{1,7})(e|er|ème|eme|th)?\b")
_ROMAN_VALUES = {"I": 1, "V": 5, "X": 10, "L": 50}
_NO_BREAK = str.maketrans({"\u00a0": " ", "\u202f": " "})
_CLOCK = re.compile(r"(\d{1,2}):(\d{2})")
# a number written as part of a clock time: followed by an hour word, or minutes after "h"
_CLOCK_AFTER = re.compile(
    r"\s*(?:h(?![^\W\d_])|heures?\b|uhr\b|hours?\b|horas?\b|ore\b|uur\b|[ap]\.?m\b)",
    re.IGNORECASE,
)
_CLOCK_BEFORE = re.compile(r"\d\s*h\s*$", re.IGNORECASE)
_WORD = re.compile(r"[^\W\d_]+(?:-[^\W\d_]+)?", re.UNICODE)
# an hour with a clock word after it: "7pm", "7 p.m.", "seven o'clock", "19 Uhr", "19h"
_HOUR = re.compile(
    r"\b(\d{1,2}|[^\W\d_]+)\s*(?:a\.?m\b\.?|p\.?m\b\.?|o'clock|uhr|h\b|heures?|horas?|ore|uur)",
    re.IGNORECASE,
)
_UNIT_AND_TENS = re.compile(r"(\w+?)(?:und|en|ën)(\w+ig|\w+tig)")

# 0-20, tens, 100, 1000, ordinals to 10, a few collectives, and the articles that mean one
# ("an hour" -> "1 Stunde"), per language (lower case)
_WORDS: dict[str, float] = {}
_TABLES = {
    "en": ("zero one two three four five six seven eight nine ten eleven twelve thirteen "
           "fourteen fifteen sixteen seventeen eighteen nineteen twenty",
           "thirty forty fifty sixty seventy eighty ninety",
           "first second third fourth fifth sixth seventh eighth ninth tenth",
           {"hundred": 100, "thousand": 1000, "dozen": 12, "half": 0.5, "once": 1,
            "twice": 2, "million": 1e6, "a": 1, "an": 1}),
    "de": ("null eins zwei drei vier fünf sechs sieben acht neun zehn elf zwölf dreizehn "
           "vierzehn fünfzehn sechzehn siebzehn achtzehn neunzehn zwanzig",
           "dreißig vierzig fünfzig sechzig siebzig achtzig neunzig",
           "erste zweite dritte vierte fünfte sechste siebte achte neunte zehnte",
           {"hundert": 100, "tausend": 1000, "dutzend": 12, "halb": 0.5, "halbe": 0.5,
            "einmal": 1, "zweimal": 2, "million": 1e6, "ein": 1, "eine": 1, "einen": 1}),
    "fr": ("zéro un deux trois quatre cinq six sept huit neuf dix onze douze treize quatorze "
           "quinze seize dix-sept dix-huit dix-neuf vingt",
           "trente quarante cinquante soixante soixante-dix quatre-vingt quatre-vingt-dix",
           "premier deuxième troisième quatrième cinquième sixième septième huitième "
           "neuvième dixième",
           {"cent": 100, "mille": 1000, "douzaine": 12, "demi": 0.5, "demie": 0.5,
            "une": 1, "million": 1e6, "première": 1}),
    "es": ("cero uno dos tres cuatro cinco seis siete ocho nueve diez once doce trece "
           "catorce quince dieciséis diecisiete dieciocho diecinueve veinte",
           "treinta cuarenta cincuenta sesenta setenta ochenta noventa",
           "primero segundo tercero cuarto quinto sexto séptimo octavo noveno décimo",
           {"cien": 100, "ciento": 100, "mil": 1000, "docena": 12, "medio": 0.5,
            "media": 0.5, "un": 1, "una": 1, "primer": 1, "primera": 1, "millón": 1e6}),
    "it": ("zero uno due tre quattro cinque sei sette otto nove dieci undici dodici tredici "
           "quattordici quindici sedici diciassette diciotto diciannove venti",
           "trenta quaranta cinquanta sessanta settanta ottanta novanta",
           "primo secondo terzo quarto quinto sesto settimo ottavo nono decimo",
           {"cento": 100, "mille": 1000, "dozzina": 12, "mezzo": 0.5, "mezza": 0.5,
            "un": 1, "una": 1, "prima": 1, "milione": 1e6}),
    "pt": ("zero um dois três quatro cinco seis sete oito nove dez onze doze treze catorze "
           "quinze dezesseis dezessete dezoito dezenove vinte",
           "trinta quarenta cinquenta sessenta setenta oitenta noventa",
           "primeiro segundo terceiro quarto quinto sexto sétimo oitavo nono décimo",
           {"cem": 100, "cento": 100, "mil": 1000, "dúzia": 12, "meio": 0.5, "meia": 0.5,
            "uma": 1, "duas": 2, "primeira": 1, "milhão": 1e6}),
    "nl": ("nul een twee drie vier vijf zes zeven acht negen tien elf twaalf dertien "
           "veertien vijftien zestien zeventien achttien negentien twintig",
           "dertig veertig vijftig zestig zeventig tachtig negentig",
           "eerste tweede derde vierde vijfde zesde zevende achtste negende tiende",
           {"honderd": 100, "duizend": 1000, "dozijn": 12, "half": 0.5, "halve": 0.5,
            "één": 1, "miljoen": 1e6}),
}  # fmt: skip
for _units, _tens, _ordinals, _extra in _TABLES.values():
    for _i, _w in enumerate(_units.split()):
        _WORDS.setdefault(_w, _i)
    for _i, _w in enumerate(_tens.split()):
        _WORDS.setdefault(_w, 30 + 10 * _i)
    for _i, _w in enumerate(_ordinals.split()):
        _WORDS.setdefault(_w, _i + 1)
    for _w, _v in _extra.items():
        _WORDS.setdefault(_w, _v)
# French: "quatre-vingt" and its kin are 80 / 90 (the loop above counted them as tens in order)
_WORDS.update({"soixante-dix": 70, "quatre-vingt": 80, "quatre-vingt-dix": 90})


def _token_values(token: str) -> set[float]:
    """Every value a numeric token may mean (see the module docstring)."""
    token = token.translate(_NO_BREAK)
    if ":" in token:  # a time h:mm (also 12 h <-> 24 h)
        parts = token.split(":")
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            h, m = int(parts[0]), int(parts[1])
            return {_minutes(h, m), _minutes(h + 12, m), _minutes(h - 12, m)}
        # h:mm:ss, a race time m:ss.hh ("4:41.30"): every digit group is a value
        return {float(int(p)) for p in re.split(r"[:., ]", token) if p}
    groups = re.split(r"[., ]", token)
    if len(groups) == 1:
        return {float(int(token))}
    values: set[float] = set()
    if all(len(g) == 3 for g in groups[1:]):  # thousands separators
        values.add(float(int("".join(groups))))
    if len(groups) == 2:  # one separator as the decimal point
        head, tail = groups
        values.add(float(f"{int(head)}.{tail}"))
        if len(tail) == 2:  # "7.10" may be a time
            values.add(_minutes(int(head), int(tail)))
    if len(groups) == 3 and len(groups[2]) != 3:  # "1.000,50": thousands, then decimals
        values.add(float(f"{int(groups[0] + groups[1])}.{groups[2]}"))
    return values


def _minutes(h: int, m: int) -> float:
    """A clock time as a value that no plain number takes (negative, minutes of the day)."""
    return -(1.0 + (h % 24) * 60 + m)


@lru_cache(maxsize=8192)  # bounded: a long-running worker sees every word of its traffic
def _word_value(word: str) -> float | None:
    w = word.casefold()
    if w in _WORDS:
        return float(_WORDS[w])
    if "-" in w:  # English "twenty-five", French "vingt-deux"
        head, _, tail = w.partition("-")
        if head in _WORDS and tail in _WORDS and _WORDS[head] >= 20 and _WORDS[tail] < 10:
            return float(_WORDS[head] + _WORDS[tail])
    # German "fünfundzwanzig", "einundzwanzig"; Dutch "vijfentwintig", "tweeëntwintig"
    compound = _UNIT_AND_TENS.fullmatch(w)
    if compound is not None:
        unit = _WORDS.get(compound[1], _WORDS.get(compound[1] + "s"))  # "ein" -> "eins"
        tens = _WORDS.get(compound[2])
        if unit is not None and tens is not None and 1 <= unit <= 9 and tens in range(20, 100, 10):
            return float(unit + tens)
    return None


def _roman_value(numeral: str) -> int | None:
    """The value of an upper-case Roman numeral up to L (None when it is not well formed)."""
    total = 0
    for i, ch in enumerate(numeral):
        v = _ROMAN_VALUES[ch]
        nxt = _ROMAN_VALUES[numeral[i + 1]] if i + 1 < len(numeral) else 0
        total += -v if v < nxt else v
    return total if total > 0 else None


def number_values(text: str) -> set[float]:
    """Every value the numbers of `text` (digits and number words) may stand for."""
    values: set[float] = set()
    for token in _NUMBER.findall(text):
        values |= _token_values(token)
    for word in _WORD.findall(text):
        for part in {word, *word.split("-")}:  # "one-third" also as "one" and "third"
            value = _word_value(part)
            if value is not None:
                values.add(value)
    for roman, suffix in _ROMAN.findall(text):
        # one letter is a word ("I", French "L'", "Le") unless a century's suffix says otherwise
        value = _roman_value(roman) if len(roman) > 1 or (suffix and roman in "VX") else None
        if value:
            values.add(float(value))
    for match in _HOUR.finditer(text):  # "7pm" supports "19 Uhr" and "19:00"
        raw = match[1]
        hour = float(int(raw)) if raw.isdigit() else _word_value(raw)
        if hour is not None and 1 <= hour <= 23 and hour == int(hour):
            values |= {hour + 12 if hour <= 12 else hour - 12, _minutes(int(hour), 0)}
    return values


_DECADE = re.compile(
    r"(?:['’]|\b(?:anni|años|annees|années|decenni|years)\s+['’]?)(\d0)\b|\b(\d0)er\b",
    re.IGNORECASE,
)


def _source_decades(source: str) -> set[str]:
    """The two-digit decades the source names ("anni '70", "años 60", "60er Jahre")."""
    return {a or b for a, b in _DECADE.findall(source)}


def _cut_at_the_end(m: re.Match[str], translation: str, source_digits: list[str]) -> bool:
    """Whether the token ends the translation and begins a longer number of the source."""
    if translation[m.end() :].strip():
        return False
    digits = re.sub(r"\D", "", m[0])
    return any(d.startswith(digits) and len(d) > len(digits) for d in source_digits)


def _parts_in_context(source_tokens: list[str]) -> tuple[set[float], set[float]]:
    """(hours and minutes of the source's clock times, two-digit forms of its years): what a
    number of the translation may be when its context says so (`invented_numbers`)."""
    clock: set[float] = set()
    decades: set[float] = set()
    for token in source_tokens:
        if m := _CLOCK.fullmatch(token):
            h = int(m[1])
            clock |= {float(h), float((h + 12) % 24), float(int(m[2]))}
        elif token.isdigit() and len(token) == 4:
            decades.add(float(int(token[2:])))
    return clock, decades


def invented_numbers(source: str, translation: str) -> tuple[str, ...]:
    """The translation's numbers in digits that no number of the source supports."""
    matches = list(_NUMBER.finditer(translation))
    if not matches:
        return ()
    support = number_values(source)
    source_tokens = _NUMBER.findall(source)  # the source's numbers, read once
    clock, decades = _parts_in_context(source_tokens)
    source_decades = _source_decades(source)
    source_digits = [re.sub(r"\D", "", t) for t in source_tokens]
    invented = []
    for m in matches:
        token = m[0]
        if _supported(token, support):
            continue
        value = float(int(token)) if token.isdigit() else None
        before, after = translation[: m.start()], translation[m.end() :]
        if value in clock and (_CLOCK_AFTER.match(after) or _CLOCK_BEFORE.search(before)):
            continue  # "11 heures", "10h00", "10 h 08" of a source's "11:35 pm", "10:08"
        if value in decades and before.endswith(("'", "’")):
            continue  # "gli anni '80" of "the 1980s"
        if len(token) == 4 and token[:2] in ("19", "20") and token[2:] in source_decades:
            continue  # "the 1970s" of "anni '70"
        if _cut_at_the_end(m, translation, source_digits):
            continue  # "..., 1976, 19" at the output cap
        invented.append(token)
    return tuple(invented)


def _supported(token: str, support: set[float]) -> bool:
    token = token.translate(_NO_BREAK)
    parts = [p for p in re.split(r"[.,: ]", token) if p]
    if ":" in token and len(parts) > 2:  # h:mm:ss, a race time m:ss.hh: every part, not one
        return all(float(int(p)) in support for p in parts)
    if _token_values(token) & support:
        return True
    # a date or a code written with other separators ("05/12/2024" -> "12.05.2024"): every
    # part is a number of the source
    return len(parts) > 1 and all(float(int(p)) in support for p in parts)
