"""`TokenSampler` on its own: seeded per-request draws, the top-p cut, greedy rows, and the
screened LM head agreeing with the full logits' argmax (a tiny random Llama, no engine)."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch

from kernels.greedy_head import Int8Screen
from workers.engine.model import Transformer
from workers.engine.sampling import TokenSampler
from workers.engine.scheduler import SequenceState
from workers.engine.types import GenerationRequest, SamplingParams

VOCAB = 50


def seq(request_id: str, **params: Any) -> SequenceState:
    request = GenerationRequest(request_id, [1, 2, 3], SamplingParams(**params))
    return SequenceState(request, [1, 2, 3], 3)


def draws(sampler: TokenSampler, s: SequenceState, logits: torch.Tensor, n: int) -> list[int]:
    return [sampler.sample([s], logits[None])[s.request_id] for _ in range(n)]


def no_model_sampler() -> TokenSampler:
    return TokenSampler(cast(Transformer, None), None)  # `sample` never touches the model


def test_a_request_draws_from_its_own_seeded_generator() -> None:
    flat = torch.zeros(VOCAB)  # uniform: the draws are the generator's alone
    sampler = no_model_sampler()
    a = seq("a", temperature=1.0, seed=7)
    first = draws(sampler, a, flat, 20)
    assert len(set(first)) > 1  # the stream advances between calls
    sampler.forget("a")
    assert draws(sampler, a, flat, 20) == first  # a fresh generator, the same seed
    # another sampler, another request sharing the batch: a's draws stay the same
    other = no_model_sampler()
    b = seq("b", temperature=1.0, seed=8)
    both = [other.sample([a, b], torch.stack([flat, flat])) for _ in range(20)]
    assert [t["a"] for t in both] == first
    assert [t["b"] for t in both] != first


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.zeros(VOCAB)
    logits[4] = 3.0  # p ~ 0.29 alone; with top_p 0.2 nothing else is kept
    loose = draws(no_model_sampler(), seq("x", temperature=1.0, seed=1), logits, 100)
    assert set(loose) - {4}  # without the cut other tokens come up
    tight = draws(no_model_sampler(), seq("x", temperature=1.0, top_p=0.2, seed=1), logits, 100)
    assert set(tight) == {4}


def test_greedy_rows_take_the_argmax_or_the_given_greedy_tokens() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    sampler = no_model_sampler()
    g, h = seq("g"), seq("h")
    assert sampler.sample([g, h], logits) == {
        "g": int(logits[0].argmax()),
        "h": int(logits[1].argmax()),
    }
    given = torch.tensor([3, 9])  # a compiled step's greedy tokens are taken as they are
    assert sampler.sample([g, h], logits, given) == {"g": 3, "h": 9}


@pytest.fixture(scope="module")
def tiny_llama(tiny_config: Any) -> Transformer:
    from transformers import AutoModelForCausalLM

    from workers.engine.config import ModelConfig
    from workers.engine.loader import model_from_hf_state_dict

    torch.manual_seed(0)
    hf_config = tiny_config("llama", vocab_size=256)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    config = ModelConfig.from_hf(hf_config)
    return model_from_hf_state_dict(hf.state_dict(), config, torch.float32, "cpu")


@torch.inference_mode()
def test_screened_head_picks_the_full_logits_argmax(tiny_llama: Transformer) -> None:
    rows = torch.randn(5, tiny_llama.config.hidden_size, generator=torch.Generator().manual_seed(1))
    seqs = [seq(f"r{i}") for i in range(5)]
    screened = TokenSampler(tiny_llama, Int8Screen.build(tiny_llama.lm_head.weight))
    plain = TokenSampler(tiny_llama, None)
    assert screened.screens(seqs) and not plain.screens(seqs)
    argmax = tiny_llama.compute_logits(rows).argmax(dim=-1).tolist()
    expected = {s.request_id: t for s, t in zip(seqs, argmax, strict=True)}
    assert screened.pick(seqs, rows) == expected
    assert plain.pick(seqs, rows) == expected
    # one sampled sequence in the batch: the whole step goes through the logits
    assert not screened.screens([*seqs, seq("s", temperature=1.0, seed=0)])
