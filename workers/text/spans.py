"""Protected spans: find the parts of a text a translation must carry over verbatim, mask them
before translation and put them back after, checking each one came through.

Support messages are full of order numbers, times, prices, URLs, e-mail addresses and
anonymization placeholders (`#PRS_ORG#`, `{{name}}`, `%s`). A small model garbles them: it
reformats `8:30` as `8.30`, drops a digit of `A-12345`, translates `#PRS_ORG#`. Masking swaps
each span for a short numbered token the model copies as it is (`<x1>`, `<x2>`, ...), and
`restore` swaps the tokens back.

Design notes
------------
* Pure functions over strings (no Kafka, no torch): the engine wrapper
  (`workers.stages.protected.stage`) and the replay report (preservation of the baseline arm) both
  use them.
* `find_spans` runs one regex per kind in priority order (placeholder, email, url, order_id,
  number) and keeps a match only where no earlier kind matched, so the digits of a URL or an
  order id are not a second "number" span. Boundaries are checked with look-arounds, so a
  digit or a capital inside an ordinary word (`A4`, `MP3`, `2nd`, `Zeitraum`) is no span.
* `restore` verifies before it substitutes: every mask token must appear exactly once, no
  token of an index the text never had, and no mangled remnant of the token form (`<x 1>`,
  `x1>`, `[1`). Any of these raises `RestoreError` listing what went wrong; the wrapper then
  translates without masking. A partial restore (`restore(..., strict=False)`) exists for the
  answer of last resort.
* A text that already contains something that looks like the mask form cannot be masked
  without ambiguity: `mask` raises `MaskConflict` and the caller translates it unmasked.
* The mask form was chosen by measuring how often the real models (Gemma 3 270M, SmolLM2)
  copy it through the engine (bench/mask_forms.py; the table is in docs/REPLAY.md, "Protected
  spans"): `<x1>` for Gemma 3 and by default, `[1]` for SmolLM2 (`style_for_model`).
* `preservation` is the report's metric: how many of the source's spans appear exactly (as
  substrings, counted with multiplicity) in a translation.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_STYLE",
    "MASK_STYLES",
    "SPAN_KINDS",
    "MaskConflict",
    "MaskStyle",
    "Masked",
    "RestoreError",
    "Span",
    "find_spans",
    "mask",
    "preservation",
    "restore",
    "style_for_model",
]

SPAN_KINDS = ("url", "email", "number", "order_id", "placeholder")


@dataclass(frozen=True, slots=True)
class Span:
    kind: str  # one of SPAN_KINDS
    start: int  # offset of the first character in the text
    end: int  # offset after the last character
    text: str  # text[start:end]


# A boundary: not glued to a letter, a digit or an underscore on that side.
_NOT_AFTER_WORD = r"(?<![\w])"
_NOT_BEFORE_WORD = r"(?![\w])"
_TLDS = r"(?:com|org|net|de|fr|es|it|eu|uk|io|info|biz|co|at|ch|nl|be)"
_URL_TRAILING = ".,;:!?)]}'\""

_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "placeholder",
        re.compile(
            r"#[A-Z][A-Z0-9_]*#"  # anonymization: #PRS_ORG#, #NAME#
            r"|\{\{\s*[A-Za-z_][\w.]*\s*\}\}"  # {{name}}
            r"|(?<!\{)\{[A-Za-z_][\w.]*\}(?!\})"  # {name}
            r"|%(?:\(\w+\))?[sdif]"  # %s, %d, %(name)s
            r"|%\d+\$[sdif]"  # %1$s
        ),
    ),
    (
        "email",
        re.compile(
            _NOT_AFTER_WORD + r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"
        ),
    ),
    (
        "url",
        re.compile(
            r"(?:https?://|www\.)[^\s<>\"']+"
            + r"|"
            + _NOT_AFTER_WORD
            + r"[a-z0-9-]+(?:\.[a-z0-9-]+)*\."
            + _TLDS
            + r"(?:/[^\s<>\"']*)?"
            + _NOT_BEFORE_WORD
        ),
    ),
    (
        "order_id",
        re.compile(
            r"(?<![\w#])#\d{3,}"
            + _NOT_BEFORE_WORD  # #1234567
            + r"|"
            + _NOT_AFTER_WORD
            + r"[A-Z]{1,5}(?:-[A-Z0-9]+)*-\d{3,}"
            + _NOT_BEFORE_WORD
            # upper-case letters and digits mixed, 5+ characters: AB12345, DE8937040044
            + r"|"
            + _NOT_AFTER_WORD
            + r"(?=[A-Z0-9]*\d)(?=[A-Z0-9]*[A-Z])[A-Z0-9]{5,}"
            + _NOT_BEFORE_WORD
        ),
    ),
    (
        # 12, 8:30, 1,234.56, 1.234,56, 12/03/2020; a separator is inside, never trailing.
        # Taken whole (possessive) and may touch a unit after it (7:10pm, 10kg, 5%), never a
        # letter before it (A4, MP3).
        "number",
        re.compile(_NOT_AFTER_WORD + r"\d+(?:[.,:/]\d+)*+(?!\d)"),
    ),
)


def _trim_url(text: str, start: int, end: int) -> int:
    """The end of a URL match without trailing sentence punctuation (a `)` only when the URL
    holds no `(`)."""
    while end > start and text[end - 1] in _URL_TRAILING:
        if text[end - 1] == ")" and "(" in text[start:end]:
            break
        end -= 1
    return end


def find_spans(text: str) -> list[Span]:
    """The protected spans of `text`, in order, never overlapping."""
    taken: list[tuple[int, int]] = []
    spans: list[Span] = []
    for kind, pattern in _PATTERNS:
        for m in pattern.finditer(text):
            start, end = m.start(), m.end()
            if kind == "url":
                end = _trim_url(text, start, end)
            if end <= start or any(start < e and s < end for s, e in taken):
                continue
            taken.append((start, end))
            spans.append(Span(kind, start, end, text[start:end]))
    spans.sort(key=lambda s: s.start)
    return spans


# -- masking ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MaskStyle:
    """One form of mask token: `open + index + close` (index from 1)."""

    name: str
    open: str
    close: str

    def token(self, index: int) -> str:
        return f"{self.open}{index}{self.close}"

    def exact(self) -> re.Pattern[str]:
        return re.compile(re.escape(self.open) + r"(\d+)" + re.escape(self.close))

    def loose(self) -> re.Pattern[str]:
        """A remnant of a token: its opening or its closing next to a number, spaces allowed
        (`<x 1`, `1 >`, `[ 2`). Searched after the exact tokens are taken out."""
        o = r"\s*".join(re.escape(c) for c in self.open.strip())
        c = r"\s*".join(re.escape(ch) for ch in self.close.strip())
        return re.compile(rf"{o}\s*\d+|\d+\s*{c}")


MASK_STYLES: Mapping[str, MaskStyle] = {
    s.name: s
    for s in (
        MaskStyle("angle_x", "<x", ">"),
        MaskStyle("square", "[", "]"),
        MaskStyle("curly", "{", "}"),
        MaskStyle("underscore", "__", "__"),
        MaskStyle("white_square", "\u27e6", "\u27e7"),  # ⟦1⟧
    )
}
DEFAULT_STYLE = MASK_STYLES["angle_x"]  # measured best: docs/REPLAY.md, "Protected spans"
# Where another form measured better for a model family (substring of the model version):
# SmolLM2 copied [1] in 26 % of the turns, <x1> in 14 % (Gemma 3: 74 % and 80 %).
_STYLE_BY_MODEL = (("smollm2", MASK_STYLES["square"]),)


def style_for_model(model_version: str) -> MaskStyle:
    """The mask form the model that `model_version` names copied best (DEFAULT_STYLE unless
    measured otherwise)."""
    lowered = model_version.lower()
    for family, style in _STYLE_BY_MODEL:
        if family in lowered:
            return style
    return DEFAULT_STYLE


class MaskConflict(ValueError):
    """The text already contains something of the mask form; masking would be ambiguous."""


class RestoreError(ValueError):
    """A masked translation whose tokens do not map back one to one.

    `missing`: indices absent; `duplicated`: indices seen more than once; `unknown`: indices
    the source never had; `mangled`: remnants of the token form (a broken token)."""

    def __init__(
        self,
        missing: Sequence[int] = (),
        duplicated: Sequence[int] = (),
        unknown: Sequence[int] = (),
        mangled: Sequence[str] = (),
    ) -> None:
        self.missing = tuple(missing)
        self.duplicated = tuple(duplicated)
        self.unknown = tuple(unknown)
        self.mangled = tuple(mangled)
        super().__init__(self.summary())

    def summary(self) -> str:
        parts = []
        for what, items in (
            ("missing", self.missing),
            ("duplicated", self.duplicated),
            ("unknown", self.unknown),
            ("mangled", self.mangled),
        ):
            if items:
                parts.append(f"{what} " + ",".join(str(i) for i in items))
        return "; ".join(parts) or "no problem"


@dataclass(frozen=True, slots=True)
class Masked:
    """A text with its spans swapped for tokens, and what restores them."""

    text: str  # the masked text (sent to the model)
    spans: tuple[Span, ...]  # spans[i] is token index i + 1
    style: MaskStyle

    @property
    def originals(self) -> dict[int, str]:
        return {i + 1: s.text for i, s in enumerate(self.spans)}


def mask(
    text: str, spans: Sequence[Span] | None = None, style: MaskStyle = DEFAULT_STYLE
) -> Masked:
    """`text` with each span replaced by `style.token(i)`, i from 1 in order of position.

    Raises MaskConflict when the text already holds a token or a remnant of `style`'s form.
    """
    if style.loose().search(text) or style.exact().search(text):
        raise MaskConflict(f"text already contains {style.name} mask-like tokens")
    spans = tuple(find_spans(text) if spans is None else sorted(spans, key=lambda s: s.start))
    out, pos = [], 0
    for i, span in enumerate(spans, start=1):
        out.append(text[pos : span.start])
        out.append(style.token(i))
        pos = span.end
    out.append(text[pos:])
    return Masked("".join(out), spans, style)


def restore(masked: Masked, translation: str, *, strict: bool = True) -> str:
    """`translation` (of `masked.text`) with the tokens swapped back for the original spans.

    strict: raise RestoreError unless every token appears exactly once, no unknown index
    appears, and nothing of the token form is left broken. strict=False substitutes what it
    can (each index's first occurrence) and leaves the rest as it is.
    """
    originals = masked.originals
    exact = masked.style.exact()
    seen = Counter(int(m.group(1)) for m in exact.finditer(translation))
    if strict:
        leftovers = exact.sub(" ", translation)
        problem = RestoreError(
            missing=sorted(i for i in originals if seen[i] == 0),
            duplicated=sorted(i for i in originals if seen[i] > 1),
            unknown=sorted(i for i in seen if i not in originals),
            mangled=[m.group(0) for m in masked.style.loose().finditer(leftovers)],
        )
        if problem.summary() != "no problem":
            raise problem
    used: set[int] = set()

    def swap(m: re.Match[str]) -> str:
        index = int(m.group(1))
        if index in originals and index not in used:
            used.add(index)
            return originals[index]
        return m.group(0)

    return exact.sub(swap, translation)


def preservation(source: str, translation: str) -> tuple[int, int]:
    """(spans of `source` found exactly in `translation`, spans of `source`).

    Found = as a substring, counted with multiplicity: a span text that occurs k times among
    the source's spans counts min(k, occurrences in the translation)."""
    wanted = Counter(s.text for s in find_spans(source))
    found = sum(min(k, translation.count(text)) for text, k in wanted.items())
    return found, sum(wanted.values())
