"""replay.logs: the four log readers on the real BConTrasT and xSID data and on crafted files.

Every reader must turn bad rows (unknown language, empty text, bad encoding, malformed or
duplicate rows) into problems that name the row, and go on with the rest: a broken line in a
support log never stops a replay.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.datasets import bcontrast, data_file
from replay.logs import (
    Problem,
    ReplayRecord,
    iter_log,
    parse_timestamp_ms,
    read_bcontrast,
    read_jsonl,
    read_log,
    read_wmt_csv,
)

CSV_HEADER = "doc_id,source_language,target_language,source_segment,reference,sender\n"


def test_bcontrast_dev_reads_every_utterance_in_order():
    path = data_file("bcontrast_wmt20_chat/dev.json")
    contents = read_log(path, "bcontrast")
    utterances = list(bcontrast("dev"))
    assert contents.problems == []
    assert len(contents.records) == len(utterances)
    for record, u in zip(contents.records, utterances, strict=True):
        assert (record.conversation_id, record.turn, record.text, record.reference) == (
            u.conversation_id,
            u.turn,
            u.source,
            u.target,
        )
        assert (record.source_lang, record.target_lang, record.sender) == (
            u.source_lang,
            u.target_lang,
            u.speaker,
        )
    first = contents.records[0]
    assert first.row.startswith("dev.json:") and first.timestamp_ms is None


def test_bcontrast_bad_turns_are_problems(tmp_path):
    path = tmp_path / "chat.json"
    dialogues = {
        "c1": [
            {"utteranceID": 0, "speaker": "customer", "source": "Hallo", "target": "Hello"},
            {"utteranceID": 1, "speaker": "agent", "source": "  ", "target": ""},
            {"utteranceID": 2, "speaker": "agent", "source": "Hi \ufffd there", "target": "x"},
            {"speaker": "agent", "source": "no id"},
            {"utteranceID": 0, "speaker": "customer", "source": "again", "target": "x"},
        ]
    }
    path.write_text(json.dumps(dialogues), encoding="utf-8")
    contents = read_log(path, "bcontrast")
    assert [r.text for r in contents.records] == ["Hallo"]
    reasons = [p.reason for p in contents.problems]
    assert reasons[0] == "empty text"
    assert reasons[1].startswith("bad encoding")
    assert reasons[2].startswith("malformed turn")
    assert reasons[3].startswith("duplicate turn 0")
    assert contents.problems[0].row == "chat.json:c1/1"


def test_bcontrast_file_not_utf8_is_one_problem(tmp_path):
    path = tmp_path / "broken.json"
    path.write_bytes(b'{"c": [{"source": "\xff\xfe"}]}')
    items = list(read_bcontrast(path))
    assert len(items) == 1 and isinstance(items[0], Problem)
    assert items[0].reason.startswith("bad encoding")


def test_wmt_csv_good_and_bad_rows(tmp_path):
    path = tmp_path / "chat.csv"
    rows = [
        CSV_HEADER.encode(),
        b"d1,de,en,Wo ist meine Bestellung?,Where is my order?,customer\n",
        b'd1,en,de,"Let me check, one moment.",,agent\n',
        b"d1,xx,en,Unknown language,,customer\n",
        b"d2,de,en,,,customer\n",
        b"d2,de,en,Kaputt \xff\xfe Bytes,,customer\n",
        b"d2,en,de,Thanks!,Danke!,agent\n",
        b",en,de,no doc,,agent\n",
    ]
    path.write_bytes(b"".join(rows))
    contents = read_log(path, "wmt-csv")
    got = [(r.conversation_id, r.turn, r.text, r.reference, r.sender) for r in contents.records]
    assert got == [
        ("d1", 0, "Wo ist meine Bestellung?", "Where is my order?", "customer"),
        ("d1", 1, "Let me check, one moment.", None, "agent"),
        ("d2", 1, "Thanks!", "Danke!", "agent"),  # the empty row before it kept turn 0
    ]
    by_row = {p.row: p.reason for p in contents.problems}
    assert by_row["chat.csv:4"].startswith("unknown source language 'xx'")
    assert by_row["chat.csv:5"] == "empty text"
    assert by_row["chat.csv:6"] == "bad encoding: not UTF-8"
    assert by_row["chat.csv:8"].startswith("malformed row")
    assert len(contents.problems) == 4


def test_wmt_csv_missing_columns_is_a_problem_not_an_error(tmp_path):
    path = tmp_path / "wrong.csv"
    path.write_text("doc,text\nd1,hello\n", encoding="utf-8")
    contents = read_log(path, "wmt-csv")
    assert contents.records == []
    assert "source_language" in contents.problems[0].reason


def test_wmt_csv_optional_turn_and_timestamp_columns(tmp_path):
    path = tmp_path / "timed.csv"
    path.write_text(
        "doc_id,source_language,target_language,source_segment,reference,sender,turn,timestamp\n"
        "d1,en,de,second,,agent,1,2026-01-01T10:00:05Z\n"
        "d1,de,en,first,,customer,0,2026-01-01T10:00:00Z\n",
        encoding="utf-8",
    )
    records = read_log(path, "wmt-csv").records
    assert [(r.turn, r.text) for r in records] == [(1, "second"), (0, "first")]
    assert records[0].timestamp_ms - records[1].timestamp_ms == 5000


def _jsonl(path: Path, lines: list[object]) -> Path:
    with path.open("wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else json.dumps(line).encode())
            f.write(b"\n")
    return path


def test_jsonl_turns_intents_and_bad_rows(tmp_path):
    base = {"conversation_id": "c1", "source_lang": "en", "target_lang": "de"}
    path = _jsonl(
        tmp_path / "log.jsonl",
        [
            {**base, "turn": 0, "text": "Set an alarm", "intent": "alarm/set_alarm"},
            {**base, "turn": 1, "text": "for 7am", "reference": "um 7 Uhr"},
            b"{not json",
            {**base, "turn": 2, "text": ""},
            {**base, "turn": "3", "text": "turn is a string"},
            {**base, "turn": 4, "target_lang": "tlh", "text": "Qapla'"},
            b'{"conversation_id": "c1", "turn": 5, "source_lang": "en", "target_lang": "de", '
            b'"text": "caf\xe9"}',
            {"conversation_id": "c1", "turn": 6, "source_lang": "en", "text": "no target"},
            {**base, "turn": 1, "text": "duplicate turn"},
            {**base, "text": "no turn in a numbered conversation", "timestamp": 5},
        ],
    )
    contents = read_log(path, "jsonl")
    assert [(r.turn, r.text, r.intent, r.reference) for r in contents.records] == [
        (0, "Set an alarm", "alarm/set_alarm", None),
        (1, "for 7am", None, "um 7 Uhr"),
    ]
    reasons = {p.row.split(":")[1]: p.reason for p in contents.problems}
    assert reasons["3"].startswith("not JSON")
    assert reasons["4"] == "empty text"
    assert reasons["5"] == "malformed row: turn is not an integer"
    assert reasons["6"].startswith("unknown target language 'tlh'")
    assert reasons["7"] == "bad encoding: not UTF-8"
    assert reasons["8"] == "malformed row: target_lang missing or not a string"
    assert reasons["9"].startswith("duplicate turn 1")
    assert reasons["10"] == "turn missing in a conversation that numbers turns"


def test_jsonl_without_turns_numbers_by_timestamp(tmp_path):
    base = {"conversation_id": "t", "source_lang": "de", "target_lang": "en"}
    path = _jsonl(
        tmp_path / "timed.jsonl",
        [
            {**base, "timestamp": "2026-01-01T10:00:04+00:00", "text": "third"},
            {**base, "timestamp": 1767261600000, "text": "first"},  # 2026-01-01T10:00:00Z
            {**base, "timestamp": "2026-01-01T10:00:02", "text": "second"},
        ],
    )
    records = [item for item in read_jsonl(path) if isinstance(item, ReplayRecord)]
    ordered = sorted(records, key=lambda r: r.turn)
    assert [(r.turn, r.text) for r in ordered] == [(0, "first"), (1, "second"), (2, "third")]
    assert ordered[2].timestamp_ms - ordered[0].timestamp_ms == 4000


def test_known_languages_are_configurable(tmp_path):
    path = tmp_path / "pt.csv"
    path.write_text(CSV_HEADER + "d,pt,en,Olá,,customer\n", encoding="utf-8")
    assert read_log(path, "wmt-csv").records == []
    items = list(read_wmt_csv(path, known={"pt", "en"}))
    assert [i.text for i in items if isinstance(i, ReplayRecord)] == ["Olá"]


def test_unknown_format_and_timestamp_errors():
    with pytest.raises(ValueError, match="unknown log format"):
        iter_log(Path("x"), "xml")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        parse_timestamp_ms(True)
    assert parse_timestamp_ms("1700000000000") == 1_700_000_000_000


def test_xsid_translated_file_gives_commands_to_english_with_intents():
    """Issue #28: replaying xSID carries its real intent labels to the report."""
    contents = read_log(data_file("xsid/de.valid.conll"), "xsid")
    assert contents.problems == [] and len(contents.records) == 300
    first = contents.records[0]
    assert (first.source_lang, first.target_lang, first.text, first.reference, first.intent) == (
        "de",
        "en",
        "Regnet es heute?",
        "Is it going to rain today?",
        "weather/find",
    )
    assert len({r.intent for r in contents.records}) >= 10
    assert len({r.conversation_id for r in contents.records}) == 300


