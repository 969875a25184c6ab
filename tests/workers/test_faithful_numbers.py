"""workers.stages.faithful.numbers: invented numbers found, faithful reformatting let through."""

from __future__ import annotations

import pytest

from workers.stages.faithful.numbers import invented_numbers, number_values
from workers.stages.faithful.rules import check

# what issue #28 saw Gemma 3 270M send to customers, and made-up ones of the same kind
INVENTED = [
    ("we would offer to send you a free replacement",
     "wir würden Ihnen einen kostenlosen Ersatz von 100 Euro anbieten", ("100",)),
    ("we can offer compensation", "wir können eine 120€-Entschädigung anbieten", ("120",)),
    ("I have 3 kids", "J'ai 4 enfants", ("4",)),
    ("The parcel arrives tomorrow.", "Das Paket kommt morgen um 10:30 Uhr.", ("10:30",)),
    ("3 items", "15 Artikel", ("15",)),  # 3 is no clock hour here: 15 is not 3 pm
    ("Your refund is on its way.", "Ihre Rückerstattung von 49,99 € ist unterwegs.", ("49,99",)),
    ("Order A-12345 has shipped", "Bestellung A-12346 wurde verschickt", ("12346",)),
    ("a run time of 4:41.30", "eine Zeit von 4:42.30", ("4:42.30",)),  # FLORES: m:ss.hh
    ("at 11:35 pm", "am 11. Mai 2019", ("11", "2019")),  # an hour is no date's day
    ("the 1980s", "im Jahr 80", ("80",)),  # a year's two digits only as a decade ('80)
    ("I went there", "Ich war 1 Mal dort", ("1",)),  # "I" is no Roman numeral
    ("Le mois dernier, L'Iran", "Last month, 50 planes in Iran", ("50",)),  # nor "Le", "L'"
    ("at 12:30:45", "um 12:31:45 Uhr", ("12:31:45",)),
    # a decade of another year, and a number cut short before more text, are still invented
    ("in 1960", "in 1970", ("1970",)),
    ("Bis 1976 wurden", "Depuis 1976, 19 personnes.", ("19",)),
]  # fmt: skip

FAITHFUL = [
    # a race time (FLORES devtest): "4:41.30" crashed the check until 2026-12-03
    (
        "a combined run time of 4:41.30, 2:11.60 minutes slower",
        "un temps combiné de 4:41.30, soit 2:11.60 minutes de plus",
    ),
    ("at 12:30:45", "um 12:30:45 Uhr"),
    # the false alarms of the first FLORES sample (2026-12-03): clock times in French notation,
    # a formula, "1 000e", a decade
    ("Between 10:00-11:00 pm MDT, a fire", "Entre 10h00-11h00 heure locale, un incendie"),
    ("Fire crews doused the fire by 11:35 pm.", "Les pompiers ont éteint le feu vers 11 heures."),
    ("shook western Montana at 10:08 p.m. on Monday", "à 10 h 08 p.m. le lundi"),
    ("cut carbon dioxide emissions", "die CO2-Emissionen senken"),
    ("His 1,000th stamp", "Son 1 000e timbre"),
    ("During the 1980s he worked", "Durante gli anni '80 lavorò"),
    # and of the second (held-out) one: no-break spaces, Roman numerals, a hyphenated fraction
    ("long de 6\u202f387 km (3\u202f980 miles)", "6 387 km (3980 miles) long"),
    ("de 5\u00a0000 ans av. J.-C.", "from 5000 years ago"),
    ("du XIe au XIIIe siècle", "in the early 13th century"),
    ("au Xe siècle", "in the 10th century"),
    ("about one-third is covered", "circa il 1/3 è coperto"),
    ("It costs €15.", "Es kostet 15,00 €."),
    ("The total is EUR 1,000.50", "Die Summe beträgt 1.000,50 EUR"),
    ("We have 1 000 units", "Wir haben 1000 Stück"),
    ("3.5 stars", "3,5 Sterne"),
    ("See you at 7:10pm", "Bis um 19:10 Uhr"),
    ("See you at 7:10pm", "Bis um 19.10 Uhr"),
    ("See you at 7pm", "Bis 19 Uhr"),
    ("The shop closes at 0:00", "Der Laden schließt um 0.00 Uhr"),  # midnight as a time
    ("See you at seven p.m.", "Bis 19:00 Uhr"),
    ("um 19 Uhr", "at 7 pm"),
    ("Your order of 05/12/2024", "Ihre Bestellung vom 12.05.2024"),
    ("fifteen minutes", "15 Minuten"),
    ("Es sind fünfundzwanzig Euro", "It is 25 euros"),
    ("Het kost vijfentwintig euro", "It costs 25 euros"),
    ("twenty-five euros", "25 euros"),
    ("It takes an hour", "Es dauert 1 Stunde"),
    ("the first time", "das 1. Mal"),
    ("a dozen eggs", "12 Eier"),
    ("Call +49 30 1234567", "Rufen Sie +49 30 1234567 an"),
    ("Hi <x1>, your order <x2> is late", "Hallo <x1>, Ihre Bestellung <x2> ist verspätet"),
    ("No numbers here.", "Hier keine Zahlen."),
    ("Quinze euros, s'il vous plaît", "15 euros, please"),
    # a decade of the source as its year (flores-fresh-1's false alarms, fixed after judging)
    ("Negli anni '80 ha collaborato", "En 1980, il a collaboré"),
    ("Durante los años 60, trabajó", "During the 1960s, he worked"),
    ("in den 60er Jahren", "in the 1960s"),
    # a loop of a source number cut by the output cap
    ("Bis 1976 wurden", "Depuis 1976, 1976, 1976, 19"),
]


