"""Readers of translation memories: TMX, TSV and the replay JSONL, into one `TMPair` record.

A translation memory is what an operator already has: TMX exports of a CAT tool (the
localization industry's exchange format), spreadsheets saved as TSV, or tolk's own replay logs
with human references. Every reader turns its format into `TMPair`s (one source segment and
its translation, the two languages, and where it came from, `file:line`) and reports each row
it cannot use as a `TMProblem` in the same stream instead of raising: a 100,000-unit TMX with
one broken unit must still import, and the operator must learn which line to fix.

- **TMX** (`*.tmx`) is parsed by translate-toolkit's `tmxfile` (a maintained reader, lxml
  underneath). Each `<tu>` gives one pair from its source language (the unit's `srclang`, else
  the header's, else its first `<tuv>`; `*all*` means the first) to every other language it
  holds. Language tags are cut to their primary subtag, lowercased (`en-US` -> `en`). A unit is
  a problem, reported with the line of its `<tu>`, when it has fewer than two `<tuv>`s, a
  `<tuv>` without `xml:lang` or `<seg>`, an empty or damaged segment, or only languages the
  service does not know. A file that is not well-formed XML is reported at the line lxml names
  and read again in lxml's recover mode, so the units before (and usually after) the damage
  still import.
- **TSV** (`*.tsv`, `*.tab`): tab-separated, UTF-8, one pair per line, either four columns
  `source_lang, target_lang, source, target` or two columns `source, target` with the pair
  given by the caller (`tolk tm import --pair en-de`). A header row (`source_lang\t...` or
  `source\ttarget`) and blank lines are skipped; `#` starts a comment line.
- **Replay JSONL** (`*.jsonl`, docs/REPLAY.md): read by `replay.logs.read_jsonl`, its own
  problems kept; a row becomes a pair when it has a `reference`, and a row without one is a
  problem ("no reference translation").

The texts are normalized as the exact-match cache normalizes them
(`workers.text_normal.normalize_text`, as the cache key: NFC, whitespace runs collapsed, ends
stripped); the
checks on languages and text are the replay log's (`replay.log_records.language_problem`,
`text_problem`: unknown language, source equals target, empty text, U+FFFD or unpaired
surrogates), so a row the replay job would refuse is refused here too, for the same reason.
"""

from __future__ import annotations

import csv
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from replay.log_records import (
    KNOWN_LANGUAGES,
    Problem,
    ReplayRecord,
    language_problem,
    text_problem,
)
from replay.logs import read_jsonl
from workers.text_normal import normalize_text

__all__ = [
    "TM_FORMATS",
    "TMFormat",
    "TMPair",
    "TMProblem",
    "format_of",
    "normalize_lang",
    "read_replay_jsonl",
    "read_tm",
    "read_tmx",
    "read_tsv",
]

TMFormat = Literal["tmx", "tsv", "jsonl"]
TM_FORMATS: tuple[TMFormat, ...] = ("tmx", "tsv", "jsonl")
_EXTENSIONS: dict[str, TMFormat] = {".tmx": "tmx", ".tsv": "tsv", ".tab": "tsv", ".jsonl": "jsonl"}
_XML_LANG = "{http://www.w3.org/XML/1998/namespace}lang"


@dataclass(frozen=True, slots=True)
class TMPair:
    """One translation-memory entry: a source segment and its human translation."""

    source_lang: str  # primary language subtag, lowercase ("en")
    target_lang: str
    source: str  # normalized (NFC, whitespace collapsed)
    target: str
    origin: str = ""  # where it came from: "file:line"


TMProblem = Problem  # (row "file:line", reason): the replay log's record, one shape for both
TMItem = TMPair | TMProblem


def normalize_lang(tag: str | None) -> str:
    """`en-US`, `EN_us`, `en` -> `en`; None or blank -> ""."""
    if not tag:
        return ""
    return tag.strip().replace("_", "-").split("-", 1)[0].lower()


def format_of(path: Path) -> TMFormat:
    """The format a file's extension names; ValueError for any other extension."""
    fmt = _EXTENSIONS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(
            f"{path}: unknown TM format {path.suffix!r} (.tmx, .tsv/.tab or .jsonl; "
            "or name the format)"
        )
    return fmt


def _pair_or_problem(
    source_lang: str,
    target_lang: str,
    source: str,
    target: str,
    row: str,
    known: Collection[str],
) -> TMItem:
    """The shared row checks: languages first, then each text; normalized on success."""
    reason = language_problem(source_lang, target_lang, known)
    for what, text in (("source", source), ("target", target)):
        if reason is None and (why := text_problem(text)) is not None:
            reason = f"{what}: {why}"
    if reason is not None:
        return TMProblem(row, reason)
    return TMPair(
        source_lang, target_lang, normalize_text(source), normalize_text(target), origin=row
    )


# --- TMX ---------------------------------------------------------------------------------------


class _UnreadableTMX(Exception):
    def __init__(self, line: int, reason: str) -> None:
        super().__init__(reason)
        self.line, self.reason = line, reason


