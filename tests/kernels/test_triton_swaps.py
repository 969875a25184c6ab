"""The Triton swap (workers/engine/triton_swaps.py) computes the model's function.

A tiny random Llama and a tiny Gemma 3 (QK-norm after the split, sandwich
norms, sliding windows shorter than the text, soft-capped logits), both with the fused q/k/v
and gate/up projections the engine serves with, run the same steps twice,
each copy on its own KV cache: the reference model, and a copy whose RMSNorm, Attention and
Block modules were swapped for the Triton versions: a prefill step (two prompts, chunks
partially filling their last blocks), a decode step, and a mixed step (a third prompt's
prefill beside two decoding rows). The hidden states must agree (float32), and
`remove_triton_kernels` must give the reference classes back. The cases run in a
`TRITON_INTERPRET=1` child process (tests/kernels/triton_interpreter.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

from kernels.attention import AttentionMetadata
from tests.conftest import tiny_hf_config
from tests.kernels.triton_interpreter import checked_in_child
from workers.engine.config import ModelConfig
from workers.engine.model import Transformer
from workers.engine.swaps import fuse_gate_up, fuse_qkv

pytestmark = pytest.mark.triton

BS = 4  # block size


def tiny_model(arch: str) -> Transformer:
    # Gemma: one sliding and one full layer (both KV groups) keep the interpreter's time down
    two_layers = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    config = ModelConfig.from_hf(
        tiny_hf_config(arch, vocab_size=64, **(two_layers if arch == "gemma3" else {}))
    )
    torch.manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.reset_buffers("cpu")
    assert fuse_qkv(model) > 0 and fuse_gate_up(model) > 0  # as the engine prepares it
    return model.eval()


def step(model: Transformer, steps: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
    """One forward: per sequence (token ids of this step, tokens cached before, block table)."""
    ids: list[int] = []
    positions: list[int] = []
    q_lens: list[int] = []
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    for tokens, cached, table in steps:
        ids += tokens
        positions += range(cached, cached + len(tokens))
        q_lens.append(len(tokens))
        seq_lens.append(cached + len(tokens))
        tables.append(table)
    meta = {
        g: AttentionMetadata.build(q_lens, seq_lens, tables, BS) for g in model.config.kv_groups
    }
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.tensor(positions), meta)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_swapped_model_computes_the_reference_function(request, arch):
    if checked_in_child(request):
        return
    from workers.engine.triton_swaps import (
        TritonAttention,
        apply_triton_kernels,
        remove_triton_kernels,
    )

    reference = tiny_model(arch)
    swapped = copy.deepcopy(reference)
    assert apply_triton_kernels(swapped) == apply_triton_kernels(swapped) > 0  # idempotent
    assert isinstance(swapped.layers[0].attn, TritonAttention)
    for model in (reference, swapped):
        model.allocate_kv_cache({g: 12 for g in model.config.kv_groups}, BS, torch.float32, "cpu")

    gen = torch.Generator().manual_seed(1)
    a = torch.randint(0, 64, (6,), generator=gen).tolist()
    b = torch.randint(0, 64, (11,), generator=gen).tolist()
    c = torch.randint(0, 64, (7,), generator=gen).tolist()
    ta, tb, tc = [1, 2], [3, 4, 5, 8], [6, 7]  # block tables (same ids in every group)
    steps = [
        [(a, 0, ta), (b, 0, tb)],  # prefill
        [([9], 6, ta), ([10], 11, tb)],  # decode
        [([11], 7, ta), ([12], 12, tb), (c, 0, tc)],  # mixed: c prefills beside a and b
    ]
    for i, batch in enumerate(steps):
        got, want = step(swapped, batch), step(reference, batch)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"step {i}")

    assert remove_triton_kernels(swapped) > 0
    assert not any(isinstance(m, TritonAttention) for m in swapped.modules())
