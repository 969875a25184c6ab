"""Teacher-forced scoring (`GenerationRequest.score_from`): the engine's mean log-probability of
given tokens equals transformers' on the same random weights, whatever the step does around it
(chunked prefill, prefix-cache hits, batching beside decoding requests, compiled decode on);
the scheduler never takes a scored position from the prefix cache; a preempted scoring request
starts its sum again. The real-weights check is in tests/engine/test_engine_parity.py's style:
a Qwen 0.5B prefers its own greedy answer to a corrupted one."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from workers.engine.engine import Engine, EngineConfig
from workers.engine.fcfs import FCFSRequestQueue
from workers.engine.kv_cache import KVCacheManager, KVGroupSpec
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.types import FinishReason, GenerationRequest, SamplingParams

ARCHES = ("llama", "gemma3", "qwen2")


def reference_logprob(hf: Any, ids: list[int], score_from: int) -> float:
    """transformers: the mean log-probability of ids[score_from:] given what precedes each."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()  # [T, V]
    logprobs = torch.log_softmax(logits[score_from - 1 : -1], dim=-1)
    targets = torch.tensor(ids[score_from:])[:, None]
    return float(logprobs.gather(1, targets).mean())


def scored(ids: list[int], score_from: int, rid: str = "s") -> GenerationRequest:
    return GenerationRequest(rid, ids, SamplingParams(max_new_tokens=1), score_from=score_from)


@pytest.mark.parametrize("arch", ARCHES)
def test_scored_logprob_matches_transformers_through_chunks_cache_hits_and_batching(
    arch: str, tiny_config: Any, tiny_models: Any
) -> None:
    hf, loaded = tiny_models(tiny_config(arch))
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 100, (13,), generator=g).tolist()
    answers = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (7, 11)]
    # chunks of 8 tokens: the scored rows of the 20- and 24-token prompts span two chunks
    engine = Engine(loaded, EngineConfig(kv_cache_tokens=1024, block_size=4,
                                         max_num_batched_tokens=8))  # fmt: skip
    plain = GenerationRequest("p", prefix[:9], SamplingParams(max_new_tokens=6, ignore_eos=True))
    handles = [engine.submit(plain)]
    engine.step()  # the plain request is decoding when the scoring ones arrive
    handles += [
        engine.submit(scored(prefix + a, len(prefix), f"s{i}")) for i, a in enumerate(answers)
    ]
    engine.run_until_done()
    # the same again: the shared prefix now comes from the prefix cache
    again = engine.generate([scored(prefix + answers[1], len(prefix), "again")])[0]
    results = [h.result(timeout=0) for h in handles]
    assert results[0].logprob is None and results[0].scored_tokens == 0
    for answer, result in zip(answers, results[1:], strict=True):
        want = reference_logprob(hf, prefix + answer, len(prefix))
        assert result.scored_tokens == len(answer)
        assert result.logprob == pytest.approx(want, abs=1e-4)
        assert len(result.token_ids) == 1  # one prefill, one token: no decoding
    assert again.cached_tokens > 0 and again.cached_tokens <= len(prefix) - 1
    assert again.logprob == pytest.approx(results[2].logprob, abs=1e-5)


def test_scoring_beside_compiled_decode_still_reads_every_row(
    tiny_config: Any, tiny_models: Any
) -> None:
    """A step with scored rows leaves the compiled graph (it returns the sampled rows only)."""
    hf, loaded = tiny_models(tiny_config("qwen2"))
    ids = list(range(10, 40))
    engine = Engine(loaded, EngineConfig(kv_cache_tokens=1024, block_size=4, compile_decode=True,
                                         compile_max_rows=64))  # fmt: skip
    (result,) = engine.generate([scored(ids, 20)])
    assert result.scored_tokens == 10
    assert result.logprob == pytest.approx(reference_logprob(hf, ids, 20), abs=1e-4)


@pytest.mark.parametrize("arch", ARCHES)
def test_generated_tokens_log_probabilities_are_what_teacher_forcing_gives_them(
    arch: str, tiny_config: Any, tiny_models: Any
) -> None:
    """`SamplingParams.logprobs`: the answer's mean log-probability read off the generation (the
    cascade's small-model signal without a second pass) equals transformers' teacher-forced
    one on the same tokens, with the same greedy tokens as without it, beside a plain request
    and with n-gram drafts on (a sequence keeping log-probabilities is never drafted for)."""
    hf, loaded = tiny_models(tiny_config(arch))
    prompt = list(range(10, 30)) * 2  # repeats: the n-gram proposer has something to draft
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, stop_at_newline=False)
    keep = SamplingParams(max_new_tokens=8, ignore_eos=True, stop_at_newline=False, logprobs=True)
    for draft in (None, "ngram"):
        engine = Engine(loaded, EngineConfig(kv_cache_tokens=1024, block_size=4, draft=draft))
        plain, kept = engine.generate(
            [GenerationRequest("p", prompt, params), GenerationRequest("k", prompt, keep)]
        )
        assert kept.token_ids == plain.token_ids and plain.logprob is None
        assert kept.scored_tokens == len(kept.token_ids) == 8
        want = reference_logprob(hf, prompt + kept.token_ids, len(prompt))
        assert kept.logprob == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("arch", ARCHES)