def _parse_tmx(path: Path) -> tuple[object, TMProblem | None]:
    """(translate-toolkit tmxfile, the well-formedness problem if recover mode was needed)."""
    from lxml import etree
    from translate.storage.tmx import tmxfile

    data = path.read_bytes()
    try:
        return tmxfile.parsestring(data), None
    except etree.XMLSyntaxError as exc:
        line, syntax = exc.lineno or 0, exc.msg
    parser = etree.XMLParser(recover=True, resolve_entities=False, no_network=True)
    try:
        root = etree.fromstring(data, parser)
    except etree.XMLSyntaxError:
        root = None
    if root is None:
        raise _UnreadableTMX(line, f"not well-formed XML ({syntax}); nothing recoverable")
    problem = TMProblem(
        f"{path.name}:{line}",
        f"not well-formed XML ({syntax}); read on in recover mode, units at or after this "
        "line may be lost",
    )
    repaired = etree.tostring(root, xml_declaration=True, encoding="utf-8")
    # the repaired tree keeps the original line numbers only approximately: rows after the
    # damage are reported with the recovered tree's lines
    return tmxfile.parsestring(repaired), problem


def read_tmx(path: Path, known: Collection[str] = KNOWN_LANGUAGES) -> Iterator[TMItem]:
    """Pairs of a TMX file (the source language to every other language of each unit)."""
    path = Path(path)
    try:
        store, damage = _parse_tmx(path)
    except _UnreadableTMX as exc:
        yield TMProblem(f"{path.name}:{exc.line}", exc.reason)
        return
    except AssertionError:  # translate-toolkit's check of the root element
        yield TMProblem(f"{path.name}:1", "not a TMX document (the root element is not <tmx>)")
        return
    if damage is not None:
        yield damage
    header_src = normalize_lang(getattr(store, "sourcelanguage", None))
    for unit in store.units:  # type: ignore[attr-defined]
        element = unit.xmlelement
        row = f"{path.name}:{element.sourceline or 0}"
        segments: list[tuple[str, str]] = []  # (lang, text), document order
        problem: str | None = None
        for tuv in unit.getlanguageNodes():
            lang = normalize_lang(tuv.get(_XML_LANG) or tuv.get("lang"))
            text = unit.getNodeText(tuv)
            if not lang:
                problem = f"<tuv> at line {tuv.sourceline} has no xml:lang"
            elif text is None:
                problem = f"<tuv xml:lang={lang!r}> has no <seg>"
            if problem:
                break
            segments.append((lang, str(text)))
        if problem is None and len(segments) < 2:
            problem = f"a <tu> needs two <tuv> languages, this one has {len(segments)}"
        if problem is not None:
            yield TMProblem(row, problem)
            continue
        unit_src = normalize_lang(element.get("srclang"))
        src = unit_src if unit_src and unit_src != "*all*" else header_src
        langs = [lang for lang, _ in segments]
        if not src or src == "*all*" or src not in langs:
            src = langs[0]
        source_text = dict(segments)[src]
        targets = [(lang, text) for lang, text in segments if lang != src]
        if not targets:
            yield TMProblem(row, f"every <tuv> of the unit is in {src!r}")
            continue
        for lang, text in targets:
            yield _pair_or_problem(src, lang, source_text, text, row, known)


# --- TSV ---------------------------------------------------------------------------------------


_HEADERS = {("source_lang", "target_lang", "source", "target"), ("source", "target")}


def read_tsv(
    path: Path,
    known: Collection[str] = KNOWN_LANGUAGES,
    pair: tuple[str, str] | None = None,
) -> Iterator[TMItem]:
    """Pairs of a TSV file: four columns, or two when `pair` = (source_lang, target_lang)."""
    path = Path(path)
    width = 2 if pair else 4
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            row = f"{path.name}:{number}"
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                yield TMProblem(row, "bad encoding: not UTF-8")
                continue
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            fields = next(csv.reader([line], delimiter="\t", quoting=csv.QUOTE_NONE))
            if number == 1 and tuple(f.strip().lower() for f in fields) in _HEADERS:
                continue
            if len(fields) != width:
                shape = (
                    "source_lang, target_lang, source, target"
                    if width == 4
                    else (f"source, target (pair {pair[0]}-{pair[1]})" if pair else "")
                )
                yield TMProblem(row, f"{len(fields)} columns, expected {width}: {shape}")
                continue
            if pair:
                src_lang, tgt_lang = pair
                source, target = fields
            else:
                src_lang, tgt_lang = normalize_lang(fields[0]), normalize_lang(fields[1])
                source, target = fields[2], fields[3]
            yield _pair_or_problem(src_lang, tgt_lang, source, target, row, known)


# --- replay JSONL ------------------------------------------------------------------------------


def read_replay_jsonl(path: Path, known: Collection[str] = KNOWN_LANGUAGES) -> Iterator[TMItem]:
    """Pairs of a replay JSONL log (docs/REPLAY.md): rows with a `reference`."""
    for item in read_jsonl(Path(path), known):
        if not isinstance(item, ReplayRecord):
            yield item
        elif item.reference is None or not item.reference.strip():
            yield TMProblem(item.row, "no reference translation (a TM pair needs one)")
        else:
            yield _pair_or_problem(
                item.source_lang, item.target_lang, item.text, item.reference, item.row, known
            )


def read_tm(
    path: Path,
    fmt: TMFormat | None = None,
    known: Collection[str] = KNOWN_LANGUAGES,
    pair: tuple[str, str] | None = None,
) -> Iterator[TMItem]:
    """Pairs and problems of one file, in file order; the format from the extension unless
    named. `pair` applies to two-column TSV only."""
    path = Path(path)
    fmt = fmt or format_of(path)
    if fmt == "tmx":
        return read_tmx(path, known)
    if fmt == "tsv":
        return read_tsv(path, known, pair)
    if fmt == "jsonl":
        return read_replay_jsonl(path, known)
    raise ValueError(f"unknown TM format {fmt!r} (one of {', '.join(TM_FORMATS)})")
