"""workers.stages.faithful.spans: placeholders, links, e-mail addresses and ids a translation
dropped are found; the same spans copied (or reformatted where allowed) pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.stages.faithful.rules import check
from workers.stages.faithful.spans import dropped_spans

# the first is what issue #28 saw Gemma 3 270M send; the rest are made up of the same kind
DROPPED = [
    ("Hi #NAME#, thanks for contacting #PRS_ORG#.", "Hallo, #NAME#, ich freue mich auf dich!",
     ("#PRS_ORG#",)),
    ("Hello {{first_name}}, your ticket is ready.", "Hallo, Ihr Ticket ist fertig.",
     ("{{first_name}}",)),
    ("Track it at https://shop.example.com/track?id=9", "Verfolgen Sie es online.",
     ("https://shop.example.com/track?id=9",)),
    ("Write to support@example.com", "Schreiben Sie uns eine E-Mail", ("support@example.com",)),
    ("Order AB12345 has shipped", "Bestellung AB12346 wurde verschickt", ("AB12345",)),
    ("Ticket #4471 and #4471 again, dear %s", "Ticket #4471", ("%s",)),
]  # fmt: skip

KEPT = [
    ("Hi #NAME#, thanks for contacting #PRS_ORG#.",
     "Hallo #NAME#, danke, dass Sie #PRS_ORG# kontaktiert haben."),
    ("Hello {{ first_name }}!", "Hallo {{first_name}}!"),
    ("See www.Example.com/help/ for more", "Mehr unter www.example.com/help"),
    ("Mail SUPPORT@example.com", "E-Mail an support@example.com."),
    ("Order AB12345 has shipped", "La commande AB12345 a été expédiée"),
    ("Your order #1234567 is late", "Ihre Bestellung #1234567 ist verspätet"),
    ("It costs €15.", "Es kostet 15,00 €."),  # numbers are numbers.py's
    ("Thanks a lot!", "Vielen Dank!"),
    ("Check (www.example.de)", "Siehe (www.example.de)"),
]  # fmt: skip


@pytest.mark.parametrize(("source", "translation", "dropped"), DROPPED)
def test_dropped_spans_are_found(source: str, translation: str, dropped: tuple[str, ...]) -> None:
    assert dropped_spans(source, translation) == dropped


@pytest.mark.parametrize(("source", "translation"), KEPT)
def test_copied_spans_pass(source: str, translation: str) -> None:
    assert dropped_spans(source, translation) == ()


def test_a_dropped_placeholder_makes_the_answer_suspect() -> None:
    source, translation, _ = DROPPED[0]
    found = check(source, translation, [], "de")
    assert found.dropped_spans == ("#PRS_ORG#",) and "dropped" in found.problems
    assert not check(*KEPT[0], [], "de").dropped_spans


def test_the_hand_judged_sample_is_still_flagged() -> None:
    # data/judged/spans.jsonl: every answer the check flagged among Gemma 3's 650 unguarded
    # answers to real BConTrasT turns whose names were anonymised as #NAME#
    # (`bench/spans_sample.py`), judged by hand: all 71 lost or mangled the placeholder
    path = Path(__file__).resolve().parents[2] / "data" / "judged" / "spans.jsonl"
    rows = [json.loads(line) for line in path.read_text("utf-8").splitlines()]
    assert len(rows) == 71
    for r in rows:
        assert list(dropped_spans(r["source"], r["output"])) == r["flagged"], r["source"]
    assert sum(r["judgement"] == "dropped" for r in rows) == 71