@pytest.mark.parametrize("source,translation,found", INVENTED)
def test_invented_numbers_are_found(source: str, translation: str, found: tuple[str, ...]) -> None:
    assert invented_numbers(source, translation) == found


@pytest.mark.parametrize("source,translation", FAITHFUL)
def test_numbers_carried_over_in_another_form_are_not(source: str, translation: str) -> None:
    assert invented_numbers(source, translation) == ()


def test_number_values_read_separators_both_ways() -> None:
    assert {1000.0, 1.0} <= number_values("1.000")  # German thousands, or English decimal
    assert 1000.5 in number_values("1.000,50") and 1000.5 in number_values("1,000.50")
    assert 15.0 in number_values("15,00 €")  # zero cents
    assert 3.0 in number_values("drei") and 21.0 in number_values("einundzwanzig")
    assert 15.0 not in number_values("3 items")  # only clock hours get the other 12


def test_check_reports_an_invented_number_as_a_problem() -> None:
    found = check("we can offer compensation", "wir können eine 120€-Entschädigung anbieten",
                  [], "de")  # fmt: skip
    assert found.suspect and found.problems == ("number",)
    assert found.invented_numbers == ("120",)
    assert not check("It costs €15.", "Es kostet 15,00 €.", [], "de").suspect


def test_the_hand_judged_sample_is_still_flagged_and_precise() -> None:
    # data/judged/invented_numbers.jsonl: every output the check flagged on real answers of
    # both models, each judged by hand; a change of the check must keep flagging every answer
    # judged invented (it may stop flagging one judged a false alarm: that is a fix), and the
    # judged precision must stay >= 0.8 (issue #28, Done-when 2)
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "data" / "judged" / "invented_numbers.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(records) >= 20
    judged_right = [r for r in records if r["judgement"] == "invented"]
    assert all(invented_numbers(r["source"], r["output"]) for r in judged_right)
    invented = len(judged_right)
    assert invented / len(records) >= 0.8


@pytest.mark.slow
def test_every_real_text_of_the_repository_is_read_without_error() -> None:
    """Every text of data/ (BConTrasT, FLORES-200 devtest, Tatoeba) as source and translation:
    the check runs on every answer the worker sends, so no number form may crash it."""
    from replay.datasets import bcontrast, flores, tatoeba_pairs

    texts = [t for u in bcontrast("dev") for t in (u.source, u.target or "")]
    texts += [t for lang in ("en", "de", "fr", "es", "it") for t in flores(lang)]
    texts += [t for lang in ("de", "fr", "es", "it") for pair in tatoeba_pairs(lang) for t in pair]
    assert len(texts) > 10_000
    for text in texts:
        assert invented_numbers(text, text) == ()  # a text supports its own numbers
