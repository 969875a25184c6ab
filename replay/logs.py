"""Readers of conversation logs for the replay job: one normalized record, four formats.

Every reader turns its format into `ReplayRecord`s (one turn of one conversation: who said
what, in which language, to be translated into which) and reports each row it cannot use as a
`Problem` (where, why) in the same stream, instead of raising: a support log with one broken
line must still replay. The formats:

- `bcontrast`: the BConTrasT dialogues of the repository's `data/bcontrast_wmt20_chat`
  (one JSON object: conversation id -> turns with `utteranceID`, `speaker`, `source`,
  `target`); customers write German, agents English; the reference is `target`.
- `wmt-csv`: the CSV files of the WMT chat translation shared tasks, read by column name (any
  order, extra columns ignored): `doc_id`, `source_language`, `target_language`, the text to
  translate, and optionally its reference, the sender, `turn` and `timestamp`; rows of one
  `doc_id` are one conversation, in file order. The tasks name the same columns differently
  (`CSV_COLUMN_NAMES`): WMT 2022 (Unbabel's MAIA corpus, github.com/WMT-Chat-task/
  data-and-baselines) has `source_segment`, `pe_segment` (the post-edited reference) and
  `translation_direction` (customer | agent), in the order `doc_id, source_language,
  target_language, source_segment, pe_segment, translation_direction`, except its en-fr file,
  which has `translation_direction` before `pe_segment`, and its test files without references
  have no `pe_segment`; WMT 2024 (WMT-Chat-task/chat-task-2024-data) has `source_language,
  target_language, source, reference, doc_id, client_id, sender, tags` (no `reference` in its
  test files); the names this reader took first (`source_segment`, `reference`, `sender`) are
  kept. WMT 2020's data is BConTrasT (`bcontrast`); WMT 2021 and 2023 had no chat task.
- `jsonl`: one JSON object per line (docs/REPLAY.md): `conversation_id`, `turn` and/or
  `timestamp` (epoch milliseconds or ISO 8601), `source_lang`, `target_lang`, `text`, optional
  `reference`, `intent`, `sender`. In a conversation either every row has a `turn`, or the
  turns are numbered by timestamp (ties in file order).
- `xsid`: xSID's `<lang>.valid.conll` files of voice-assistant commands with their intent
  labels, in `replay/logs_xsid.py` (its notes say how a file becomes records).

A row is a problem when its language is not one of `known_languages` (or source equals
target), its text is empty, its bytes are not UTF-8, its text carries U+FFFD replacement
characters or unpaired surrogates (text damaged by an earlier lossy decode), a required field is
missing or malformed, or it repeats a (conversation, turn) already read. Readers never filter by
the languages of a run: that is `replay.job`'s selection.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Collection, Iterable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from replay.log_records import (
    KNOWN_LANGUAGES,
    LogContents,
    LogItem,
    Problem,
    ReplayRecord,
    RowChecker,
)
from replay.logs_xsid import read_xsid

LogFormat = Literal["bcontrast", "wmt-csv", "jsonl", "xsid"]
LOG_FORMATS: tuple[LogFormat, ...] = ("bcontrast", "wmt-csv", "jsonl", "xsid")
# A wmt-csv field -> the header names that give it, the first present wins (module notes).
CSV_COLUMN_NAMES: dict[str, tuple[str, ...]] = {
    "doc_id": ("doc_id",),
    "source_language": ("source_language",),
    "target_language": ("target_language",),
    "text": ("source_segment", "source"),
    "reference": ("reference", "pe_segment"),
    "sender": ("sender", "translation_direction"),
    "turn": ("turn",),
    "timestamp": ("timestamp",),
}
CSV_REQUIRED = ("doc_id", "source_language", "target_language", "text")


def _decoded_lines(path: Path) -> Iterator[tuple[int, str | None]]:
    """(line number from 1, the line decoded as UTF-8, or None when its bytes are not)."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError:
                yield number, None


def parse_timestamp_ms(value: Any) -> int:
    """Epoch milliseconds from an int/float (ms) or an ISO 8601 string (naive = UTC)."""
    if isinstance(value, bool):
        raise ValueError(f"not a timestamp: {value!r}")
    if isinstance(value, int | float):
        return int(value)
    if isinstance(value, str) and value.strip():
        text = value.strip()
        if text.lstrip("-").isdigit():
            return int(text)
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        return int(parsed.timestamp() * 1000)
    raise ValueError(f"not a timestamp: {value!r}")


