"""The normalized records of the replay logs, and the row checks every reader shares.

`replay/logs.py` (three formats) and `replay/logs_xsid.py` (xSID) turn their formats into
these; a row they cannot use becomes a `Problem` (where, why) instead of an error.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

__all__ = [
    "KNOWN_LANGUAGES",
    "LogContents",
    "LogItem",
    "Problem",
    "ReplayRecord",
    "RowChecker",
    "language_problem",
    "text_problem",
]

# The languages the service knows (the workers' default set); a row in another is a problem.
KNOWN_LANGUAGES: frozenset[str] = frozenset({"en", "de", "fr", "es", "it"})
REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True, slots=True)
class ReplayRecord:
    """One turn of a logged conversation, normalized."""

    conversation_id: str
    turn: int  # position in the conversation (the order replay keeps)
    source_lang: str
    target_lang: str
    text: str  # what to translate
    reference: str | None = None  # a human translation, when the log has one
    intent: str | None = None  # an intent label (xSID-style), when the log has one
    timestamp_ms: int | None = None  # when it was said (epoch ms), when the log says
    sender: str | None = None  # "customer", "agent", ...
    row: str = ""  # where it came from: "file:line" or "file:conversation/turn"


@dataclass(frozen=True, slots=True)
class Problem:
    """A log row that was skipped, and why."""

    row: str
    reason: str


@dataclass(slots=True)
class LogContents:
    """Everything one reader produced: the usable records and the skipped rows."""

    records: list[ReplayRecord] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


LogItem = ReplayRecord | Problem


def text_problem(text: str) -> str | None:
    """Why a text cannot be replayed (empty, damaged encoding), or None."""
    if not text.strip():
        return "empty text"
    if REPLACEMENT_CHAR in text:
        return "bad encoding: U+FFFD replacement characters in the text"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "bad encoding: unpaired surrogates in the text"
    return None


def language_problem(source: str, target: str, known: Collection[str]) -> str | None:
    for what, lang in (("source", source), ("target", target)):
        if lang not in known:
            return f"unknown {what} language {lang!r} (known: {', '.join(sorted(known))})"
    if source == target:
        return f"source and target language are both {source!r}"
    return None


class RowChecker:
    """Shared row checks: languages, text, duplicate (conversation, turn) pairs."""

    def __init__(self, known: Collection[str]) -> None:
        self.known = frozenset(known)
        self.seen: set[tuple[str, int]] = set()

    def check(self, record: ReplayRecord) -> LogItem:
        reason = language_problem(record.source_lang, record.target_lang, self.known)
        reason = reason or text_problem(record.text)
        if reason is None and (record.conversation_id, record.turn) in self.seen:
            reason = f"duplicate turn {record.turn} of conversation {record.conversation_id!r}"
        if reason is not None:
            return Problem(record.row, reason)
        self.seen.add((record.conversation_id, record.turn))
        return record
