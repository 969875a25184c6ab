"""Speculative decoding: the n-gram proposer and draft lengths (pure), the scheduler's check of
drafts (real KV manager, no model), and the engine's greedy output unchanged by drafts that are
all right, all wrong or the n-gram proposer's, on tiny random models of every architecture."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tests.conftest import staggered_greedy
from workers.engine.engine import Engine, EngineConfig
from workers.engine.fcfs import FCFSRequestQueue
from workers.engine.kv_cache import KVCacheManager, KVGroupSpec
from workers.engine.scheduler import Scheduler, SchedulerConfig, SequenceState
from workers.engine.speculative import Drafter, DraftLength, NgramProposer, make_drafter
from workers.engine.types import FinishReason, GenerationRequest, SamplingParams

# -- the proposer ---------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_most_recent_match() -> None:
    p = NgramProposer(max_ngram=3, min_ngram=1)
    #           0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 1, 2, 3, 9, 9, 1, 2, 3, 4, 7, 1, 2, 3]
    # "1 2 3" occurred at 1..3 (then 9 9) and at 6..8 (then 4 7 1): the most recent wins
    assert p.propose(tokens, 3) == [4, 7, 1]
    assert p.propose(tokens, 1) == [4]
    # a 3-gram seen once only: the 2-gram "8 5"? none; the 1-gram 5 at 0 -> 1 2 3
    assert p.propose([*tokens, 8, 5], 2) == [1, 2]
    assert p.propose([1, 2, 3, 4], 4) == []  # nothing recurs
    assert p.propose([6, 6], 3) == [6]  # a match runs up to the end of what is known
    assert p.propose([3], 2) == []


def test_ngram_needs_at_least_min_ngram_tokens_to_match() -> None:
    tokens = [1, 2, 9, 7, 2]  # only "2" recurs
    assert NgramProposer(min_ngram=1).propose(tokens, 2) == [9, 7]
    assert NgramProposer(min_ngram=2).propose(tokens, 2) == []


def test_draft_length_grows_on_full_acceptance_and_shrinks_on_misses() -> None:
    length = DraftLength(initial=4, max_draft=8)
    assert length.next(0, 0, 0) == 4  # a new sequence
    assert length.next(4, 4, 4) == 8  # all taken: double
    assert length.next(8, 8, 8) == 8  # capped
    assert length.next(8, 8, 2) == 3  # two taken: ask for one more than that
    assert length.next(3, 3, 0) == 1  # none taken: one
    assert length.next(3, 0, 0) == 3  # nothing was drafted: unchanged
    with pytest.raises(ValueError, match="unknown draft method"):
        make_drafter("eagle", 4)
    assert make_drafter(None, 4) is None


# -- the scheduler's check ------------------------------------------------------------------

BS = 4


def _scheduler(max_model_len: int = 64, budget: int = 16) -> Scheduler:
    kv = KVCacheManager([KVGroupSpec("full", 64, BS, None)])
    return Scheduler(SchedulerConfig(4, budget, max_model_len), kv, FCFSRequestQueue())


def _stop_at(eos: int):
    def check(seq: SequenceState, token: int) -> tuple[FinishReason | None, bool]:
        if token == eos:
            return FinishReason.STOP, False
        if len(seq.output_ids) + 1 >= seq.request.params.max_new_tokens:
            return FinishReason.LENGTH, True
        return None, True

    return check


def _decoding(s: Scheduler, prompt: int = 6, max_new: int = 20) -> SequenceState:
    s.add_request(GenerationRequest("a", list(range(100, 100 + prompt)), SamplingParams(max_new)))
    out = s.schedule()
    s.update_from_output(out, {"a": [50]}, _stop_at(-1))  # prefill, first token 50
    return s.running[0]


def test_a_chunk_checks_its_drafts_and_keeps_the_agreeing_prefix() -> None:
    s = _scheduler()
    seq = _decoding(s)
    assert (seq.num_computed, len(seq.token_ids)) == (6, 7)
    seq.draft_ids = [51, 52, 53, 54]
    out = s.schedule()
    (chunk,) = out.chunks
    assert (chunk.start, chunk.num_tokens, chunk.draft) == (6, 5, (51, 52, 53, 54))
    assert chunk.samples and chunk.num_rows_sampled == 5
    assert chunk.input_ids() == [50, 51, 52, 53, 54]
    # the target agrees with 51 and 52, then says 60: 51 52 60 kept, 53 54 dropped
    s.update_from_output(out, {"a": [51, 52, 60, 61, 62]}, _stop_at(-1))
    assert seq.output_ids == [50, 51, 52, 60]
    assert seq.num_computed == 6 + 3  # 50, 51, 52 are in the KV cache; 60 is next to compute
    assert (chunk.num_accepted, seq.num_drafted, seq.num_accepted) == (2, 4, 2)
    assert seq.draft_ids == []
    # the next step computes 60 alone
    out = s.schedule()
    assert [(c.start, c.num_tokens, c.draft) for c in out.chunks] == [(9, 1, ())]


def test_all_drafts_right_yield_them_and_one_more_token() -> None:
    s = _scheduler()
    seq = _decoding(s)
    seq.draft_ids = [51, 52]
    out = s.schedule()
    s.update_from_output(out, {"a": [51, 52, 53]}, _stop_at(-1))
    assert seq.output_ids == [50, 51, 52, 53]
    assert seq.num_computed == 9 and out.chunks[0].num_accepted == 2


def test_a_stop_inside_the_drafts_ends_the_sequence_there() -> None:
    s = _scheduler()
    seq = _decoding(s)
    seq.draft_ids = [51, 99, 52]
    out = s.schedule()
    finished = s.update_from_output(out, {"a": [51, 99, 52, 53]}, _stop_at(99))
    assert finished == [seq] and seq.finish_reason == FinishReason.STOP
    assert seq.output_ids == [50, 51]  # the EOS (99) is dropped, nothing after it is kept
    assert s.running == []


def test_drafts_respect_the_output_cap_the_budget_and_max_model_len() -> None:
    s = _scheduler()
    seq = _decoding(s, max_new=3)
    seq.draft_ids = [51, 52, 53, 54]  # more than the cap leaves: the stop rule ends it
    out = s.schedule()
    finished = s.update_from_output(out, {"a": [51, 52, 53, 54, 55]}, _stop_at(-1))
    assert finished == [seq] and seq.output_ids == [50, 51, 52]
    assert seq.finish_reason == FinishReason.LENGTH

    s = _scheduler(budget=3)
    seq = _decoding(s, prompt=2)
    seq.draft_ids = [51, 52, 53, 54]
    (chunk,) = s.schedule().chunks
    assert chunk.num_tokens == 3 and chunk.draft == (51, 52)  # the step's token budget

    s = _scheduler(max_model_len=9)
    seq = _decoding(s)  # 7 tokens known
    seq.draft_ids = [51, 52, 53, 54]
    (chunk,) = s.schedule().chunks
    assert chunk.draft == (51,)  # positions stay below max_model_len


def test_the_drafter_drafts_for_greedy_decoding_sequences_only() -> None:
    s = _scheduler()
    seq = _decoding(s, prompt=6, max_new=20)
    seq.token_ids[:] = [1, 2, 3, 4, 1, 2, 3]  # "2 3" recurs, followed by 4 1 2 3
    drafter = Drafter(NgramProposer(), DraftLength(initial=2, max_draft=4), max_model_len=64)
    assert drafter.propose([seq]) == 2
    assert seq.draft_ids == [4, 1] and seq.draft_len == 2
    sampled = SequenceState(
        GenerationRequest("b", [1, 2, 1, 2], SamplingParams(temperature=0.7)), [1, 2, 1, 2], 4, 3
    )
    assert drafter.propose([sampled]) == 0 and sampled.draft_ids == []


# -- the engine: greedy output unchanged ----------------------------------------------------


class OracleProposer:
    """Drafts the reference continuation (all right), or it shifted by one (all wrong)."""

    def __init__(self, references: Sequence[list[int]], wrong: bool = False) -> None:
        self.references = references
        self.wrong = wrong

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        for ref in self.references:
            if list(ref[: len(token_ids)]) == list(token_ids):
                draft = ref[len(token_ids) : len(token_ids) + k]
                return [(t + 1) % 64 for t in draft] if self.wrong else list(draft)
        return []


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_drafts_never_change_greedy_output(arch: str, tiny_config: Any, tiny_models: Any) -> None:
    _, loaded = tiny_models(tiny_config(arch, vocab_size=64))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (9, 23, 4)]
    config = EngineConfig(kv_cache_tokens=1024, block_size=4, max_num_batched_tokens=16)
    plain_engine = Engine(loaded, config)
    plain = staggered_greedy(plain_engine, prompts, 12, 2)
    references = [p + out for p, out in zip(prompts, plain, strict=True)]

    for proposer, all_right in [
        (OracleProposer(references), True),
        (OracleProposer(references, wrong=True), False),
        (NgramProposer(), None),
    ]:
        engine = Engine(loaded, config)
        engine.drafter = Drafter(proposer, DraftLength(initial=3, max_draft=6))
        assert staggered_greedy(engine, prompts, 12, 2) == plain, type(proposer).__name__
        stats = engine.stats
        if all_right is None:
            continue
        assert stats.draft_tokens > 0
        if all_right:  # every draft taken: fewer steps than tokens
            assert stats.accepted_draft_tokens == stats.draft_tokens
            assert stats.steps < plain_engine.stats.steps
        else:
            assert stats.accepted_draft_tokens == 0
        assert stats.decode_tokens == plain_engine.stats.decode_tokens


def test_drafts_through_the_compiled_rows_and_beside_a_sampled_request(
    tiny_config: Any, tiny_models: Any
) -> None:
    """Draft checks run through the compiled graph (every row its own); a sampled request in
    the same steps draws the tokens it draws without drafts (same seed)."""
    _, loaded = tiny_models(tiny_config("qwen2", vocab_size=64))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (7, 5)]
    greedy = SamplingParams(max_new_tokens=10, ignore_eos=True, stop_at_newline=False)
    drawn = SamplingParams(
        max_new_tokens=10, ignore_eos=True, stop_at_newline=False, temperature=0.8, seed=11
    )

    def run(engine: Engine) -> list[list[int]]:
        reqs = [
            GenerationRequest("g", prompts[0], greedy),
            GenerationRequest("s", prompts[1], drawn),
        ]
        return [r.token_ids for r in engine.generate(reqs)]

    base = EngineConfig(kv_cache_tokens=1024, block_size=4)
    plain = run(Engine(loaded, base))
    references = [prompts[0] + plain[0]]
    engine = Engine(loaded, EngineConfig(kv_cache_tokens=1024, block_size=4, compile_decode=True,
                                         compile_max_batch=2, compile_max_rows=16))  # fmt: skip
    engine.drafter = Drafter(OracleProposer(references), DraftLength(initial=3, max_draft=4))
    assert run(engine) == plain
    assert engine.stats.accepted_draft_tokens > 0
    assert engine.stats.compiled_rows_steps > 0  # the draft checks went through the graph


def test_the_drafter_keeps_the_step_within_the_compiled_rows() -> None:
    s = _scheduler()
    for rid in ("a", "b", "c"):
        s.add_request(GenerationRequest(rid, [1, 2, 3, 1, 2], SamplingParams(20)))
    out = s.schedule()
    s.update_from_output(out, {r: [3] for r in ("a", "b", "c")}, _stop_at(-1))
    seqs = s.running  # each: 1 2 3 1 2 3 -> "2 3" recurs, then 1 2 3
    drafter = Drafter(NgramProposer(), DraftLength(initial=4, max_draft=4), max_rows=7)
    assert drafter.propose(seqs) == 4  # 3 rows + 4 drafts
    assert [len(q.draft_ids) for q in seqs] == [3, 1, 0]


@pytest.mark.slow
def test_ngram_speculation_keeps_qwen_output_token_for_token(qwen05: Any, data_dir: Any) -> None:
    """Real weights (Qwen2.5-Coder-0.5B, int8, compiled decode as the worker runs it): chat
    turns and FLORES sentences with names and numbers, alone and batched, the same tokens with
    and without n-gram drafts, and drafts accepted."""
    from replay.datasets import bcontrast, flores

    turns = [
        (u.source, u.source_lang, u.target_lang)
        for u, _ in zip(bcontrast("dev"), range(4), strict=False)
    ]
    texts = turns + [(t, "en", "de") for t in flores("en")[:3]]
    config = EngineConfig(
        model="qwen2.5-coder-0.5b", quantize="int8", compile_decode=True, kv_cache_tokens=4096
    )
    plain = Engine(qwen05, config)
    spec = Engine(qwen05, config)
    spec.drafter = make_drafter("ngram", 8, config.max_model_len, config.compile_max_rows)

    def run(engine: Engine, batch: list[tuple[str, str, str]]) -> list[list[int]]:
        reqs = [engine.translation_request(t, s, g, max_new_tokens=64) for t, s, g in batch]
        return [r.token_ids for r in engine.generate(reqs)]

    alone = [run(plain, [t])[0] for t in texts]
    assert [run(spec, [t])[0] for t in texts] == alone
    assert run(spec, texts) == run(plain, texts)
    assert spec.stats.accepted_draft_tokens > 0
    assert spec.stats.decode_tokens == plain.stats.decode_tokens