def read_bcontrast(path: Path, known: Collection[str] = KNOWN_LANGUAGES) -> Iterator[LogItem]:
    """The BConTrasT JSON: customers (German) and agents (English), in conversation order."""
    try:
        dialogues = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        yield Problem(str(path), f"bad encoding: {exc}")
        return
    except json.JSONDecodeError as exc:
        yield Problem(f"{path}:{exc.lineno}", f"not JSON: {exc.msg}")
        return
    if not isinstance(dialogues, dict):
        yield Problem(str(path), "not a BConTrasT file (expected an object of conversations)")
        return
    checker = RowChecker(known)
    for conv_id, turns in dialogues.items():
        if not isinstance(turns, list):
            yield Problem(f"{path.name}:{conv_id}", "conversation is not a list of turns")
            continue
        for position, t in enumerate(turns):
            row = f"{path.name}:{conv_id}/{position}"
            try:
                customer = t["speaker"] == "customer"
                record = ReplayRecord(
                    conversation_id=str(conv_id),
                    turn=int(t["utteranceID"]),
                    source_lang="de" if customer else "en",
                    target_lang="en" if customer else "de",
                    text=str(t["source"]),
                    reference=str(t["target"]) if t.get("target") is not None else None,
                    sender=str(t["speaker"]),
                    row=row,
                )
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                yield Problem(row, f"malformed turn: {exc!r}")
                continue
            yield checker.check(record)


def csv_columns(header: Iterable[str]) -> dict[str, str]:
    """wmt-csv field -> the header column that gives it (`CSV_COLUMN_NAMES`; names compared
    without surrounding spaces), for the fields the header has."""
    present = {name.strip(): name for name in header if name is not None}
    out = {}
    for field_name, names in CSV_COLUMN_NAMES.items():
        found = next((present[n] for n in names if n in present), None)
        if found is not None:
            out[field_name] = found
    return out


def read_wmt_csv(path: Path, known: Collection[str] = KNOWN_LANGUAGES) -> Iterator[LogItem]:
    """A WMT chat shared task CSV (header row, columns by name: module notes); turns numbered
    per doc_id in file order unless a `turn` column says otherwise."""
    bad_lines: list[Problem] = []

    def good_lines() -> Iterator[str]:
        for number, line in _decoded_lines(path):
            if line is None:
                bad_lines.append(Problem(f"{path.name}:{number}", "bad encoding: not UTF-8"))
                yield "\n"  # keeps csv's line count; an empty line is no row
            else:
                yield line.removeprefix("\ufeff") if number == 1 else line  # a BOM: no name

    reader = csv.DictReader(good_lines())
    columns = csv_columns(reader.fieldnames or [])
    missing = [" or ".join(CSV_COLUMN_NAMES[f]) for f in CSV_REQUIRED if f not in columns]
    if missing:
        yield from bad_lines
        yield Problem(f"{path.name}:1", f"header lacks the columns {'; '.join(missing)}")
        return

    def field(values: dict[str, str | None], name: str) -> str:
        column = columns.get(name)
        return (values.get(column) or "") if column is not None else ""

    checker = RowChecker(known)
    next_turn: dict[str, int] = {}
    for values in reader:
        yield from bad_lines
        bad_lines.clear()
        row = f"{path.name}:{reader.line_num}"
        try:
            doc = field(values, "doc_id").strip()
            if not doc:
                raise ValueError("empty doc_id")
            turn_text = field(values, "turn").strip()
            turn = int(turn_text) if turn_text else next_turn.get(doc, 0)
            stamp = field(values, "timestamp").strip()
            record = ReplayRecord(
                conversation_id=doc,
                turn=turn,
                source_lang=field(values, "source_language").strip(),
                target_lang=field(values, "target_language").strip(),
                text=field(values, "text"),
                reference=field(values, "reference") or None,
                timestamp_ms=parse_timestamp_ms(stamp) if stamp else None,
                sender=field(values, "sender").strip() or None,
                row=row,
            )
        except (TypeError, ValueError) as exc:
            yield Problem(row, f"malformed row: {exc}")
            continue
        next_turn[doc] = max(next_turn.get(doc, 0), turn + 1)
        yield checker.check(record)
    yield from bad_lines


