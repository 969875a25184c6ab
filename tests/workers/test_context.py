"""Conversation context (workers/stages/context/rules.py, workers/stages/context/stage.py): the
history window and
its budget, the order spoken, idle expiry, the growing-prefix property of the prompts on the
real Gemma 3 tokenizer, and the exact-match cache never answering a contextual turn.

The real engine's prefix-cache hit for turn k+1 is in test_context_real_engine.py (slow).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from tests.workers.fakes import FakeEngine, fake_translation
from workers.engine.prompts import PromptBuilder
from workers.engine.types import FinishReason, GenerationResult, RequestHandle, TranslationRequest
from workers.serving.pipeline import ServingOptions, build_served_engine
from workers.settings import Settings
from workers.stages.cache.redis_l2 import InMemoryTranslationCache
from workers.stages.context.rules import (
    ConversationMemory,
    RecordedTurn,
    advance_window,
    render_turn,
)
from workers.stages.context.stage import CONTEXT_NOTE, NO_HISTORY_SUFFIX, RETRY_NOTE, ContextEngine

# -- the window -----------------------------------------------------------------------------


def test_window_stays_put_while_the_history_fits_the_budget() -> None:
    assert advance_window([30, 40, 50], 0, budget=120, low_water=60) == 0
    assert advance_window([30, 40, 50], 1, budget=120, low_water=60) == 1


def test_window_over_budget_drops_oldest_turns_down_to_the_low_water_mark() -> None:
    # 30+40+50+60 = 180 > 150: drop 30 (150), 40 (110), 50 (60 <= 60) -> start 3
    assert advance_window([30, 40, 50, 60], 0, budget=150, low_water=60) == 3
    # with the low water at the budget only the oldest goes
    assert advance_window([30, 40, 50, 60], 0, budget=150, low_water=150) == 1


def test_a_turn_longer_than_the_budget_never_enters_the_history() -> None:
    assert advance_window([10, 500], 0, budget=100, low_water=50) == 2
    assert advance_window([10], 0, budget=0, low_water=0) == 1


# -- the memory -----------------------------------------------------------------------------


DE_EN = ("de", "en")
EN_DE = ("en", "de")


def _turn(seq: int, n: int, text: str = "", direction: tuple[str, str] = DE_EN) -> RecordedTurn:
    return RecordedTurn(seq, *direction, text or f"t{seq}", f"a{seq}", tuple([seq] * n))


def test_history_is_in_the_order_spoken_even_when_turns_finish_out_of_order() -> None:
    memory = ConversationMemory(1000)
    seqs = [memory.begin_turn("c", *DE_EN).seq for _ in range(3)]
    assert seqs == [0, 1, 2]
    memory.record("c", _turn(2, 1))
    memory.record("c", _turn(0, 1))
    memory.record("c", _turn(1, 1))
    assert [t.seq for t in memory.history("c", *DE_EN)] == [0, 1, 2]
    start = memory.begin_turn("c", *DE_EN)
    assert start.seq == 3 and start.turns == 3 and start.history_ids == [0, 1, 2]


def test_history_budget_cuts_to_low_water_then_grows_again_as_a_prefix() -> None:
    memory = ConversationMemory(100, low_water_tokens=50)
    shown: list[list[int]] = []
    for _ in range(6):
        start = memory.begin_turn("c", *DE_EN)
        shown.append(start.history_ids)
        memory.record("c", _turn(start.seq, 30))
    lengths = [len(ids) for ids in shown]
    assert lengths == [0, 30, 60, 90, 30, 60]  # 4 turns = 120 > 100: cut to 30 <= 50
    assert all(len(ids) <= 100 for ids in shown)
    # between cuts each prompt's history extends the previous one (the growing prefix)
    for before, after in ((shown[1], shown[2]), (shown[2], shown[3]), (shown[4], shown[5])):
        assert after[: len(before)] == before
    assert shown[4] == [3] * 30  # after the cut: the newest turn only


def test_unknown_and_idle_conversations_have_no_history() -> None:
    now = [0.0]
    memory = ConversationMemory(100, idle_s=60, clock=lambda: now[0])
    assert memory.begin_turn("new", *DE_EN).history_ids == []
    memory.record("c", _turn(0, 5))
    now[0] = 59.0
    assert memory.begin_turn("c", *DE_EN).turns == 1  # touched at 59
    now[0] = 59.0 + 61.0
    start = memory.begin_turn("c", *DE_EN)
    assert start.turns == 0 and start.history_ids == [] and memory.expired >= 1


def test_at_most_max_conversations_least_recently_used_dropped_first() -> None:
    memory = ConversationMemory(100, max_conversations=2)
    for cid in ("a", "b"):
        memory.record(cid, _turn(0, 3))
    memory.begin_turn("a", *DE_EN)  # a is now the most recent
    memory.record("c", _turn(0, 3))
    assert memory.history("b", *DE_EN) == []
    assert len(memory.history("a", *DE_EN)) == 1 and len(memory.history("c", *DE_EN)) == 1


def _bilingual_chat(memory: ConversationMemory) -> list[list[int]]:
    """Six turns alternating customer (de->en) and agent (en->de); each turn's history ids."""
    shown = []
    for k in range(6):
        direction = DE_EN if k % 2 == 0 else EN_DE
        start = memory.begin_turn("c", *direction)
        shown.append(start.history_ids)
        memory.record("c", _turn(start.seq, 2, direction=direction))
    return shown


