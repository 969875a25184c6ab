"""CUDA-graph decode steps (workers/engine/cuda_graphs.py).

On the CPU: the buffer bookkeeping that a captured graph depends on (bucket choice, packing a
step into the static buffer with its padding, the metadata the graph derives from it, where
padding rows read and write: slot 0 of the null block), checked against the eager path's own
metadata and attention; and that the options change nothing on a CPU engine. On a CUDA device
(marked `gpu`): the graph engine, with and without the Triton kernels, gives the eager
engine's tokens on tiny random Llama and Gemma 3 models (float32).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kernels.attention import (
    AttentionMetadata,
    decode_attention_reference,
    paged_attention,
    write_kv_decode,
)
from workers.engine.cuda_graphs import (
    CudaGraphDecode,
    StepLayout,
    choose_bucket,
    paged_batches,
    reference_batches,
)
from workers.engine.engine import Engine, EngineConfig
from workers.engine.types import GenerationRequest, SamplingParams

BS = 4  # block size of the bookkeeping cases
# a step of three sequences: positions inside partially filled blocks, two KV groups; the
# sliding group's tables have null blocks before the window (as kv_cache.py leaves them)
POSITIONS = [0, 6, 13]
TABLES = {
    "full": [[3], [5, 9], [2, 7, 8, 11]],
    "sliding": [[4], [6, 10], [0, 0, 12, 1]],
}
WINDOWS = {"full": None, "sliding": 6}


def packed(bucket: int = 4, max_blocks: int = 5) -> tuple[StepLayout, torch.Tensor]:
    layout = StepLayout(bucket, max_blocks, ("full", "sliding"))
    buffer = torch.full((layout.size,), -7, dtype=torch.int32)  # stale contents
    assert layout.pack([11, 12, 13], POSITIONS, TABLES, buffer)
    return layout, buffer


@pytest.mark.parametrize(
    "n,bucket", [(1, 1), (2, 2), (3, 4), (8, 8), (9, 16), (33, 48), (128, 128), (129, None)]
)
def test_a_step_runs_the_smallest_bucket_that_holds_it(n, bucket):
    assert choose_bucket(n, (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)) == bucket


def test_no_bucket_for_an_empty_step():
    assert choose_bucket(0, (1, 2, 4)) is None


def test_packing_pads_rows_and_columns_with_the_null_block():
    layout, buffer = packed()
    views = layout.views(buffer)
    assert views.token_ids.tolist() == [11, 12, 13, 0]  # padding row: token 0
    assert views.positions.tolist() == [0, 6, 13, 0]  # padding row: position 0
    assert views.block_tables["full"].tolist() == [
        [3, 0, 0, 0, 0],
        [5, 9, 0, 0, 0],
        [2, 7, 8, 11, 0],
        [0, 0, 0, 0, 0],  # padding row: all null
    ]
    assert views.block_tables["sliding"].tolist() == [
        [4, 0, 0, 0, 0],
        [6, 10, 0, 0, 0],
        [0, 0, 12, 1, 0],
        [0, 0, 0, 0, 0],
    ]
    assert layout.size == 4 * 2 + 2 * 4 * 5 and buffer.numel() == layout.size


def test_packing_a_smaller_step_clears_the_previous_one():
    layout, buffer = packed()
    assert layout.pack([21], [2], {"full": [[7]], "sliding": [[8]]}, buffer)
    views = layout.views(buffer)
    assert views.token_ids.tolist() == [21, 0, 0, 0]
    assert views.block_tables["full"].tolist()[1:] == [[0] * 5] * 3


def test_a_step_that_does_not_fit_is_refused():
    layout = StepLayout(2, 3, ("full",))
    buffer = torch.zeros(layout.size, dtype=torch.int32)
    assert not layout.pack([1, 2, 3], [0, 1, 2], {"full": [[1], [2], [3]]}, buffer)  # 3 > 2 rows
    assert layout.fits_positions([11], block_size=4)  # block 2 of 3
    assert not layout.fits_positions([12], block_size=4)  # block 3: past max_blocks
    with pytest.raises(ValueError, match="tables for 2 rows"):
        layout.pack([1, 2], [0, 1], {"full": [[1]]}, buffer)


def test_graph_metadata_has_the_eager_slots_and_lengths():
    """The Triton path's metadata, derived from the buffer by device ops, equals the eager
    metadata for the real rows; the padding row writes slot 0 (the null block's first)."""
    layout, buffer = packed()
    batches = paged_batches(layout.views(buffer), BS, num_splits=3)
    for group, tables in TABLES.items():
        eager = AttentionMetadata.build([1] * 3, [p + 1 for p in POSITIONS], tables, BS)
        batch = batches[group]
        assert batch.slot_mapping.tolist() == eager.slot_mapping.tolist() + [0]
        assert batch.seq_lens.tolist() == [1, 7, 14, 1]
        assert batch.num_splits == 3
        assert batch.block_tables.data_ptr() == layout.views(buffer).block_tables[group].data_ptr()


@pytest.mark.parametrize("group", ["full", "sliding"])
def test_reference_graph_batch_attends_as_the_eager_path(group):
    """The graph's reference-path `DecodeBatch` (every row over all max_blocks blocks, masked)
    gives the eager paged attention's output for the real rows, and its padding row writes and
    reads only slot 0 of the null block."""
    layout, buffer = packed()
    batch = reference_batches(layout.views(buffer), BS, WINDOWS)[group]
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(13, BS, 2, 16, generator=gen)
    v_cache = torch.randn(13, BS, 2, 16, generator=gen)
    q = torch.randn(4, 4, 16, generator=gen)
    k_new, v_new = torch.randn(4, 2, 16, generator=gen), torch.randn(4, 2, 16, generator=gen)
    before = k_cache.clone()
    write_kv_decode(k_new, v_new, k_cache, v_cache, batch)
    changed = (k_cache != before).any(dim=(2, 3)).nonzero().tolist()  # [block, offset] pairs
    eager = AttentionMetadata.build([1] * 3, [p + 1 for p in POSITIONS], TABLES[group], BS)
    written = [[s // BS, s % BS] for s in eager.slot_mapping.tolist()]
    assert sorted(changed) == sorted([*written, [0, 0]])  # padding: null block, slot 0
    out = decode_attention_reference(q, k_cache, v_cache, batch, 0.25)
    ref = paged_attention(q[:3], k_cache, v_cache, eager, 0.25, WINDOWS[group])
    torch.testing.assert_close(out[:3], ref)
    assert torch.isfinite(out[3]).all()


def test_graph_runner_refuses_a_cpu_model(tiny_config: Any, tiny_models: Any):
    _, loaded = tiny_models(tiny_config("llama", vocab_size=128))
    with pytest.raises(RuntimeError, match="CUDA"):
        CudaGraphDecode(loaded.model, BS, 64)


def _greedy_tokens(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, stop_at_newline=False)
    requests = [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
    return [r.token_ids for r in engine.generate(requests)]


PROMPTS = [[5, 9, 2, 77, 31], [8, 1], [3, 3, 90, 14, 15, 16, 2, 9, 10]]


def test_the_options_change_nothing_on_a_cpu_engine(tiny_config: Any, tiny_models: Any):
    _, loaded = tiny_models(tiny_config("gemma3", vocab_size=256))
    plain = _greedy_tokens(Engine(loaded, EngineConfig(kv_cache_tokens=512)), PROMPTS)
    asked = Engine(loaded, EngineConfig(kv_cache_tokens=512, cuda_graphs=True, triton_kernels=True))
    assert asked.graphs is None
    assert _greedy_tokens(asked, PROMPTS) == plain
    assert asked.stats.graph_steps == 0
    assert type(asked.model.layers[0]).__name__ == "Block"  # no swap off CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
@pytest.mark.parametrize("triton_kernels", [False, True])
def test_graph_engine_gives_the_eager_tokens_on_cuda(
    arch: str, triton_kernels: bool, tiny_config: Any, tiny_models: Any
) -> None:
    no_caps = {"attn_logit_softcapping": None, "final_logit_softcapping": None}
    cfg = tiny_config(arch, vocab_size=512, **(no_caps if arch == "gemma3" else {}))
    _, eager_loaded = tiny_models(cfg, "cuda")
    base = EngineConfig(device="cuda", kv_cache_tokens=2048, max_model_len=256)
    expected = _greedy_tokens(Engine(eager_loaded, base), PROMPTS)
    _, loaded = tiny_models(cfg, "cuda")  # fresh weights: the swap changes modules in place
    asked = dataclasses.replace(base, cuda_graphs=True, triton_kernels=triton_kernels)
    engine = Engine(loaded, asked)
    assert _greedy_tokens(engine, PROMPTS) == expected
    assert engine.stats.graph_steps >= 11  # every decode step of the batch of three
