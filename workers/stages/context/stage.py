"""`ContextEngine`: translate each turn of a conversation with the turns before it in the
prompt (issue #15, part 3; an arm option, off by default: `tolk worker --context`).

The history itself, its token budget and the growing-prefix layout are
`workers/stages/context/rules.py`;
this stage puts them on the request path. It wraps every other stage but a drill
(`workers/serving/pipeline.py`, the drill must change every reply of its arm), because it acts
on the request's `conversation_id` (a field of the `TranslationRequest` every stage passes on)
and because it decides which requests may see the cache:

1. `submit_translation(request)` with a `conversation_id`: the turn gets its place in the
   order spoken and the conversation's history ids (`ConversationMemory.begin_turn`). No
   conversation id, or no history known here: the turn goes on as a context-free request
   through the stages it wraps (`inner`, the exact-match cache included: its answer is
   context-free, so the cache may answer and keep it).
2. With history, the turn is *contextual*: it bypasses the exact-match cache (the same text in
   another conversation can translate differently, so a context-free entry must not answer it
   and its answer must not become one) by going to `uncached`, the chain the cache wraps (the
   faithfulness guard and span protection still apply). Its history ids go down in the
   request's `history` field, which the engine puts between the language prefix and the
   query. A stage's rerun (the faithfulness retry in its other prompt form, the unmasked
   retry) goes without them (`workers.stages.retry.RetryJob.rerun`).
3. A contextual answer that copies one of the history's turns (a translation given earlier,
   or the other speaker's words: `workers.stages.faithful.rules.leaked_example` with the history
   turns as
   the examples) while the turn is not that turn's source is the model continuing the
   conversation instead of translating: the turn runs once more without history (through
   `inner`, request id + `~nohistory`, a `RetryJob` rerun), and that answer is the reply (note
   `tolk.context.retry`, count `history_leak`). The check runs on what the stages inside
   gave, after their own checks and retries.
4. When the turn's translation is given (the handle resolves OK), it is recorded as history:
   its query, and the engine's own generated ids when they are the answer given (else the
   answer's text, e.g. a cache hit, or spans restored by the protection stage), so the next
   turn of the same target language extends this prompt and hits its KV blocks in the prefix
   cache (`workers/stages/context/rules.py`, "Growing prefix"). A failed, expired or cancelled turn
   is not
   recorded; the conversation goes on without it.

Kept warm: the history for `idle_s` after its last turn (`TOLK_CONTEXT_IDLE_S`); the KV blocks
of the conversation's prompt stay in the engine's prefix cache as long as its LRU keeps them
(unreferenced blocks are evicted least recently released first, and only when a new block is
needed), which `bench/context.py` measures; blocks are not pinned.

Counts (`counts`): `contextual` (history in the prompt), `no_history`, `no_conversation`,
`history_leak`, `recorded`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any

from workers import reply_metadata as meta
from workers.engine.types import (
    GenerationResult,
    RequestHandle,
    TranslationEngine,
    TranslationRequest,
)
from workers.stages.context.rules import (
    ConversationMemory,
    RecordedTurn,
    render_turn,
)
from workers.stages.faithful.rules import leaked_example
from workers.stages.retry import RetryJob
from workers.stages.wrapper import EngineWrapper, merged_runs

__all__ = [
    "CONTEXT_NOTE",
    "NO_HISTORY_SUFFIX",
    "RETRY_NOTE",
    "ContextEngine",
]

CONTEXT_NOTE = meta.CONTEXT  # the reply metadata keys of this stage (workers/reply_metadata.py)
RETRY_NOTE = meta.CONTEXT_RETRY
NO_HISTORY_SUFFIX = "~nohistory"  # inner request id of that run


class ContextEngine(EngineWrapper):
    """Conversation context on the request path (module notes)."""

    def __init__(
        self,
        inner: TranslationEngine,
        *,
        prompts: Any,
        memory: ConversationMemory,
        uncached: TranslationEngine | None = None,
    ) -> None:
        """`inner`: every stage below this one; `uncached`: the stages below the exact-match
        cache (contextual turns go there; default `inner`); `prompts`: the engine's prompt
        builder (`workers.engine.prompts.PromptBuilder`: its tokenizer renders a turn)."""
        self.inner = inner
        self.uncached = uncached if uncached is not None else inner
        self.prompts = prompts
        self.memory = memory
        self.counts: Counter[str] = Counter()
        self._metrics: Any = None  # the worker's, once bound: tolk_context_turns_total

    def bind_metrics(self, metrics: Any) -> None:
        """Count in the worker's `tolk_context_turns_total` from now on."""
        self._metrics = metrics

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self._metrics is not None:
            self._metrics.context_turns_total.labels(outcome=outcome).inc()

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        """Queue one turn; with a known conversation history, in context (module notes)."""
        conversation_id = request.conversation_id
        if not conversation_id:
            self._count("no_conversation")
            return self.inner.submit_translation(request)
        r = request
        start = self.memory.begin_turn(conversation_id, r.source_lang, r.target_lang)
        target, first = self.inner, request
        if start.history_ids:  # the history goes between the prefix and the query
            target = self.uncached
            first = dataclasses.replace(request, history=tuple(start.history_ids))
        self._count("contextual" if start.turns else "no_history")
        # The caller's handle resolves only once the turn is recorded: a future's waiters may
        # run before its callbacks, and the conversation's next turn must see this one.
        job = RetryJob(request)

        def finish(result: GenerationResult, retry_note: str | None = None) -> None:
            try:
                self._record(
                    conversation_id, start.seq, r.text, r.source_lang, r.target_lang, result
                )
                if start.turns and isinstance(result.notes, dict):
                    result.notes.setdefault(CONTEXT_NOTE, f"turns={start.turns}")
                    if retry_note:
                        result.notes[RETRY_NOTE] = retry_note
            finally:
                job.resolve(result)

        def on_done(result: GenerationResult) -> None:  # engine thread (or now, for a hit)
            copied = self._copied_turn(r.text, r.target_lang, result, start.shown)
            if copied is None or job.cancelled:
                finish(result)
                return
            self._count("history_leak")
            why = f"history_leak: copied turn {copied} of {start.turns}; retried without history"
            try:  # through everything inside, the cache included, without the history
                job.rerun(
                    self.inner,
                    NO_HISTORY_SUFFIX,
                    lambda second: finish(_rerun(merged_runs(result, second, r.request_id)), why),
                )
            except Exception as exc:  # the engine is stopping: the answer we have
                finish(result, f"{why} failed: {type(exc).__name__}: {exc}")

        job.run(target, on_done, first)
        return job.handle

    @staticmethod
    def _copied_turn(
        text: str, target_lang: str, result: GenerationResult, shown: Sequence[RecordedTurn]
    ) -> int | None:
        """1-based index of the history turn the answer copies (module notes, 3), or None."""
        if not shown or not result.ok or not result.text:
            return None
        turns = [{t.source_lang: t.source_text, t.target_lang: t.translation} for t in shown]
        at = leaked_example(text, result.text, turns, target_lang)
        return None if at is None else at + 1

    def _record(
        self,
        conversation_id: str,
        seq: int,
        text: str,
        source_lang: str,
        target_lang: str,
        result: GenerationResult,
    ) -> None:
        if not result.ok or not result.text:
            return
        ids = render_turn(
            self.prompts, text, source_lang, target_lang, result.text, self._answer_ids(result)
        )
        turn = RecordedTurn(seq, source_lang, target_lang, text, result.text, tuple(ids))
        self.memory.record(conversation_id, turn)
        self._count("recorded")

    def _answer_ids(self, result: GenerationResult) -> list[int] | None:
        """The engine's generated ids when they are the answer given (decoded and cut by the
        stop rule they give the result's text), else None (render the text instead)."""
        if not result.token_ids:
            return None
        tokenizer = self.prompts.tokenizer
        shown = self.prompts.finish_text(
            tokenizer.decode(result.token_ids, skip_special_tokens=True)
        )
        return list(result.token_ids) if shown == result.text else None


def _rerun(merged: GenerationResult) -> GenerationResult:
    """The answer of the run without history, counted as a rerun (never cached)."""
    return dataclasses.replace(merged, retries=merged.retries + 1)