def test_direction_layout_shows_only_the_same_speakers_earlier_turns() -> None:
    memory = ConversationMemory(1000)  # the default layout
    assert memory.layout == "direction"
    shown = _bilingual_chat(memory)
    # customer turns 0, 2, 4 see the customer's earlier turns; agent turns 1, 3, 5 the agent's
    assert shown == [[], [], [0, 0], [1, 1], [0, 0, 2, 2], [1, 1, 3, 3]]
    assert [t.seq for t in memory.history("c", *EN_DE)] == [1, 3, 5]
    # each direction's prompts extend the previous one of that direction (the growing prefix)
    assert shown[4][: len(shown[2])] == shown[2] and shown[5][: len(shown[3])] == shown[3]


def test_dialogue_layout_shows_both_speakers_in_the_order_spoken() -> None:
    shown = _bilingual_chat(ConversationMemory(1000, layout="dialogue"))
    assert shown[5] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert shown[3] == [0, 0, 1, 1, 2, 2]


def test_each_direction_keeps_its_own_budget_window() -> None:
    memory = ConversationMemory(100, low_water_tokens=50)
    for _ in range(4):  # four customer turns of 30: the fourth cuts the customer chain
        memory.record("c", _turn(memory.begin_turn("c", *DE_EN).seq, 30))
    memory.record("c", _turn(memory.begin_turn("c", *EN_DE).seq, 30, direction=EN_DE))
    assert [t.seq for t in memory.history("c", *DE_EN)] == [3]
    assert [t.seq for t in memory.history("c", *EN_DE)] == [4]


def test_unknown_layout_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="direction, dialogue"):
        ConversationMemory(100, layout="glossary")


def test_layout_setting_is_read_once_from_the_environment() -> None:
    from workers.settings import Settings

    assert Settings.from_env({}).context_layout == "direction"
    assert Settings.from_env({"TOLK_CONTEXT_LAYOUT": "dialogue"}).context_layout == "dialogue"
    with pytest.raises(ValueError, match="context_layout must be one of direction, dialogue"):
        Settings.from_env({"TOLK_CONTEXT_LAYOUT": "both"})


# -- prompts on the real tokenizer ------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_prompts() -> PromptBuilder:
    from transformers import AutoTokenizer

    from workers.engine.loader import checkpoint_dir

    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir("gemma3-270m"))
    return PromptBuilder(tokenizer, "gemma3", tokenizer.bos_token_id, {tokenizer.eos_token_id})


class PromptEngine:
    """A base engine that builds prompts as `Engine.translation_request` does (prefix,
    the request's history ids, query) and answers with fixed "generated" ids."""

    model_version = "prompt-only"
    languages = ("en", "de")

    def __init__(self, prompts: PromptBuilder, answers: dict[str, str]) -> None:
        self.prompts = prompts
        self.answers = answers
        self.built: dict[str, list[int]] = {}
        self.generated: dict[str, list[int]] = {}

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        request_id, text = request.request_id, request.text
        ids, prefix_len = self.prompts.build(text, request.source_lang, request.target_lang)
        ids[prefix_len:prefix_len] = request.history
        self.built[request_id] = ids
        answer = self.answers[text]
        # what Gemma generates: the answer after the template's space, then a newline token
        generated = self.prompts.tokenizer.encode(" " + answer + "\n", add_special_tokens=False)
        self.generated[request_id] = generated
        handle = RequestHandle(request_id, lambda _rid: None)
        handle.set_result(
            GenerationResult(request_id, generated, answer, FinishReason.STOP, len(ids))
        )
        return handle

    def count_tokens(self, text: str) -> int:
        return len(self.prompts.tokenizer.encode(text, add_special_tokens=False))