def test_an_answer_stops_once_its_log_probability_falls_under_stop_below(
    arch: str, tiny_config: Any, tiny_models: Any
) -> None:
    """`SamplingParams.stop_below` (the cascade's early deferral): the answer ends BELOW at the
    first token whose running sum of log-probabilities (transformers' values) is under it, with
    the same tokens up to there; a bound the whole answer stays above changes nothing."""
    hf, loaded = tiny_models(tiny_config(arch))
    prompt = list(range(10, 30))
    whole = SamplingParams(max_new_tokens=8, ignore_eos=True, stop_at_newline=False, logprobs=True)
    engine = Engine(loaded, EngineConfig(kv_cache_tokens=1024, block_size=4))
    (full,) = engine.generate([GenerationRequest("f", prompt, whole)])
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + full.token_ids])).logits[0].float()
    steps = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    per_token = steps.gather(1, torch.tensor(full.token_ids)[:, None])[:, 0]
    running = per_token.cumsum(0).tolist()  # falls with every token
    bound = (running[2] + running[3]) / 2  # crossed at the 4th token
    below = dataclasses.replace(whole, stop_below=bound)
    above = dataclasses.replace(whole, stop_below=running[-1] - 1.0)
    stopped, kept = engine.generate(
        [GenerationRequest("b", prompt, below), GenerationRequest("a", prompt, above)]
    )
    assert stopped.finish_reason is FinishReason.BELOW and not stopped.ok
    assert stopped.token_ids == full.token_ids[:4]
    assert stopped.logprob is not None and stopped.logprob * stopped.scored_tokens < bound
    assert kept.finish_reason is FinishReason.LENGTH and kept.token_ids == full.token_ids


def test_scheduler_never_takes_a_scored_position_from_the_prefix_cache() -> None:
    kv = KVCacheManager([KVGroupSpec("full", 64, 4, None)])
    s = Scheduler(SchedulerConfig(4, 64, 256), kv, FCFSRequestQueue())
    ids = list(range(100, 124))  # 24 tokens, all cached once computed
    s.add_request(GenerationRequest("warm", ids, SamplingParams(1)))
    out = s.schedule()
    s.update_from_output(out, {"warm": [7]}, lambda seq, tok: (None, True))  # all cached now
    assert kv.prefix.find_cached_prefix(ids) == 23  # at most len - 1 (partial blocks shared)
    s.add_request(scored(ids, 10, "score"))
    (chunk,) = [c for c in s.schedule().chunks if c.seq.request_id == "score"]
    assert chunk.start == 9  # the hit stops at row 9, which scores token 10: it is computed
    assert list(chunk.scored_rows) == list(range(9, 23))


def test_a_preempted_scoring_request_starts_its_sum_again() -> None:
    kv = KVCacheManager([KVGroupSpec("full", 64, 4, None)])
    s = Scheduler(SchedulerConfig(4, 64, 256), kv, FCFSRequestQueue())
    s.add_request(scored(list(range(100, 120)), 5, "score"))
    (chunk,) = s.schedule().chunks
    chunk.seq.logprob_sum, chunk.seq.num_scored = -3.0, 4  # as a step would have added
    s._preempt(chunk.seq)
    assert (chunk.seq.logprob_sum, chunk.seq.num_scored) == (0.0, 0)


def private_qwen05() -> Any:
    """The 0.5B preset loaded for this test alone (float32): the session's `qwen05` may already
    be prepared with another weight format by the test before, and swaps cannot be undone."""
    from workers.engine.loader import load_model

    return load_model("qwen2.5-coder-0.5b", dtype=torch.float32, device="cpu")


@pytest.mark.slow
def test_qwen_prefers_its_own_translation_to_a_corrupted_one() -> None:
    """Real weights (the 0.5B preset): the score ranks an answer the model itself gave above
    the same answer with a wrong number and a dropped clause, through the engine's own prompt."""
    engine = Engine(private_qwen05(), EngineConfig(kv_cache_tokens=4096))
    text = "Your order 4711 will arrive on Monday, and the invoice is in your account."
    (own,) = engine.generate([engine.translation_request(text, "en", "de")])
    good, bad = engine.generate(
        [
            engine.score_request(text, "en", "de", own.text),
            engine.score_request(text, "en", "de", "Ihre Bestellung 815 kommt am Freitag."),
        ]
    )
    assert own.text and good.logprob is not None and bad.logprob is not None
    assert good.scored_tokens > 3
    assert good.logprob > bad.logprob + 0.5
    with pytest.raises(ValueError, match="nothing to score"):
        engine.score_request(text, "en", "de", "")
