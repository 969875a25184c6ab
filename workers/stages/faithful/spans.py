"""Dropped spans: placeholders, links, e-mail addresses and ids of the source that its
translation lost. A pure function.

A customer-service turn carries text that a translation must copy, not translate: the
anonymisation placeholders of the logs and the templates of a bot (`#NAME#`, `#PRS_ORG#`,
`{{first_name}}`, `%s`), links, e-mail addresses and order or ticket ids. A small model drops
them or rewrites the rest around them ("Hi #NAME#, thanks for contacting #PRS_ORG#." -> "Hallo,
#NAME#, ich freue mich auf dich!", issue #28). `dropped_spans(source, translation)` returns the
spans of the source (`workers.text.spans.find_spans`, the same patterns the
protected-spans stage masks) of those kinds that the translation does not hold:

- placeholders and ids must come back exactly (a `{{ name }}` may lose or gain inner spaces);
- links and e-mail addresses are compared without case and without a trailing `/`;
- numbers are not this check's: `numbers.py` allows their reformatting ("15,00 €" for "€15").

Each distinct span counts once (a translation may say a repeated name once). The result is the
dropped spans as written in the source, in order; empty when none is. No model, no Kafka: the
faithfulness stage (`rules.check`) and the benchmarks share it.
"""

from __future__ import annotations

import re

from workers.text.spans import find_spans

__all__ = ["KEPT_KINDS", "dropped_spans"]

KEPT_KINDS = ("placeholder", "url", "email", "order_id")  # what a translation copies verbatim
_INNER_SPACE = re.compile(r"(?<=\{)\s+|\s+(?=\})")


def _form(kind: str, text: str) -> str:
    """The form two spans are compared in."""
    if kind in ("url", "email"):
        return text.lower().rstrip("/")
    if kind == "placeholder":
        return _INNER_SPACE.sub("", text)
    return text


def dropped_spans(source: str, translation: str) -> tuple[str, ...]:
    """The placeholders, links, e-mail addresses and ids of `source` missing from
    `translation` (see the module docstring)."""
    wanted = [s for s in find_spans(source) if s.kind in KEPT_KINDS]
    if not wanted:
        return ()
    kept = {(s.kind, _form(s.kind, s.text)) for s in find_spans(translation)}
    lowered = translation.lower()
    dropped: list[str] = []
    for span in wanted:
        form = _form(span.kind, span.text)
        if (span.kind, form) in kept or span.text in dropped:
            continue
        # a link glued to a word the patterns read otherwise ("(www.x.de)") still counts as kept
        if span.kind in ("url", "email") and form in lowered:
            continue
        dropped.append(span.text)
    return tuple(dropped)