DIALOGUE = [  # (source, source lang, target lang, answer): customer de->en, agent en->de
    ("Hallo, ich suche ein Restaurant.", "de", "en", "Hello, I am looking for a restaurant."),
    ("What kind of food do you like?", "en", "de", "Welche Art von Essen mögen Sie?"),
    ("Etwas Günstiges, bitte.", "de", "en", "Something cheap, please."),
    ("I found two places for you.", "en", "de", "Ich habe zwei Lokale für Sie gefunden."),
    ("Ist das erste vegetarisch?", "de", "en", "Is the first one vegetarian?"),
]


def _converse(
    prompts: PromptBuilder, budget: int = 1000, layout: str = "direction"
) -> tuple[PromptEngine, list[str]]:
    base = PromptEngine(prompts, {src: answer for src, _, _, answer in DIALOGUE})
    memory = ConversationMemory(budget, layout=layout)
    ctx = ContextEngine(base, prompts=base.prompts, memory=memory)  # type: ignore[arg-type]
    rids = []
    for k, (src, s, t, _) in enumerate(DIALOGUE):
        rid = f"r{k}"
        ctx.submit_translation(
            TranslationRequest(
                request_id=rid, text=src, source_lang=s, target_lang=t, conversation_id="conv-1"
            )
        )
        rids.append(rid)
    return base, rids


def _starts_with(ids: Sequence[int], prefix: Sequence[int]) -> bool:
    return list(ids[: len(prefix)]) == list(prefix)


@pytest.mark.parametrize("layout", ["direction", "dialogue"])
def test_next_turn_of_a_target_starts_with_the_previous_prompt_and_its_generated_answer(
    gemma_prompts: PromptBuilder, layout: str
) -> None:
    base, rids = _converse(gemma_prompts, layout=layout)
    # turns 0, 2, 4 are de->en (prefix of English), 1, 3 en->de: each chain grows
    for earlier, later in ((0, 2), (2, 4), (1, 3)):
        before = base.built[rids[earlier]] + base.generated[rids[earlier]]
        assert _starts_with(base.built[rids[later]], before), (earlier, later)
    text = gemma_prompts.tokenizer.decode(base.built[rids[4]])
    assert text.endswith("German: Ist das erste vegetarisch?\nEnglish:")
    assert "German: Etwas Günstiges, bitte.\nEnglish: Something cheap, please.\n\n" in text
    agent_turn = "English: What kind of food do you like?\nGerman: Welche Art von Essen mögen Sie?"
    if layout == "dialogue":  # both speakers in the order spoken: turn 1 between turns 0 and 2
        order = [text.index(src) for src, *_ in DIALOGUE]
        assert order == sorted(order)
        assert agent_turn + "\n\n" in text
    else:  # the customer's own earlier turns only: nothing the agent said to answer
        assert text.index(DIALOGUE[0][0]) < text.index(DIALOGUE[2][0])
        assert all(src not in text for src, *_ in DIALOGUE[1::2])


class ContinuingEngine(PromptEngine):
    """Answers a turn that has history with the history's first translation (a small model
    continuing the conversation), and a turn without history with its real answer."""

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        if request.history:
            self.answers = {**self.answers, request.text: DIALOGUE[0][3]}  # turn 0's translation
        else:
            self.answers = {src: answer for src, _, _, answer in DIALOGUE}
        return super().submit_translation(request)


def test_an_answer_copying_a_history_turn_runs_again_without_history(
    gemma_prompts: PromptBuilder,
) -> None:
    base = ContinuingEngine(gemma_prompts, {})
    ctx = ContextEngine(base, prompts=base.prompts, memory=ConversationMemory(1000))  # type: ignore[arg-type]
    results = []
    for k, (src, s, t, _) in enumerate(DIALOGUE[:3]):  # de->en, en->de, de->en
        handle = ctx.submit_translation(
            TranslationRequest(
                request_id=f"r{k}", text=src, source_lang=s, target_lang=t, conversation_id="c"
            )
        )
        results.append(handle.result(0))
    # turn 2 (de->en) has turn 0 in its history and first answered with turn 0's translation
    assert "r2" in base.built and "r2" + NO_HISTORY_SUFFIX in base.built
    assert results[2].text == DIALOGUE[2][3] and results[2].request_id == "r2"
    assert results[2].notes[RETRY_NOTE].startswith("history_leak: copied turn 1 of 1")
    assert results[2].notes[CONTEXT_NOTE] == "turns=1"
    plain, _ = gemma_prompts.build(DIALOGUE[2][0], "de", "en")
    assert base.built["r2" + NO_HISTORY_SUFFIX] == plain  # the second run has no history
    # the reply carries the work of both runs
    assert results[2].tokens_in == len(base.built["r2"]) + len(plain)
    assert ctx.counts["history_leak"] == 1
    # turn 1 (en->de) had no history of its direction: answered once, as it came
    assert "r1" + NO_HISTORY_SUFFIX not in base.built and RETRY_NOTE not in results[1].notes
    # what is recorded is the answer given, so the next turn's history is clean
    assert [t.translation for t in ctx.memory.history("c", "de", "en")] == [
        DIALOGUE[0][3],
        DIALOGUE[2][3],
    ]


