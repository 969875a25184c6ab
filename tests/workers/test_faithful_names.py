"""The dropped-names check (`workers/stages/faithful/names.py`): pure function, packaged lists.

The demo's case (issue #28): "... wollen heute Abend Aquaman sehen." -> "... go to the beach
today." lost the film's name, while "Abend" (a German noun, capitalised) is translated, not a
name. Also checked: names kept through inflection and spelling, sentence starts, acronyms,
placeholders left to the span check, and the references of data/ (human translations keep
their names, so the check must rarely call them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.stages.faithful.names import (
    common_words,
    dropped_names,
    is_sentence_start,
    name_candidates,
)
from workers.stages.faithful.rules import check

DEMO_SOURCE = "Hallo. Ein Freund von mir und ich wollen heute Abend Aquaman sehen."


DEMO_ANSWER = "Hello. A friend and I want to go to the beach today."  # `tolk demo`'s, issue #28
REFERENCE = "Hey. A friend of mine and I want to see Aquaman tonight."


def test_the_demo_answer_lost_the_films_name() -> None:
    assert dropped_names(DEMO_SOURCE, DEMO_ANSWER, "de") == ("Aquaman",)
    assert dropped_names(DEMO_SOURCE, REFERENCE, "de") == ()


@pytest.mark.parametrize(
    "source,translation,lang,want",
    [
        # English days, months and languages are common words: translated, not dropped
        ("It comes on Monday, in English.", "Es kommt am Montag, auf Deutsch.", "en", ()),
        ("Please call Anna at Starbucks.", "Bitte Anna bei Starbucks anrufen.", "en", ()),
        (
            "Please call Anna at Starbucks.",
            "Bitte sie im Café anrufen.",
            "en",
            ("Anna", "Starbucks"),
        ),
        # inflected, spelled without umlauts, inside a compound
        ("Das ist Annas Fahrrad.", "This is Anna's bike.", "de", ()),
        ("Ich wohne in Düsseldorf.", "I live in Duesseldorf.", "de", ()),
        ("Wir sehen den Aquaman Film.", "We watch the Aquaman-film.", "de", ()),
        # a sentence start is not a name position; acronyms and short words are not names
        ("Tom is here. Berlin is big.", "Er ist hier. Sie ist groß.", "en", ()),
        ("Send it to the EU via DHL.", "Schicke es in die Union.", "en", ()),
        # camel case is a name anywhere
        ("iPhone owners can call us.", "Besitzer können uns anrufen.", "en", ("iPhone",)),
        # placeholders and links are the span check's
        ("Hi #NAME#, see https://Example.com/Help", "Hallo, siehe unten", "en", ()),
        # a German compound of common words is common
        ("Ihr Ersatzgerät kommt morgen.", "Your replacement device arrives tomorrow.", "de", ()),
        # no list for the language: no call
        ("Je parle avec Marie.", "I talk to her.", "xx", ()),
    ],
)
def test_dropped_names(source: str, translation: str, lang: str, want: tuple[str, ...]) -> None:
    assert dropped_names(source, translation, lang) == want


def test_a_crafted_compound_takes_no_time() -> None:
    # untrusted text: a word of overlapping listed parts must not take exponential time
    import time

    parts = {("ab" * 6)[:n] for n in range(4, 11)} | {("ba" * 6)[:n] for n in range(4, 11)}
    lists = {"de": frozenset(parts)}  # listed parts of 4-10 letters that overlap everywhere
    word = "Ab" + "ab" * 29 + "x"  # 61 letters, no split ends (unmemoised: ~3x per 4 letters)
    t0 = time.perf_counter()
    assert dropped_names(f"Das ist {word} hier.", "That is it.", "de", lists) == (word,)
    assert time.perf_counter() - t0 < 0.5


def test_sentence_starts_and_candidates() -> None:
    text = '"Hallo!" Wie geht es Anna? (Gut.) Danke, Tom'
    assert is_sentence_start(text, text.index("Hallo"))
    assert is_sentence_start(text, text.index("Wie"))
    assert not is_sentence_start(text, text.index("Anna"))
    assert is_sentence_start(text, text.index("Gut"))
    assert name_candidates(text) == ["Anna", "Tom"]


def test_the_packaged_lists_know_nouns_and_leave_names_out() -> None:
    de, en = common_words("de"), common_words("en")
    assert de is not None and en is not None
    assert {"abend", "ersatz", "gerät"} <= de and "tom" not in de
    assert {"monday", "english"} <= en and not {"tom", "starbucks"} & en
    assert common_words("xx") is None


def test_human_translations_rarely_drop_a_name() -> None:
    # BConTrasT dev (never used to build the lists): the references keep their names, so what
    # the check calls on them is its false-alarm rate on good translations
    dev = json.loads(Path("data/bcontrast_wmt20_chat/dev.json").read_text("utf-8"))
    turns = [t for conv in dev.values() for t in conv]
    src_lang = {"agent": "en", "customer": "de"}
    called = [t for t in turns if dropped_names(t["source"], t["target"], src_lang[t["speaker"]])]
    assert len(turns) > 1000
    assert len(called) / len(turns) < 0.025, [(t["source"], t["target"]) for t in called[:20]]


def test_the_check_reports_names_without_making_the_answer_suspect() -> None:
    found = check(DEMO_SOURCE, DEMO_ANSWER, [], "en", source_lang="de")
    assert found.dropped_names == ("Aquaman",)
    assert found.observed == ("name",) and "name" not in found.problems


def test_the_hand_judged_sample_is_still_flagged() -> None:
    # data/judged/names.jsonl: 50 of the 266 Gemma 3 answers (of 1,000) the check flagged, drawn
    # at random and judged by hand (26 lost a name: precision 0.52, why the check is observed
    # only); a change of the check must keep flagging them as judged, or the sample is redone
    path = Path(__file__).resolve().parents[2] / "data" / "judged" / "names.jsonl"
    rows = [json.loads(line) for line in path.read_text("utf-8").splitlines()]
    assert len(rows) == 50
    for r in rows:
        got = dropped_names(r["source"], r["output"], r["pair"].split("-")[0])
        assert list(got) == r["flagged"], r["source"]
    right = sum(r["judgement"] == "name lost" for r in rows)
    assert right == 26  # the recorded judgements; PROMPTS.md states the precision from them