def _jsonl_record(obj: Any, row: str) -> tuple[ReplayRecord, bool]:
    """(record, whether the row gave its turn); raises ValueError for a malformed row."""
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    for name in ("conversation_id", "source_lang", "target_lang", "text"):
        if not isinstance(obj.get(name), str):
            raise ValueError(f"{name} missing or not a string")
    has_turn = obj.get("turn") is not None
    if has_turn and (isinstance(obj["turn"], bool) or not isinstance(obj["turn"], int)):
        raise ValueError("turn is not an integer")
    stamp = obj.get("timestamp")
    if not has_turn and stamp is None:
        raise ValueError("neither turn nor timestamp")
    optional = {}
    for name in ("reference", "intent", "sender"):
        value = obj.get(name)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{name} is not a string")
        optional[name] = value
    record = ReplayRecord(
        conversation_id=obj["conversation_id"],
        turn=int(obj["turn"]) if has_turn else -1,
        source_lang=obj["source_lang"],
        target_lang=obj["target_lang"],
        text=obj["text"],
        timestamp_ms=parse_timestamp_ms(stamp) if stamp is not None else None,
        row=row,
        **optional,
    )
    return record, has_turn


def read_jsonl(path: Path, known: Collection[str] = KNOWN_LANGUAGES) -> Iterator[LogItem]:
    """The documented JSONL format. Rows without `turn` are numbered by timestamp within
    their conversation, so the whole file is read before the first record is yielded."""
    parsed: list[tuple[ReplayRecord, bool]] = []
    for number, line in _decoded_lines(path):
        row = f"{path.name}:{number}"
        if line is None:
            yield Problem(row, "bad encoding: not UTF-8")
            continue
        if not line.strip():
            continue
        try:
            parsed.append(_jsonl_record(json.loads(line), row))
        except json.JSONDecodeError as exc:
            yield Problem(row, f"not JSON: {exc.msg}")
        except ValueError as exc:
            yield Problem(row, f"malformed row: {exc}")
    numbered_convs = {r.conversation_id for r, has_turn in parsed if has_turn}
    by_time: dict[str, list[ReplayRecord]] = {}
    checker = RowChecker(known)
    out: list[LogItem] = []
    for record, has_turn in parsed:
        if has_turn:
            out.append(record)
        elif record.conversation_id in numbered_convs:
            out.append(Problem(record.row, "turn missing in a conversation that numbers turns"))
        else:
            by_time.setdefault(record.conversation_id, []).append(record)
    for records in by_time.values():
        ordered = sorted(records, key=lambda r: r.timestamp_ms or 0)  # stable: file order
        for turn, record in enumerate(ordered):
            out.append(_with_turn(record, turn))
    for item in out:
        yield checker.check(item) if isinstance(item, ReplayRecord) else item


def _with_turn(record: ReplayRecord, turn: int) -> ReplayRecord:
    return replace(record, turn=turn)


READERS = {
    "bcontrast": read_bcontrast,
    "wmt-csv": read_wmt_csv,
    "jsonl": read_jsonl,
    "xsid": read_xsid,
}


def iter_log(
    path: Path, fmt: LogFormat, known: Collection[str] = KNOWN_LANGUAGES
) -> Iterator[LogItem]:
    """Records and problems of one log, in the reader's order."""
    if fmt not in READERS:
        raise ValueError(f"unknown log format {fmt!r} (one of {', '.join(LOG_FORMATS)})")
    return READERS[fmt](Path(path), known)


def read_log(path: Path, fmt: LogFormat, known: Collection[str] = KNOWN_LANGUAGES) -> LogContents:
    """The whole log, split into records and problems."""
    return split_items(iter_log(path, fmt, known))


def split_items(items: Iterable[LogItem]) -> LogContents:
    contents = LogContents()
    for item in items:
        if isinstance(item, ReplayRecord):
            contents.records.append(item)
        else:
            contents.problems.append(item)
    return contents