class DeferredContinuingEngine(ContinuingEngine):
    """`ContinuingEngine` whose answers arrive only at `release()`; it records cancels."""

    def __init__(self, prompts: PromptBuilder) -> None:
        super().__init__(prompts, {})
        self.pending: list[tuple[RequestHandle, GenerationResult]] = []
        self.cancels: list[str] = []

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        answer = super().submit_translation(request).result(0)
        handle = RequestHandle(request.request_id, self.cancels.append)
        self.pending.append((handle, answer))
        return handle

    def release(self) -> None:
        while self.pending:
            handle, answer = self.pending.pop(0)
            handle.set_result(answer)


def test_a_turn_cancelled_before_its_answer_is_not_retried_without_history(
    gemma_prompts: PromptBuilder,
) -> None:
    base = DeferredContinuingEngine(gemma_prompts)
    ctx = ContextEngine(base, prompts=base.prompts, memory=ConversationMemory(1000))  # type: ignore[arg-type]

    def turn(k: int) -> RequestHandle:
        src, s, t, _ = DIALOGUE[k]
        return ctx.submit_translation(
            TranslationRequest(
                request_id=f"r{k}", text=src, source_lang=s, target_lang=t, conversation_id="c"
            )
        )

    turn(0)
    base.release()
    handle = turn(2)  # de->en with turn 0 in its history: its answer will copy turn 0's
    handle.cancel()  # e.g. the worker's drain timeout, before the answer arrives
    assert base.cancels == ["r2"]
    base.release()
    result = handle.result(0)
    assert "r2" + NO_HISTORY_SUFFIX not in base.built  # no new run for a cancelled turn
    assert RETRY_NOTE not in result.notes and ctx.counts["history_leak"] == 0


def test_a_turn_that_is_the_history_turn_again_is_not_a_leak(
    gemma_prompts: PromptBuilder,
) -> None:
    base = ContinuingEngine(gemma_prompts, {})
    ctx = ContextEngine(base, prompts=base.prompts, memory=ConversationMemory(1000))  # type: ignore[arg-type]
    src, s, t, answer = DIALOGUE[0]
    for k in range(2):  # the customer says the same sentence twice: the same answer is right
        result = ctx.submit_translation(
            TranslationRequest(
                request_id=f"r{k}", text=src, source_lang=s, target_lang=t, conversation_id="c"
            )
        ).result(0)
        assert result.text == answer and RETRY_NOTE not in result.notes
    assert ctx.counts["history_leak"] == 0 and len(base.built) == 2


def test_history_tokens_are_the_separately_tokenized_pieces(gemma_prompts: PromptBuilder) -> None:
    src, s, t, answer = DIALOGUE[1]
    generated = gemma_prompts.tokenizer.encode(" " + answer + "\n", add_special_tokens=False)
    ids = render_turn(gemma_prompts, src, s, t, answer, generated)
    query = gemma_prompts.tokenizer.encode(
        gemma_prompts.query_text(src, s, t), add_special_tokens=False
    )
    assert ids[: len(query)] == query
    assert ids[len(query) : len(query) + len(generated)] == generated
    assert gemma_prompts.tokenizer.decode(ids).endswith(f"German: {answer}\n\n")
    # no generated ids (a cache hit): the same text, rendered from the answer's text
    from_text = gemma_prompts.tokenizer.decode(render_turn(gemma_prompts, src, s, t, answer))
    assert from_text == gemma_prompts.tokenizer.decode(ids)


def test_a_budget_keeps_the_prompt_history_within_it(gemma_prompts: PromptBuilder) -> None:
    budget = 60
    base, rids = _converse(gemma_prompts, budget=budget)
    for rid, (src, s, t, _) in zip(rids, DIALOGUE, strict=True):
        plain, _ = gemma_prompts.build(src, s, t)
        assert 0 <= len(base.built[rid]) - len(plain) <= budget


