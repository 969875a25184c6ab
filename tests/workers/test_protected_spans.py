"""workers/text/spans.py: which spans are found, masking round trips, restore
verification
and the preservation metric."""

from __future__ import annotations

import pytest

from workers.text.spans import (
    DEFAULT_STYLE,
    MASK_STYLES,
    MaskConflict,
    RestoreError,
    Span,
    find_spans,
    mask,
    preservation,
    restore,
    style_for_model,
)


def kinds_and_texts(text: str) -> list[tuple[str, str]]:
    return [(s.kind, s.text) for s in find_spans(text)]


# ----------------------------------------------------------------------------- find_spans

FOUND = [
    # URLs with paths, query strings, and the sentence's punctuation left outside
    (
        "See https://shop.example.com/orders/123?id=5&lang=de. Thanks",
        [("url", "https://shop.example.com/orders/123?id=5&lang=de")],
    ),
    ("Go to www.example.org/help, then log in", [("url", "www.example.org/help")]),
    ("(details at example.com/faq?q=1)", [("url", "example.com/faq?q=1")]),
    ("Link: http://a.example.de/x_(y)", [("url", "http://a.example.de/x_(y)")]),
    # e-mail addresses, not split into a URL and a name
    (
        "Write to support.team+de@mail.example.com today",
        [("email", "support.team+de@mail.example.com")],
    ),
    # numbers with separators and decimals, times, dates, with a unit or % glued after
    ("It costs 1,234.56 USD or 1.234,56 EUR.", [("number", "1,234.56"), ("number", "1.234,56")]),
    (
        "Um 8:30 oder 19:10 Uhr am 12/03/2020",
        [("number", "8:30"), ("number", "19:10"), ("number", "12/03/2020")],
    ),
    (
        "at 7:10pm for 2 people, 5% off, 10kg",
        [("number", "7:10"), ("number", "2"), ("number", "5"), ("number", "10")],
    ),
    ("Call (916) 921-2500", [("number", "916"), ("number", "921"), ("number", "2500")]),
    # order ids
    ("Order A-12345 and #1234567 are late", [("order_id", "A-12345"), ("order_id", "#1234567")]),
    (
        "Ref ORD-2020-88412 / IBAN DE89370400440532013000",
        [("order_id", "ORD-2020-88412"), ("order_id", "DE89370400440532013000")],
    ),
    # placeholders
    (
        "Hello #PRS_ORG#, your #NAME# is here",
        [("placeholder", "#PRS_ORG#"), ("placeholder", "#NAME#")],
    ),
    (
        "Hi {{name}}, {{ user.first }} and {name}",
        [
            ("placeholder", "{{name}}"),
            ("placeholder", "{{ user.first }}"),
            ("placeholder", "{name}"),
        ],
    ),
    (
        "%s has %d items, %(count)s left, %1$s",
        [
            ("placeholder", "%s"),
            ("placeholder", "%d"),
            ("placeholder", "%(count)s"),
            ("placeholder", "%1$s"),
        ],
    ),
]


@pytest.mark.parametrize(("text", "expected"), FOUND)
def test_find_spans(text: str, expected: list[tuple[str, str]]) -> None:
    assert kinds_and_texts(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "Ich möchte den Zeitraum ändern, bitte.",
        "Das ist im A4 Format, eine MP3 Datei, und OK.",
        "Mr. Smith said e.g. that we are at no. one.",
        "CamelCaseWords and UPPERCASE words, hashtags #great, a x2y3 code",
        "Ganz sicher? Nein: hundertprozentig, z.B. am Wochenende.",
    ],
)
def test_no_false_spans_inside_ordinary_words(text: str) -> None:
    assert kinds_and_texts(text) == []


def test_digits_inside_a_word_are_not_a_number() -> None:
    assert kinds_and_texts("a 100% natural x2y3 code, 3rd try") == [
        ("number", "100"),
        ("number", "3"),
    ]


def test_spans_carry_offsets_and_never_overlap() -> None:
    text = "Mail a@b.com about https://x.com/1 and order #55555 at 9:40"
    spans = find_spans(text)
    assert all(text[s.start : s.end] == s.text for s in spans)
    assert all(a.end <= b.start for a, b in zip(spans, spans[1:], strict=False))
    assert [s.kind for s in spans] == ["email", "url", "order_id", "number"]


# ----------------------------------------------------------------------------- mask / restore


