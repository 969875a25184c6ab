"""workers/stages/faithful/rules.py: each detector on constructed cases and on real model outputs,
the
length-cap fit, and the packaged cap table."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from workers.engine.prompts import prompt_examples
from workers.stages.faithful.rules import (
    COVERAGE,
    LengthCap,
    LengthCaps,
    check,
    fit_length_cap,
    leaked_example,
    length_ratio,
    ngram_loop,
    ratio_outlier,
)

EXAMPLES = prompt_examples()
PATIENCE_DE = "Vielen Dank für Ihre Geduld. Ihr Ersatzgerät wird morgen verschickt."


def _index_of(target_de: str) -> int:
    return next(i for i, e in enumerate(EXAMPLES) if e["de"] == target_de)


# -- leaks ---------------------------------------------------------------------------------------


def test_a_copied_example_target_is_a_leak() -> None:
    # Gemma 3 270M's real answer to "Thanks" (en -> de) under the prompt before issue #18
    assert leaked_example("Thanks", PATIENCE_DE, EXAMPLES, "de") == _index_of(PATIENCE_DE)


def test_most_of_an_example_target_with_extra_words_is_a_leak() -> None:
    text = "Danke. Vielen Dank für Ihre Geduld, Ihr Ersatzgerät wird bald verschickt."
    assert leaked_example("Thanks a lot", text, EXAMPLES, "de") == _index_of(PATIENCE_DE)


def test_the_example_itself_may_be_translated_as_the_example() -> None:
    source = "Thank you for your patience. Your replacement will be shipped tomorrow."
    assert leaked_example(source, PATIENCE_DE, EXAMPLES, "de") is None
    # ... from any of its languages
    fr = "Merci de votre patience. Votre produit de remplacement sera expédié demain."
    assert leaked_example(fr, PATIENCE_DE, EXAMPLES, "de") is None


def test_a_paraphrase_of_the_example_source_may_get_its_translation() -> None:
    # real Gemma 3 output on a BConTrasT dev turn: a right translation, not a leak
    text = "Hallo, wie kann ich Ihnen heute helfen?"
    assert leaked_example("Hi there, how can I help today?", text, EXAMPLES, "de") is None
    assert leaked_example("Thanks, bye", text, EXAMPLES, "de") is not None


def test_short_example_targets_are_ordinary_answers() -> None:
    assert leaked_example("Thank you", "Danke!", EXAMPLES, "de") is None
    assert leaked_example("Yes, I'd like that", "Ja, bitte.", EXAMPLES, "de") is None


def test_an_ordinary_translation_is_no_leak() -> None:
    # real Gemma 3 outputs (bench/faithful.py, BConTrasT dev)
    assert leaked_example("Danke", "Thank you", EXAMPLES, "en") is None
    text = "Ich möchte eine Pizza für heute Abend bestellen."
    assert leaked_example("I want to order a pizza for tonight.", text, EXAMPLES, "de") is None


# -- length ratio --------------------------------------------------------------------------------


def test_ratio_outliers_on_both_sides() -> None:
    source = "Go to your Home screen."
    assert ratio_outlier(source, "Appuyez sur le bouton Home et sélectionnez l'écran " * 2)
    assert ratio_outlier(source * 3, "Écran.")
    assert not ratio_outlier(source, "Allez sur votre écran d'accueil.")
    assert length_ratio("abcd", "abcdefgh") == 2.0


def test_a_short_source_gets_a_few_characters_of_slack() -> None:
    assert not ratio_outlier("Ok", "In Ordnung")  # 5x, but a normal translation
    assert not ratio_outlier("Ok.", "In Ordnung.")
    assert not ratio_outlier("bye.", "Auf Wiedersehen.")  # 3x + 4: at the bound
    assert ratio_outlier("Thanks", PATIENCE_DE)
    assert ratio_outlier("A long enough source text", "")  # nothing for something
    assert ratio_outlier("Ja.", "")


def test_fluent_unrelated_answers_to_very_short_turns() -> None:
    # real SmolLM2-135M-Instruct answers (bench/faithful.py, BConTrasT dev): fluent, and no
    # translation of the turn; under the old 12-character floor every one passed
    for source, answer in [
        ("Ja.", "I'm sorry for your loss"),
        ("yup.", "Ich habe eine kleine Einlegen."),
        ("enjoy!", "Ich möchte einmal eine Einzel."),
        ("Great.", "Guten Abend, wie können ich e"),
        ("Thanks.", "Ich habe eine öffentlagen."),
    ]:
        assert check(source, answer, EXAMPLES, "de").problems == ("ratio",), source
    # the same turns translated pass
    for source, answer in [("Ja.", "Yes."), ("yup.", "Jep"), ("enjoy!", "Viel Freude damit!")]:
        assert not check(source, answer, EXAMPLES, "de").suspect, source


def test_the_short_slack_covers_the_references() -> None:
    # the fit of SHORT_SLACK_CHARS, on the repository's parallel data: references of sources
    # under 12 characters (BConTrasT train, Tatoeba beyond the benchmark's lines) pass
    from replay.datasets import bcontrast, tatoeba_pairs

    pairs = [(u.source, u.target) for u in bcontrast("train")]
    for lang in ("de", "fr", "es", "it"):
        pairs += [(en, t) for en, t in tatoeba_pairs(lang)[400:]]
        pairs += [(t, en) for en, t in tatoeba_pairs(lang)[400:]]
    short = [(s, t) for s, t in pairs if len(s.strip()) < 12]
    assert len(short) > 1000
    flagged = sum(ratio_outlier(s, t) for s, t in short)
    assert flagged / len(short) <= 0.005


def test_smollm2_chat_replies_to_short_german_turns() -> None:
    # real SmolLM2-135M-Instruct answers (bench/faithful.py, BConTrasT dev, de -> en): a chat
    # reply over 3x the source's length is a ratio outlier; one that echoes most of an
    # example's target is a leak (3.5x its 6-character source, within the short-source
    # slack of the ratio check); a chat reply of a translation's length passes every check:
    # the detectors judge form, not meaning
    reply = "I'm sorry for the misunderstanding. I'm sorry for any misunderstanding."
    assert check("Ja, um 19:10 Uhr.", reply, EXAMPLES, "en").problems == ("ratio",)
    assert check("Hallo,", "Hello, how can I help", EXAMPLES, "en").problems == ("leak",)
    assert not check("Ja, bitte.", "No worries.", EXAMPLES, "en").suspect


# -- loops -------------------------------------------------------------------------------------


def test_a_repeated_ngram_is_a_loop() -> None:
    assert ngram_loop("I am waiting.", "Ich warte und warte und warte und warte und warte.")
    text = "Der Tisch ist frei. Der Tisch ist frei. Bitte. Der Tisch ist frei."
    assert ngram_loop("The table is free.", text)


def test_repetition_the_source_has_is_no_loop() -> None:
    source = "No, no, no, no, no, no."
    assert not ngram_loop(source, "Nein, nein, nein, nein, nein, nein.")
    assert ngram_loop(source, "Nein, " * 12)  # twice as often as the source
    assert not ngram_loop("very very very good", "sehr sehr sehr gut")  # 3 words only
    assert not ngram_loop("Where is my order?", "Wo ist meine Bestellung?")


def test_check_names_every_problem() -> None:
    found = check("Thanks", PATIENCE_DE, EXAMPLES, "de", length_guard=True)
    assert found.problems == ("leak", "ratio", "length_guard")
    assert found.suspect
    clean = check("Where is my order?", "Wo ist meine Bestellung?", EXAMPLES, "de")
    assert clean.problems == () and not clean.suspect


# -- the length cap ------------------------------------------------------------------------------


def test_fit_covers_the_share_asked_for() -> None:
    counts = [(n, 2 * n + (n % 5)) for n in range(1, 400)]  # ref = 2 src + 0..4
    cap = fit_length_cap(counts, coverage=COVERAGE, margin=0)
    covered = sum(ref <= cap.tokens(src) for src, ref in counts) / len(counts)
    assert covered >= COVERAGE
    assert cap.slope == 2.0 and cap.intercept == 4.0  # the tightest line over them


def test_fit_adds_the_margin_and_refuses_no_data() -> None:
    assert fit_length_cap([(10, 10)] * 10, margin=2).tokens(10) == 12
    with pytest.raises(ValueError):
        fit_length_cap([])


def test_packaged_caps_cover_every_pair_for_both_models() -> None:
    caps = LengthCaps.packaged()
    langs = ("en", "de", "fr", "es", "it")
    assert set(caps.tokenizers) == {"gemma3", "smollm2"}
    raw = json.loads(resources.files("workers").joinpath("length_caps.json").read_text())
    for tok in caps.tokenizers:
        for src in langs:
            for tgt in langs:
                if src != tgt:
                    entry = raw["tokenizers"][tok][f"{src}-{tgt}"]
                    assert entry["covered"] >= COVERAGE - 0.001, (tok, src, tgt)
    assert caps.for_model("gemma3-270m@A") == "gemma3"
    assert caps.for_model("smollm2-135m") == "smollm2"
    assert caps.for_model("my-model.gguf") is None


def test_an_unknown_model_gets_the_loosest_cap_of_the_pair() -> None:
    caps = LengthCaps(
        {
            "a": {"en-de": {"slope": 1.5, "intercept": 4}},
            "b": {"en-de": {"slope": 2, "intercept": 3}},
        }
    )
    assert caps.cap("a", "en", "de") == LengthCap(1.5, 4.0)
    assert caps.cap(None, "en", "de") == LengthCap(2.0, 4.0)
    assert caps.cap("a", "de", "fr") == LengthCap(2.0, 4.0)  # no such pair: loosest of all
    assert LengthCap(1.5, 4.0).tokens(10) == 19
