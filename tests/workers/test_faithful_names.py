"""The dropped-names check (`workers/stages/faithful/names.py`): pure function, packaged lists.

The demo's case (issue #28): "... wollen heute Abend Aquaman sehen." -> "... go to the beach
today." lost the film's name, while "Abend" (a German noun, capitalised) is translated, not a
name. Also checked: names kept through inflection and spelling, sentence starts, acronyms,
placeholders left to the span check, the word-frequency tests (a frequent word, a word the
target language writes far less often, a compound of words), and the references of data/ (human
translations keep their names, so the check must rarely call them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.datasets import flores
from workers.stages.faithful.names import (
    COMMON_ZIPF,
    common_words,
    dropped_names,
    is_sentence_start,
    name_candidates,
    zipf,
)
from workers.stages.faithful.rules import check

DEMO_SOURCE = "Hallo. Ein Freund von mir und ich wollen heute Abend Aquaman sehen."


DEMO_ANSWER = "Hello. A friend and I want to go to the beach today."  # `tolk demo`'s, issue #28
REFERENCE = "Hey. A friend of mine and I want to see Aquaman tonight."


def test_the_demo_answer_lost_the_films_name() -> None:
    assert dropped_names(DEMO_SOURCE, DEMO_ANSWER, "de") == ("Aquaman",)
    assert dropped_names(DEMO_SOURCE, REFERENCE, "de") == ()


@pytest.mark.parametrize(
    "source,translation,lang,target,want",
    [
        # English days, months and languages are common words: translated, not dropped
        ("It comes on Monday, in English.", "Es kommt am Montag, auf Deutsch.", "en", None, ()),
        ("Please call Okafor at Starbucks.", "Bitte Okafor bei Starbucks anrufen.", "en", None, ()),
        (
            "Please call Okafor at Starbucks.",
            "Bitte sie im Café anrufen.",
            "en",
            None,
            ("Okafor", "Starbucks"),
        ),
        # inflected, spelled without umlauts, inside a compound, a possessive cut
        ("Das ist Annas Fahrrad.", "This is Anna's bike.", "de", None, ()),
        ("Ich wohne in Düsseldorf.", "I live in Duesseldorf.", "de", None, ()),
        ("Wir sehen den Aquaman Film.", "We watch the Aquaman-film.", "de", None, ()),
        ("We love Aquaman's songs.", "Wir lieben die Lieder.", "en", "de", ("Aquaman",)),
        # a sentence start is not a name position; acronyms and short words are not names
        ("Tom is here. Berlin is big.", "Er ist hier. Sie ist groß.", "en", None, ()),
        ("Send it to the EU via DHL.", "Schicke es in die Union.", "en", None, ()),
        # camel case is a name anywhere, however frequent
        ("iPhone owners can call us.", "Besitzer können uns anrufen.", "en", "de", ("iPhone",)),
        # placeholders and links are the span check's; a unit after a number is no name
        ("Hi #NAME#, see https://Example.com/Help", "Hallo, siehe unten", "en", None, ()),
        ("Up to 600Mbit/s and 20 Euro.", "Bis zu 600 und 20.", "en", "de", ()),
        # a German compound of common words is common, also one of frequent words
        (
            "Ihr Ersatzgerät kommt morgen.",
            "Your replacement device arrives tomorrow.",
            "de",
            "en",
            (),
        ),
        ("Die Keimbahnzellen sind hier.", "The germ cells are here.", "de", "en", ()),
        # frequent words are common ("Court", "House"); a rare name is copied
        ("Meet me at the Court House.", "Treffen wir uns am Gericht.", "en", "de", ()),
        (
            "The driver was Zachary Cuddeback.",
            "Der Fahrer war Zachary Cudback.",
            "en",
            "de",
            ("Cuddeback",),
        ),
        # a name the target spells its own way: checked without the target, not with it
        ("We ship to Moldova.", "Wir liefern nach Moldawien.", "en", None, ("Moldova",)),
        ("We ship to Moldova.", "Wir liefern nach Moldawien.", "en", "de", ()),
        # a transliteration one letter off is kept
        ("Er flog nach Bischkek.", "He flew to Bishkek.", "de", "en", ()),
        # no list for the language: no call
        ("Je parle avec Marie.", "I talk to her.", "xx", None, ()),
    ],
)
def test_dropped_names(
    source: str, translation: str, lang: str, target: str | None, want: tuple[str, ...]
) -> None:
    assert dropped_names(source, translation, lang, target) == want


def test_the_frequencies_behind_the_cases_above() -> None:
    # the packaged word frequencies (wordfreq) the tests above rely on
    assert zipf("court", "en") >= COMMON_ZIPF > zipf("moldova", "en") > zipf("moldova", "de") + 0.8
    assert zipf("cuddeback", "en") < 2.0 and zipf("erdbeben", "en") == 0.0


def test_a_crafted_compound_takes_no_time() -> None:
    # untrusted text: a word of overlapping listed parts must not take exponential time
    import time

    parts = {("ab" * 6)[:n] for n in range(4, 11)} | {("ba" * 6)[:n] for n in range(4, 11)}
    lists = {"de": frozenset(parts)}  # listed parts of 4-10 letters that overlap everywhere
    word = "Ab" + "ab" * 29 + "x"  # 61 letters, no split ends (unmemoised: ~3x per 4 letters)
    t0 = time.perf_counter()
    assert dropped_names(f"Das ist {word} hier.", "That is it.", "de", lists=lists) == (word,)
    assert time.perf_counter() - t0 < 0.5
    # nor a long run of digits before many words (the unit test looks back a few characters)
    text = "1" * 20000 + " Zyx" * 2000
    t0 = time.perf_counter()
    assert dropped_names(text, "", "en", "de") == ("Zyx",)  # once, though 2,000 times there
    assert time.perf_counter() - t0 < 2.0


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
    tgt_lang = {"agent": "de", "customer": "en"}
    called = [
        t
        for t in turns
        if dropped_names(t["source"], t["target"], src_lang[t["speaker"]], tgt_lang[t["speaker"]])
    ]
    assert len(turns) > 1000
    assert len(called) / len(turns) < 0.01, [(t["source"], t["target"]) for t in called[:20]]


def test_news_references_rarely_drop_a_name() -> None:
    # FLORES-200 devtest, every direction among en, de, fr, es, it (20,240 human translations
    # full of names and exonyms): 4.2 % called when the thresholds were chosen, mostly German
    # nouns wordfreq does not know and transliterations ("Timbuktu" / "Tombouctou")
    langs = ("en", "de", "fr", "es", "it")
    texts = {lang: flores(lang) for lang in langs}
    called = total = 0
    for s in langs:
        for t in langs:
            if s != t:
                pairs = zip(texts[s], texts[t], strict=True)
                called += sum(bool(dropped_names(a, b, s, t)) for a, b in pairs)
                total += len(texts[s])
    assert total > 20000
    assert called / total < 0.05


def test_a_dropped_name_is_the_answers_problem() -> None:
    found = check(DEMO_SOURCE, DEMO_ANSWER, [], "en", source_lang="de")
    assert found.dropped_names == ("Aquaman",)
    assert found.problems == ("name",) and found.suspect


def test_the_hand_judged_sample_is_still_flagged() -> None:
    # data/judged/names.jsonl, sample names-2: 55 drawn at random from the 138 of Gemma 3's
    # 1,126 unguarded FLORES answers the check flags (directions it was not judged on before),
    # judged by hand: 44 lost a name (precision 0.80). A change of the check must keep flagging
    # them as judged, or the sample is redone. names-1 (50 rows, 26 right) judged the check of
    # 2026-12-04, before the word frequencies: kept as the record of that figure.
    path = Path(__file__).resolve().parents[2] / "data" / "judged" / "names.jsonl"
    rows = [json.loads(line) for line in path.read_text("utf-8").splitlines()]
    old = [r for r in rows if r["sample"] == "names-1"]
    new = [r for r in rows if r["sample"] == "names-2"]
    assert (len(old), sum(r["judgement"] == "name lost" for r in old)) == (50, 26)
    assert len(new) == 55
    for r in new:
        source_lang, target_lang = r["pair"].split("-")
        got = dropped_names(r["source"], r["output"], source_lang, target_lang)
        assert list(got) == r["flagged"], r["source"]
    right = sum(r["judgement"] == "name lost" for r in new)
    assert right == 44  # the recorded judgements; PROMPTS.md states the precision from them
