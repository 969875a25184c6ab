"""`ContextEngine`: translate each turn of a conversation with the turns before it in the
prompt (issue #15, part 3; an arm option, off by default: `tolk worker --context`).

The history itself, its token budget and the growing-prefix layout are `workers/context.py`;
this wrapper puts them on the request path. It wraps every other wrapper but a drill
(`workers/engine_chain.py`, the drill must change every reply of its arm), because it acts on
the request's `conversation_id` (which the worker passes to every engine: the protocol's
`submit_translation` takes it) and because it decides which requests may see the cache:

1. `submit_translation(..., conversation_id=...)`: the turn gets its place in the order spoken
   and the conversation's history ids (`ConversationMemory.begin_turn`). No conversation id, or
   no history known here: the turn goes on as a context-free request through the wrappers it
   wraps (`inner`, the exact-match cache included: its answer is context-free, so the cache
   may answer and keep it).
2. With history, the turn is *contextual*: it bypasses the exact-match cache (the same text in
   another conversation can translate differently, so a context-free entry must not answer it
   and its answer must not become one) by going to `uncached`, the chain the cache wraps (the
   faithfulness guard and span protection still apply). Its history ids wait under its
   request id until the base engine builds the prompt: the engine's `prompt_history` hook
   (installed here) puts them between the language prefix and the query. A prompt in another
   prompt form (the faithfulness retry, under its own request id) gets no history.
3. A contextual answer that copies one of the history's turns (a translation given earlier,
   or the other speaker's words: `workers.faithful.leaked_example` with the history turns as
   the examples) while the turn is not that turn's source is the model continuing the
   conversation instead of translating: the turn runs once more without history (through
   `inner`, request id + `~nohistory`), and that answer is the reply (note
   `tolk.context.retry`, count `history_leak`). The check runs on what the wrappers inside
   gave, after their own checks and retries.
4. When the turn's translation is given (the handle resolves OK), it is recorded as history:
   its query, and the engine's own generated ids when they are the answer given (else the
   answer's text, e.g. a cache hit, or spans restored by the protection wrapper), so the next
   turn of the same target language extends this prompt and hits its KV blocks in the prefix
   cache (`workers/context.py`, "Growing prefix"). A failed, expired or cancelled turn is not
   recorded; the conversation goes on without it.

Kept warm: the history for `idle_s` after its last turn (`TOLK_CONTEXT_IDLE_S`); the KV blocks
of the conversation's prompt stay in the engine's prefix cache as long as its LRU keeps them
(unreferenced blocks are evicted least recently released first, and only when a new block is
needed), which `bench/context.py` measures; blocks are not pinned.

Counts (`counts`): `contextual` (history in the prompt), `no_history`, `no_conversation`,
`history_leak`, `recorded`.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

from workers.context import (
    DEFAULT_BUDGET_TOKENS,
    DEFAULT_IDLE_S,
    DEFAULT_LAYOUT,
    ConversationMemory,
    RecordedTurn,
    render_turn,
)
from workers.engine.types import GenerationResult, RequestHandle, TranslationEngine
from workers.engine_wrapper import EngineWrapper, merged_runs
from workers.faithful import leaked_example

__all__ = [
    "CONTEXT_NOTE",
    "NO_HISTORY_SUFFIX",
    "RETRY_NOTE",
    "ContextEngine",
    "with_conversation_context",
]

CONTEXT_NOTE = "tolk.context"  # reply metadata: "turns=N" history turns in the prompt
RETRY_NOTE = "tolk.context.retry"  # reply metadata: why the turn ran again without history
NO_HISTORY_SUFFIX = "~nohistory"  # inner request id of that run


class PromptEngine(Protocol):
    """The base engine (`workers.engine.engine.Engine`): its prompt builder and the hook that
    gives a request's prompt its history ids."""

    prompts: Any  # workers.engine.prompts.PromptBuilder
    prompt_history: Any  # Callable[[str, str | None], Sequence[int] | None] | None


