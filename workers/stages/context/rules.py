"""Conversation context: the turns of a conversation so far, as prompt token ids. Pure logic:
no Kafka, no engine, no torch (issue #15, part 3; the wrapper is `workers/stages/context/stage.py`).

A contextual translation's prompt is

    language prefix (cached, shared by every request of the target language)
    + history: the conversation's earlier turns (of the same direction, by default) in the
      order spoken, each its query and the translation given, in the template's example
      layout ("English: ...\\nGerman: ...\\n\\n")
    + the new turn's query

Growing prefix
--------------
Each turn is rendered to token ids once, when it is recorded (`render_turn`), tokenized on its
own (as `PromptBuilder` tokenizes prefix and query apart), so the ids of the history never
change afterwards. A turn translated by the engine keeps the engine's own generated ids as its
answer (`answer_ids`), followed by the rest of the example's turn end. So a turn's prompt
begins with the previous turn of its chain's whole prompt *and* its generated answer, token for
token (in the `direction` layout the chain is the turns of one direction; in the `dialogue`
layout, whenever two turns have the same target language: the prefix differs per target, and
the other direction's turns appear in the chain as text), and the engine's prefix cache (full
blocks under chain hashes, partial blocks too) serves the earlier turn's KV to the later one,
which prefills only what is new.

History layout: the whole dialogue, or one direction
----------------------------------------------------
`layout="dialogue"` shows every earlier turn, both speakers, in the order spoken: the prompt
reads as a conversation, and a small model continues it (it answers the customer instead of
translating the turn: measured on BConTrasT, docs/BENCHMARKS.md "Conversation context").
`layout="direction"` (the default) shows only the earlier turns of the new turn's own direction
(source and target language), i.e. the same speaker's turns: the history reads as more
translation examples of the same person's style, names and terms, with nothing to reply to.
Each direction is a chain of its own (its own window and budget), and since all its turns
share the target's prefix every turn's prompt extends the previous one of its chain.

Token budget, with a low-water mark
-----------------------------------
The history holds at most `budget_tokens`. Cutting the oldest turn at every new turn would
change the start of every prompt, and no prompt would ever extend the previous one. So the
window's start moves only when the history outgrows the budget, and then far enough that the
history falls to `low_water_tokens` (default half the budget): between two cuts every turn's
prompt extends the previous one (`advance_window`). A single turn longer than the budget never
enters the history. The window is part of the conversation's state, so it is the same for
whichever request reads it.

Where the history lives
-----------------------
In the worker's memory (`ConversationMemory`), keyed by conversation id, expired after
`idle_s` without a turn and bounded in count (least recently used dropped first). Not in Redis:
the KV blocks that make context cheap live in this worker's engine anyway, and requests of a
conversation reach the same worker when both directions' partitions do (the client and the
replay key requests by conversation id, so a conversation's turns have the same partition
number in every language topic; the KIP-848 `range` assignor, `TOLK_GROUP_PROTOCOL=consumer`,
gives a worker the same partition numbers of every topic; the classic cooperative-sticky one
does not promise it). A turn whose history is unknown here (another worker had it, it expired,
the worker restarted) is translated without context, never refused.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from workers.context_layouts import DEFAULT_LAYOUT, LAYOUTS

__all__ = [
    "DEFAULT_LAYOUT",
    "LAYOUTS",
    "ConversationMemory",
    "RecordedTurn",
    "TurnRenderer",
    "TurnStart",
    "advance_window",
    "render_turn",
]

DEFAULT_BUDGET_TOKENS = 256
DEFAULT_IDLE_S = 600.0
DEFAULT_MAX_CONVERSATIONS = 10_000


class TurnRenderer(Protocol):
    """What `render_turn` needs of a `workers.engine.prompts.PromptBuilder`."""

    @property
    def tokenizer(self) -> object: ...

    def query_text(
        self, text: str, source_lang: str, target_lang: str, form: str | None = ...
    ) -> str: ...

    def answer_frame(self, form: str | None = ...) -> tuple[str, str] | None: ...


def render_turn(
    prompts: TurnRenderer,
    source_text: str,
    source_lang: str,
    target_lang: str,
    translation: str,
    answer_ids: Sequence[int] | None = None,
) -> list[int]:
    """One finished turn as history ids: its query (tokenized alone, as the prompt had it),
    the answer (the engine's generated ids when given, else the translation's text after the
    template's lead) and what is left of the template's turn end after the answer (the few-shot
    answer stops at its first newline, so one more "\\n" makes the example's blank line)."""
    tokenizer = prompts.tokenizer
    encode = tokenizer.encode  # type: ignore[attr-defined]
    frame = prompts.answer_frame()
    lead, end = frame if frame is not None else (" ", "\n\n")
    ids = list(
        encode(prompts.query_text(source_text, source_lang, target_lang), add_special_tokens=False)
    )
    if answer_ids:
        answer = list(answer_ids)
        shown = tokenizer.decode(answer)  # type: ignore[attr-defined]
    else:
        answer = list(encode(lead + translation, add_special_tokens=False))
        shown = lead + translation
    rest = end
    for k in range(len(end), 0, -1):  # the longest part of `end` the answer already ends with
        if shown.endswith(end[:k]):
            rest = end[k:]
            break
    return [*ids, *answer, *(encode(rest, add_special_tokens=False) if rest else [])]


def advance_window(lengths: Sequence[int], start: int, budget: int, low_water: int) -> int:
    """The history window's new start after a turn was appended: unchanged while the turns
    `lengths[start:]` fit in `budget`; else moved forward until they fit in `low_water`."""
    if budget <= 0:
        return len(lengths)
    total = sum(lengths[start:])
    if total <= budget:
        return start
    while start < len(lengths) and total > low_water:
        total -= lengths[start]
        start += 1
    return start


@dataclass(frozen=True, slots=True)
class RecordedTurn:
    """One turn of a conversation as its later turns show it."""

    seq: int  # order spoken (the order the worker received the turns)
    source_lang: str
    target_lang: str
    source_text: str
    translation: str
    ids: tuple[int, ...]  # render_turn's ids


@dataclass(frozen=True, slots=True)
class TurnStart:
    """What `ConversationMemory.begin_turn` gives a new turn."""

    seq: int  # its place in the order spoken
    history_ids: list[int]  # the history its prompt shows, between prefix and query
    turns: int  # how many earlier turns that is
    shown: tuple[RecordedTurn, ...] = ()  # those turns


@dataclass(slots=True)
class _Chain:
    """The turns one prompt chain shows (the whole dialogue, or one direction of it)."""

    turns: list[RecordedTurn] = field(default_factory=list)
    start: int = 0  # the window: turns[start:] are the history


@dataclass(slots=True)
class _Conversation:
    chains: dict[str, _Chain] = field(default_factory=dict)
    next_seq: int = 0  # the seq the next received turn gets
    last_used: float = 0.0


class ConversationMemory:
    """Conversation id -> its recorded turns and history windows; thread-safe (the poll thread
    reads, the engine's done-callbacks record). Idle conversations expire after `idle_s`; at
    most `max_conversations` are kept (the least recently used go first). `layout`: which
    earlier turns a turn's prompt shows (module notes, "History layout")."""

    def __init__(
        self,
        budget_tokens: int = DEFAULT_BUDGET_TOKENS,
        *,
        low_water_tokens: int | None = None,
        idle_s: float = DEFAULT_IDLE_S,
        max_conversations: int = DEFAULT_MAX_CONVERSATIONS,
        layout: str = DEFAULT_LAYOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r}: expected one of {', '.join(LAYOUTS)}")
        if budget_tokens < 0 or idle_s <= 0 or max_conversations < 1:
            raise ValueError(
                f"budget_tokens={budget_tokens} (>= 0), idle_s={idle_s} (> 0), "
                f"max_conversations={max_conversations} (>= 1)"
            )
        self.budget_tokens = budget_tokens
        self.low_water_tokens = (
            budget_tokens // 2 if low_water_tokens is None else min(low_water_tokens, budget_tokens)
        )
        self.idle_s = idle_s
        self.max_conversations = max_conversations
        self.layout = layout
        self._clock = clock
        self._lock = threading.Lock()
        self._conversations: OrderedDict[str, _Conversation] = OrderedDict()
        self.expired = 0  # conversations dropped for idleness or for room

    def _live(self, conversation_id: str, now: float) -> _Conversation | None:
        conv = self._conversations.get(conversation_id)
        if conv is not None and now - conv.last_used > self.idle_s:
            del self._conversations[conversation_id]
            self.expired += 1
            return None
        return conv

    def _chain_key(self, source_lang: str, target_lang: str) -> str:
        return f"{source_lang}>{target_lang}" if self.layout == "direction" else ""

    def begin_turn(self, conversation_id: str, source_lang: str, target_lang: str) -> TurnStart:
        """A new turn (of that direction) arrives: its place in the order spoken and the
        history its prompt shows (none for an unknown or expired conversation)."""
        now = self._clock()
        with self._lock:
            conv = self._live(conversation_id, now)
            if conv is None:
                conv = self._conversations[conversation_id] = _Conversation(last_used=now)
                self._make_room()
            conv.last_used = now
            self._conversations.move_to_end(conversation_id)
            seq = conv.next_seq
            conv.next_seq += 1
            chain = conv.chains.get(self._chain_key(source_lang, target_lang))
            shown = chain.turns[chain.start :] if chain is not None else []
            ids = [t for turn in shown for t in turn.ids]
            return TurnStart(seq, ids, len(shown), tuple(shown))

    def record(self, conversation_id: str, turn: RecordedTurn) -> None:
        """A turn's translation was given: append it to its chain in spoken order and move
        that chain's window."""
        now = self._clock()
        with self._lock:
            conv = self._live(conversation_id, now)
            if conv is None:
                conv = self._conversations[conversation_id] = _Conversation(last_used=now)
                conv.next_seq = turn.seq + 1
                self._make_room()
            conv.last_used = now
            self._conversations.move_to_end(conversation_id)
            key = self._chain_key(turn.source_lang, turn.target_lang)
            chain = conv.chains.setdefault(key, _Chain())
            at = len(chain.turns)
            while at > 0 and chain.turns[at - 1].seq > turn.seq:  # finished out of order
                at -= 1
            chain.turns.insert(at, turn)
            lengths = [len(t.ids) for t in chain.turns]
            chain.start = advance_window(
                lengths, min(chain.start, at), self.budget_tokens, self.low_water_tokens
            )
            del chain.turns[: chain.start]  # older turns are never shown again
            chain.start = 0

    def history(
        self, conversation_id: str, source_lang: str, target_lang: str
    ) -> list[RecordedTurn]:
        """The turns the conversation's next prompt of that direction shows (a copy)."""
        with self._lock:
            conv = self._live(conversation_id, self._clock())
            chain = (
                None if conv is None else conv.chains.get(self._chain_key(source_lang, target_lang))
            )
            return [] if chain is None else list(chain.turns[chain.start :])

    def _make_room(self) -> None:
        now = self._clock()
        while self._conversations:
            oldest_id, oldest = next(iter(self._conversations.items()))
            idle = now - oldest.last_used > self.idle_s
            if not idle and len(self._conversations) <= self.max_conversations:
                break
            del self._conversations[oldest_id]
            self.expired += 1

    def __len__(self) -> int:
        return len(self._conversations)