@pytest.mark.parametrize("style", list(MASK_STYLES.values()), ids=list(MASK_STYLES))
def test_mask_restore_round_trip(style) -> None:
    text = "Order A-12345 ships to {{name}} at 8:30, see https://x.example.com/t?id=7."
    masked = mask(text, style=style)
    assert [s.text for s in masked.spans] == [
        "A-12345",
        "{{name}}",
        "8:30",
        "https://x.example.com/t?id=7",
    ]
    for span in masked.spans:
        assert span.text not in masked.text
    assert masked.text.count(style.token(1)) == 1 and style.token(4) in masked.text
    assert restore(masked, masked.text) == text  # identity "translation"
    # a translation that moves the tokens around restores each one in place
    moved = f"{style.token(3)}: {style.token(1)} an {style.token(2)}, {style.token(4)}"
    assert restore(masked, moved) == "8:30: A-12345 an {{name}}, https://x.example.com/t?id=7"


def test_mask_without_spans_is_the_text() -> None:
    masked = mask("Guten Tag, wie geht es?")
    assert masked.text == "Guten Tag, wie geht es?" and masked.spans == ()
    assert restore(masked, "Good day, how are you?") == "Good day, how are you?"


def test_mask_takes_given_spans_in_position_order() -> None:
    text = "ab 12 cd 34"
    spans = [Span("number", 9, 11, "34"), Span("number", 3, 5, "12")]
    assert mask(text, spans).text == "ab <x1> cd <x2>"


def test_text_with_mask_like_tokens_cannot_be_masked() -> None:
    with pytest.raises(MaskConflict):
        mask("literal <x1> in a template with 5 items")
    with pytest.raises(MaskConflict):
        mask("see [2] for 5 items", style=MASK_STYLES["square"])


MASKED = mask("Order A-12345 at 8:30 costs 12.50")  # <x1> <x2> <x3>


@pytest.mark.parametrize(
    ("translation", "field", "value"),
    [
        ("Bestellung <x1> um <x2> kostet", "missing", (3,)),
        ("Bestellung <x1> <x1> um <x2> kostet <x3>", "duplicated", (1,)),
        ("Bestellung <x1> um <x2> kostet <x3> <x4>", "unknown", (4,)),
        ("Bestellung <x1> um <x 2> kostet <x3>", "mangled", ("<x 2",)),
        ("Bestellung <x1> um x2> kostet <x3>", "mangled", ("2>",)),
        ("Bestellung <x1> um <x2 kostet <x3>", "mangled", ("<x2",)),
    ],
)
def test_restore_failures_are_detected(translation: str, field: str, value: tuple) -> None:
    with pytest.raises(RestoreError) as info:
        restore(MASKED, translation)
    assert getattr(info.value, field) == value
    assert field in str(info.value)


def test_mangled_token_is_also_missing() -> None:
    with pytest.raises(RestoreError) as info:
        restore(MASKED, "Bestellung <x1> um <x 2> kostet <x3>")
    assert info.value.missing == (2,)


def test_partial_restore_substitutes_what_it_can() -> None:
    out = restore(MASKED, "Bestellung <x1> <x1> um <x 2> kostet <x3>", strict=False)
    assert out == "Bestellung A-12345 <x1> um <x 2> kostet 12.50"


def test_default_style_is_a_listed_style() -> None:
    assert DEFAULT_STYLE in MASK_STYLES.values()


# ----------------------------------------------------------------------------- preservation


@pytest.mark.parametrize(
    ("source", "translation", "expected"),
    [
        ("Order A-12345 at 8:30", "Bestellung A-12345 um 8:30", (2, 2)),
        ("Order A-12345 at 8:30", "Bestellung A12345 um 8.30 Uhr", (0, 2)),
        ("at 8:30 and 8:30", "um 8:30", (1, 2)),  # with multiplicity
        ("at 8:30 and 8:30", "um 8:30 und 8:30", (2, 2)),
        ("no spans here", "keine hier", (0, 0)),
        ("mail #PRS_ORG# at a@b.de", "schreib #PRS_ORG# an a@b.de", (2, 2)),
    ],
)
def test_preservation(source: str, translation: str, expected: tuple[int, int]) -> None:
    assert preservation(source, translation) == expected


@pytest.mark.parametrize(
    ("model_version", "token"),
    [
        ("gemma3-270m", "<x1>"),
        ("smollm2-135m", "[1]"),
        ("SmolLM2-135M-Instruct@B", "[1]"),
        ("my-checkpoint", "<x1>"),
    ],
)
def test_style_for_model_follows_the_measurement(model_version: str, token: str) -> None:
    assert style_for_model(model_version).token(1) == token