class ContextEngine(EngineWrapper):
    """Conversation context on the request path (module notes)."""

    def __init__(
        self,
        inner: TranslationEngine,
        *,
        base: PromptEngine,
        memory: ConversationMemory,
        uncached: TranslationEngine | None = None,
    ) -> None:
        """`inner`: every wrapper below this one; `uncached`: the chain below the exact-match
        cache (contextual turns go there; default `inner`); `base`: the engine that builds
        the prompts, whose `prompt_history` hook this installs."""
        self.inner = inner
        self.uncached = uncached if uncached is not None else inner
        self.base = base
        self.prompts = base.prompts
        self.memory = memory
        self._lock = threading.Lock()
        self._pending: dict[str, list[int]] = {}  # request id -> its prompt's history ids
        self.counts: Counter[str] = Counter()
        self._metrics: Any = None  # the worker's, once bound: tolk_context_turns_total
        base.prompt_history = self.history_for

    def bind_metrics(self, metrics: Any) -> None:
        """Count in the worker's `tolk_context_turns_total` from now on, and pass the metrics
        on to the wrappers inside that count too."""
        self._metrics = metrics
        super().bind_metrics(metrics)  # the cached chain
        if self.uncached is not self.inner:  # and the one contextual turns take
            bind_uncached = getattr(self.uncached, "bind_metrics", None)
            if callable(bind_uncached):
                bind_uncached(metrics)

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self._metrics is not None:
            self._metrics.context_turns_total.labels(outcome=outcome).inc()

    def submit_translation(
        self,
        *,
        request_id: str,
        text: str,
        source_lang: str,
        target_lang: str,
        deadline: float | None = None,
        max_new_tokens: int | None = None,
        conversation_id: str | None = None,
    ) -> RequestHandle:
        """Queue one turn; with a known conversation history, in context (module notes)."""
        if not conversation_id:
            self._count("no_conversation")
            return self.inner.submit_translation(
                request_id=request_id,
                text=text,
                source_lang=source_lang,
                target_lang=target_lang,
                deadline=deadline,
                max_new_tokens=max_new_tokens,
            )
        start = self.memory.begin_turn(conversation_id, source_lang, target_lang)
        target = self.inner
        # the id goes inward too: harmless, every wrapper inside passes it on or ignores it
        # (the cache does not key on it), and the engine ignores it (history comes by the hook)
        if start.history_ids:
            with self._lock:
                self._pending[request_id] = start.history_ids
            target = self.uncached
        self._count("contextual" if start.turns else "no_history")

        def submit(engine: TranslationEngine, rid: str) -> RequestHandle:
            return engine.submit_translation(
                request_id=rid,
                text=text,
                source_lang=source_lang,
                target_lang=target_lang,
                deadline=deadline,
                max_new_tokens=max_new_tokens,
                conversation_id=conversation_id,
            )

        try:
            handle = submit(target, request_id)
        finally:
            with self._lock:  # the prompt is built inside submit: the ids are used or never
                self._pending.pop(request_id, None)
        seq, turns = start.seq, start.turns
        # The caller's handle resolves only once the turn is recorded: a future's waiters may
        # run before its callbacks, and the conversation's next turn must see this one.
        running = [handle]  # the run the caller's cancel reaches (the retry, once it runs)
        cancelled = threading.Event()  # the caller cancelled: no retry starts after that

        def cancel(_rid: str) -> None:
            cancelled.set()
            running[-1].cancel()

        outer = RequestHandle(request_id, cancel)

        def finish(result: GenerationResult, retry_note: str | None = None) -> None:
            try:
                self._record(conversation_id, seq, text, source_lang, target_lang, result)
                if turns and isinstance(result.notes, dict):
                    result.notes.setdefault(CONTEXT_NOTE, f"turns={turns}")
                    if retry_note:
                        result.notes[RETRY_NOTE] = retry_note
            finally:
                outer.set_result(result)

        def on_done(result: GenerationResult) -> None:  # engine thread (or now, for a hit)
            copied = self._copied_turn(text, target_lang, result, start.shown)
            if copied is None or cancelled.is_set():
                finish(result)
                return
            self._count("history_leak")
            why = f"history_leak: copied turn {copied} of {turns}; retried without history"
            try:  # under another request id, which has no pending history ids
                again = submit(self.inner, request_id + NO_HISTORY_SUFFIX)
            except Exception as exc:  # the engine is stopping: the answer we have
                finish(result, f"{why} failed: {type(exc).__name__}: {exc}")
                return
            running.append(again)
            again.add_done_callback(
                lambda second: finish(merged_runs(result, second, request_id), why)
            )
            if cancelled.is_set():  # cancel() raced with the submit above
                again.cancel()

        handle.add_done_callback(on_done)
        return outer

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

    def history_for(self, request_id: str, prompt_form: str | None) -> Sequence[int] | None:
        """The base engine's `prompt_history` hook: the history ids of a contextual request
        being built now, in the default prompt form only."""
        if prompt_form is not None and prompt_form != self.prompts.default_form:
            return None
        with self._lock:
            return self._pending.get(request_id)

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


def with_conversation_context(
    served: TranslationEngine,
    *,
    base: PromptEngine,
    uncached: TranslationEngine | None = None,
    budget_tokens: int = DEFAULT_BUDGET_TOKENS,
    idle_s: float = DEFAULT_IDLE_S,
    layout: str = DEFAULT_LAYOUT,
) -> ContextEngine:
    """`served` with conversation context (what `tolk worker --context` builds)."""
    memory = ConversationMemory(budget_tokens, idle_s=idle_s, layout=layout)
    return ContextEngine(served, base=base, memory=memory, uncached=uncached)
