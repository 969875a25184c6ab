"""Speculative decoding's proposer side: draft tokens that the target model checks in one step.

A translation copies much of its source: names, numbers, codes, placeholders, and in a chat
turn whole phrases the prompt's examples or the conversation already hold. The n-gram
proposer (prompt lookup, as vLLM's `ngram` method and llama.cpp's lookup decoding) drafts those
for free: it finds the sequence's last `n` tokens (n = `max_ngram` down to `min_ngram`) earlier
in the same sequence (prompt and output so far; the most recent match) and proposes the tokens
that followed them there.

The check is the scheduler's and the model step's (workers/engine/scheduler.py,
workers/engine/forward.py): the chunk computes the last token and the drafts in one forward;
the target's greedy token after each row is compared with the draft in its place; the agreeing
drafts plus the target's own next token are kept. So greedy output is the target's own, token
for token; the drafts only decide how many tokens one forward yields. Sampled requests
(temperature > 0) get no drafts.

Exactly the target's own where each checked row is computed as a decode row is: through the
compiled graph (`compile_decode`, the worker's usual configuration), every row runs the
per-row decode attention op and the row-invariant int8 / int4 projections, so a draft check
and a decode step give the same bits (bench/speculative.py: no token changed). The drafter
therefore keeps a step's rows within the graph's `compile_max_rows`. An eager check runs the
prefill attention, whose float rounding differs: a near-tie may then flip (2 of 52 requests on
Qwen2.5-Coder-0.5B, docs/BENCHMARKS.md), as the plain engine's own tokens already move with its
batch's composition under load (cascade attention, mixed steps).

Draft length adapts per sequence (`DraftLength`): all of a step's drafts accepted doubles the
next ask (up to `max_draft`), otherwise the next ask is one more than what was accepted, so a
sequence whose text the proposer cannot predict costs at most one extra row a step. On a CPU a
decode step is bound by reading the weights, so a few extra rows cost little beside them
(docs/BENCHMARKS.md has the measured acceptance and speed).

Pure Python, no torch: the engine calls `Drafter.propose` on its running sequences after each
step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from workers.engine.scheduler import SequenceState

__all__ = ["DRAFTERS", "DraftLength", "Drafter", "NgramProposer", "Proposer", "make_drafter"]


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens likely to follow `token_ids` (prompt and output so far)."""
        ...


DRAFTERS = ("ngram",)  # `EngineConfig.draft` / `tolk worker --draft`


@dataclass(frozen=True, slots=True)
class NgramProposer:
    """Prompt lookup: the tokens that followed the sequence's last n-gram where it last
    occurred before (n from `max_ngram` down to `min_ngram`)."""

    max_ngram: int = 3
    min_ngram: int = 1
    window: int = 4096  # tokens searched back from the end (a bound on the work per step)

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` draft tokens to follow `token_ids`; [] when no n-gram recurs."""
        end = len(token_ids)
        lo = max(0, end - self.window)
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            suffix = list(token_ids[end - n :])
            last = suffix[-1]
            # the most recent earlier occurrence: its last token at i (i < end - 1)
            for i in range(end - 2, lo + n - 2, -1):
                if token_ids[i] == last and list(token_ids[i - n + 1 : i + 1]) == suffix:
                    return list(token_ids[i + 1 : min(i + 1 + k, end)])
        return []


@dataclass(frozen=True, slots=True)
class DraftLength:
    """How many drafts a sequence asks for next, from how its last drafts fared."""

    initial: int = 4
    max_draft: int = 8

    def next(self, current: int, drafted: int, accepted: int) -> int:
        if current <= 0:
            return min(self.initial, self.max_draft)
        if drafted and accepted == drafted:  # all taken: ask for more
            return min(2 * current, self.max_draft)
        if drafted:
            return max(1, min(accepted + 1, self.max_draft))
        return current  # nothing was drafted (no match): keep the ask


class Drafter:
    """Gives each decoding, greedy sequence its drafts for the next step."""

    def __init__(
        self,
        proposer: Proposer,
        length: DraftLength,
        max_model_len: int = 2048,
        max_rows: int | None = None,
    ) -> None:
        """`max_rows`: rows a step may have (each running sequence 1, plus its drafts) to stay
        in the compiled graph, where a draft's row is computed exactly as a decode row (module
        notes); drafts beyond it are not asked for. None: no bound (an eager engine)."""
        self.proposer = proposer
        self.length = length
        self.max_model_len = max_model_len
        self.max_rows = max_rows
        self._last: dict[str, tuple[int, int]] = {}  # request id -> (drafted, accepted) seen

    def propose(self, running: Iterable[SequenceState]) -> int:
        """Set `draft_ids` of every running sequence that decodes greedily; returns how many
        draft tokens were proposed."""
        running = list(running)
        rows_left = None if self.max_rows is None else self.max_rows - len(running)
        proposed = 0
        live: dict[str, tuple[int, int]] = {}
        for seq in running:
            params = seq.request.params
            seq.draft_ids = []
            if params.temperature > 0 or params.logprobs or seq.num_remaining != 1:
                continue  # sampled, keeping log-probabilities, or still in prefill
            before = self._last.get(seq.request_id, (0, 0))
            seq.draft_len = self.length.next(
                seq.draft_len, seq.num_drafted - before[0], seq.num_accepted - before[1]
            )
            live[seq.request_id] = (seq.num_drafted, seq.num_accepted)
            # no draft past the output cap (the last token there is the target's own) or the
            # sequence's length limit
            room = min(
                params.max_new_tokens - len(seq.output_ids) - 1,
                self.max_model_len - len(seq.token_ids) - 1,
            )
            k = min(seq.draft_len, room, rows_left if rows_left is not None else room)
            seq.draft_ids = self.proposer.propose(seq.token_ids, k) if k > 0 else []
            proposed += len(seq.draft_ids)
            if rows_left is not None:
                rows_left -= len(seq.draft_ids)
        self._last = live
        return proposed


def make_drafter(
    name: str | None, max_draft: int, max_model_len: int = 2048, max_rows: int | None = None
) -> Drafter | None:
    """The drafter `EngineConfig.draft` names (None: no speculation); see `Drafter`."""
    if name is None:
        return None
    if name == "ngram":
        length = DraftLength(min(4, max_draft), max_draft)
        return Drafter(NgramProposer(), length, max_model_len, max_rows)
    raise ValueError(f"unknown draft method {name!r} (known: {', '.join(DRAFTERS)})")
