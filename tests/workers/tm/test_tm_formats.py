"""TM readers: valid and malformed TMX, TSV and replay JSONL, problems with file:line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.tm.formats import TMPair, TMProblem, format_of, normalize_lang, read_tm

TMX = """<?xml version="1.0" encoding="UTF-8"?>
<tmx version="1.4">
  <header creationtool="t" creationtoolversion="1" segtype="sentence" o-tmf="x"
          adminlang="en" srclang="en-US" datatype="plaintext"/>
  <body>
    <tu>
      <tuv xml:lang="en-US"><seg>Where is my   order?</seg></tuv>
      <tuv xml:lang="de-DE"><seg>Wo ist meine Bestellung?</seg></tuv>
      <tuv xml:lang="fr-FR"><seg>Où est ma commande ?</seg></tuv>
    </tu>
    <tu>
      <tuv xml:lang="en-US"><seg>Only one side</seg></tuv>
    </tu>
    <tu>
      <tuv xml:lang="en"><seg>Thanks a lot!</seg></tuv>
      <tuv><seg>Danke!</seg></tuv>
    </tu>
    <tu srclang="de">
      <tuv xml:lang="en"><seg>Hello</seg></tuv>
      <tuv xml:lang="de"><seg>Hallo</seg></tuv>
    </tu>
    <tu>
      <tuv xml:lang="en"><seg>Goodbye</seg></tuv>
      <tuv xml:lang="ja"><seg>さようなら</seg></tuv>
    </tu>
    <tu>
      <tuv xml:lang="en"><seg>   </seg></tuv>
      <tuv xml:lang="de"><seg>Leer</seg></tuv>
    </tu>
    <tu>
      <tuv xml:lang="en"><seg>See you tomorrow.</seg></tuv>
      <tuv xml:lang="it"><seg>A domani.</seg></tuv>
    </tu>
  </body>
</tmx>
"""


def _write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def _split(items: list[TMPair | TMProblem]) -> tuple[list[TMPair], dict[str, str]]:
    pairs = [i for i in items if isinstance(i, TMPair)]
    problems = {i.row: i.reason for i in items if isinstance(i, TMProblem)}
    return pairs, problems


def test_tmx_pairs_and_problems_with_lines(tmp_path: Path) -> None:
    pairs, problems = _split(list(read_tm(_write(tmp_path, "support.tmx", TMX))))
    assert [(p.source_lang, p.target_lang, p.source, p.target) for p in pairs] == [
        ("en", "de", "Where is my order?", "Wo ist meine Bestellung?"),  # whitespace collapsed
        ("en", "fr", "Where is my order?", "Où est ma commande ?"),
        ("de", "en", "Hallo", "Hello"),  # the unit's own srclang wins over the header's
        ("en", "it", "See you tomorrow.", "A domani."),
    ]
    assert pairs[0].origin == "support.tmx:6"
    assert set(problems) == {"support.tmx:11", "support.tmx:14", "support.tmx:22", "support.tmx:26"}
    assert "two <tuv>" in problems["support.tmx:11"]
    assert "xml:lang" in problems["support.tmx:14"]
    assert "unknown target language 'ja'" in problems["support.tmx:22"]
    assert "source: empty text" in problems["support.tmx:26"]


def test_tmx_not_well_formed_is_reported_and_the_rest_read(tmp_path: Path) -> None:
    broken = TMX.replace("<seg>Hallo</seg>", "<seg>Hallo</sg>")
    pairs, problems = _split(list(read_tm(_write(tmp_path, "broken.tmx", broken))))
    assert any("not well-formed XML" in r for row, r in problems.items() if row == "broken.tmx:20")
    # the units before the damage are still imported
    assert ("Where is my order?", "Wo ist meine Bestellung?") in [
        (p.source, p.target) for p in pairs
    ]


def test_tmx_that_is_not_xml_at_all_is_one_problem(tmp_path: Path) -> None:
    items = list(read_tm(_write(tmp_path, "empty.tmx", b"\x00\x01 not xml")))
    assert len(items) == 1 and isinstance(items[0], TMProblem)
    assert items[0].row == "empty.tmx:1"
    assert "not well-formed XML" in items[0].reason and "nothing recoverable" in items[0].reason
    other = _write(tmp_path, "other.tmx", '<?xml version="1.0"?>\n<xliff version="1.2"/>\n')
    assert [(i.row, "not a TMX document" in i.reason) for i in read_tm(other)] == [
        ("other.tmx:1", True)
    ]


def test_tsv_four_columns_header_comments_and_bad_rows(tmp_path: Path) -> None:
    text = (
        "source_lang\ttarget_lang\tsource\ttarget\n"
        "en\tde\tGood morning\tGuten Morgen\n"
        "# a comment\n"
        "\n"
        "en\tde\tonly three\n"
        "en-GB\tes\tThank you\tGracias\n"
        "xx\tde\tHello\tHallo\n"
        "en\tde\t\tleer\n"
    )
    path = _write(tmp_path, "tm.tsv", text.encode() + b"en\tde\t\xff\xfe\tx\n")
    pairs, problems = _split(list(read_tm(path)))
    assert [(p.source_lang, p.target_lang, p.source, p.target, p.origin) for p in pairs] == [
        ("en", "de", "Good morning", "Guten Morgen", "tm.tsv:2"),
        ("en", "es", "Thank you", "Gracias", "tm.tsv:6"),
    ]
    assert "3 columns, expected 4" in problems["tm.tsv:5"]
    assert "unknown source language 'xx'" in problems["tm.tsv:7"]
    assert "source: empty text" in problems["tm.tsv:8"]
    assert "not UTF-8" in problems["tm.tsv:9"]


def test_tsv_two_columns_with_a_given_pair(tmp_path: Path) -> None:
    path = _write(tmp_path, "de-en.tab", "Hallo\tHello\nzu\tviele\tSpalten\n")
    pairs, problems = _split(list(read_tm(path, pair=("de", "en"))))
    assert [(p.source_lang, p.target_lang, p.source) for p in pairs] == [("de", "en", "Hallo")]
    assert "3 columns, expected 2" in problems["de-en.tab:2"]


def test_replay_jsonl_rows_with_references_become_pairs(tmp_path: Path) -> None:
    rows = [
        {
            "conversation_id": "c1",
            "turn": 0,
            "source_lang": "de",
            "target_lang": "en",
            "text": "Wo ist mein Paket?",
            "reference": "Where is my parcel?",
        },
        {
            "conversation_id": "c1",
            "turn": 1,
            "source_lang": "en",
            "target_lang": "de",
            "text": "Let me check.",
        },
    ]
    lines = [json.dumps(r, ensure_ascii=False) for r in rows] + ["{not json"]
    path = _write(tmp_path, "log.jsonl", "\n".join(lines) + "\n")
    pairs, problems = _split(list(read_tm(path)))
    assert [(p.source, p.target, p.origin) for p in pairs] == [
        ("Wo ist mein Paket?", "Where is my parcel?", "log.jsonl:1")
    ]
    assert "no reference translation" in problems["log.jsonl:2"]
    assert "not JSON" in problems["log.jsonl:3"]


def test_format_from_extension_and_language_tags() -> None:
    assert format_of(Path("a.TMX")) == "tmx"
    assert format_of(Path("a.tab")) == "tsv"
    with pytest.raises(ValueError, match="unknown TM format"):
        format_of(Path("a.csv"))
    assert normalize_lang("en_US") == normalize_lang("EN-us") == "en"
    assert normalize_lang(None) == ""