def test_xsid_english_file_pairs_with_the_translated_files_beside_it(tmp_path):
    contents = read_log(data_file("xsid/en.valid.conll"), "xsid")
    assert contents.problems == []
    targets = {r.target_lang for r in contents.records}
    assert targets == {"de", "it"} and len(contents.records) == 600
    it = next(r for r in contents.records if r.target_lang == "it")
    assert (it.text, it.reference, it.intent) == (
        "Is it going to rain today?",
        "Pioverà oggi?",
        "weather/find",
    )
    alone = tmp_path / "en.valid.conll"
    alone.write_bytes(data_file("xsid/en.valid.conll").read_bytes())
    [problem] = read_log(alone, "xsid").problems
    assert "no translated xSID file" in problem.reason


def test_xsid_bad_blocks_are_problems(tmp_path):
    (tmp_path / "en.valid.conll").write_text(
        "# text = Is it going to rain today?\n# intent = weather/find\n1\tIs\n\n"
        "# text = set an alarm\n# intent = alarm/set\n1\tset\n\n"
        "# text = no label here\n1\tno\n\n",
        encoding="utf-8",
    )
    (tmp_path / "de.valid.conll").write_text(
        "# id = 1\n# text-en = Is it going to rain today?\n# text = Regnet es heute?\n"
        "# intent = weather/find\n1\tRegnet\n\n"
        "# id = 2\n# text-en = something else\n# text = Stell einen Wecker\n"
        "# intent = alarm/set\n1\tStell\n\n"
        "# id = 3\n# text-en = no label here\n# text = \n# intent = x\n1\tkein\n",
        encoding="utf-8",
    )
    en = read_log(tmp_path / "en.valid.conll", "xsid")
    assert [r.reference for r in en.records] == ["Regnet es heute?"]
    assert [p.row for p in en.problems] == ["en.valid.conll:5->de", "en.valid.conll:9->de"]
    assert "no translation" in en.problems[0].reason and "malformed" in en.problems[1].reason
    de = read_log(tmp_path / "de.valid.conll", "xsid")
    assert len(de.records) == 2 and [p.row for p in de.problems] == ["de.valid.conll:13"]
    [wrong] = read_log(tmp_path / "commands.txt", "xsid").problems
    assert "not an xSID file" in wrong.reason