# -- the exact-match cache --------------------------------------------------------------------


def test_cache_never_answers_a_contextual_turn_and_keeps_only_context_free_ones(
    gemma_prompts: PromptBuilder,
) -> None:
    engine = FakeEngine()
    engine.start()
    settings = Settings(languages=("en", "de"), context_tokens=500)
    options = ServingOptions.of(
        settings, faithful=False, cache=True, cache_l2=InMemoryTranslationCache(), context=True
    )  # the builder's order: context around the cache, contextual turns around it
    base = SimpleNamespace(prompts=gemma_prompts)
    served = build_served_engine(engine, options, base=base)
    ctx = served.stage("context")
    served.start()
    try:

        def turn(rid: str, conv: str, text: str) -> GenerationResult:
            return served.submit_translation(
                TranslationRequest(rid, text, "de", "en", conversation_id=conv)
            ).result(5)

        # conversation A: its first turn has no history (cacheable), then "Danke." in context
        assert turn("a1", "A", "Hallo.").notes["tolk.cache"] == "miss"
        in_context = turn("a2", "A", "Danke.")
        assert "tolk.cache" not in in_context.notes  # straight to the engine
        assert in_context.notes[CONTEXT_NOTE] == "turns=1"
        # conversation B says "Danke." first: no history, so the cache may answer; it has no
        # entry, because A's contextual answer was not kept
        first_b = turn("b1", "B", "Danke.")
        assert first_b.notes["tolk.cache"] == "miss"
        assert engine.submitted.count("a2") == 1 and "b1" in engine.submitted
        # now a context-free "Danke." is cached; A's next "Danke." still goes to the engine
        assert turn("b2", "C", "Danke.").notes["tolk.cache"] == "l1"
        again = turn("a3", "A", "Danke.")
        assert "tolk.cache" not in again.notes and "a3" in engine.submitted
        assert again.text == fake_translation("Danke.", "en")
        assert ctx.counts["contextual"] == 2 and ctx.counts["no_history"] == 3
        # the id goes inward on both paths: around the cache (a2) and through it (a1, b1)
        assert [engine.conversations[rid] for rid in ("a1", "a2", "b1")] == ["A", "A", "B"]
    finally:
        served.stop()


# -- the worker passes the conversation id ------------------------------------------------------


def test_worker_hands_the_conversation_id_to_a_context_engine(gemma_prompts: PromptBuilder) -> None:
    from schemas.codec import encode_request
    from tests.workers.polling import wait_for
    from tests.workers.test_worker_fake_engine import make_rig, now_ms

    engine = FakeEngine()
    base = SimpleNamespace(prompts=gemma_prompts)
    options = ServingOptions.of(Settings(context_tokens=500), faithful=False, context=True)
    served = build_served_engine(engine, options, base=base)
    ctx = served.stage("context")
    rig = make_rig(engine=served)

    def send(rid: str, conversation: str | None, text: str) -> None:
        request: dict[str, Any] = {
            "request_id": rid, "conversation_id": conversation, "source_lang": "en",
            "target_lang": "de", "text": text, "created_at": now_ms(), "deadline": None,
            "reply_topic": "tolk.replies", "metadata": {},
        }  # fmt: skip
        rig.send(encode_request(request), "de", key=(conversation or rid).encode())

    try:
        send("t1", "conv-9", "Hello there.")
        wait_for(lambda: rig.reply_count() == 1, what="first turn answered")
        send("t2", "conv-9", "How can I help?")
        send("x1", None, "How can I help?")
        wait_for(lambda: rig.reply_count() == 3, what="all answered")
        replies = rig.replies()
        assert all(r["status"] == "OK" for r in replies.values())
        assert replies["t2"]["metadata"][CONTEXT_NOTE] == "turns=1"
        assert CONTEXT_NOTE not in replies["t1"]["metadata"]
        assert CONTEXT_NOTE not in replies["x1"]["metadata"]
        assert ctx.counts == {"no_history": 1, "contextual": 1, "no_conversation": 1,
                              "recorded": 2}  # fmt: skip
        assert engine.conversations == {"t1": "conv-9", "t2": "conv-9", "x1": None}
        # the worker bound its metrics: the same counts in Prometheus
        registry = rig.worker.registry
        for outcome, n in ctx.counts.items():
            got = registry.get_sample_value("tolk_context_turns_total", {"outcome": outcome})
            assert got == n, outcome
    finally:
        rig.worker.stop()
        rig.thread.join(10)
