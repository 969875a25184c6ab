"""The Triton paged attention kernels (`kernels/triton_attention.py`) against the torch reference
op (`kernels.attention.paged_attention`), on the CPU under `TRITON_INTERPRET=1`.

Each case scatters ragged sequences (partially filled last blocks) over shuffled block ids of a
pool whose unused slots hold large garbage, and compares the kernel with the reference on the
same metadata: decode steps (grouped-query heads, sliding windows, soft-capped logits, split
contexts, more splits than blocks), the cascade path (rows sharing a prefix), and varlen
prefill/mixed steps. A poisoned-pool case fills every slot a query must not see with NaN: the
kernel must return the reference's result computed on a clean pool, so it never reads them.
NaN never passes (`assert_close` does not equal NaNs; outputs are also checked finite).

The cases run in a `TRITON_INTERPRET=1` child process (tests/kernels/triton_interpreter.py
says why); here each one asserts its outcome there.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.attention import AttentionMetadata, paged_attention
from kernels.cascade import shared_prefixes
from tests.kernels.triton_interpreter import checked_in_child

pytestmark = pytest.mark.triton

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {  # (atol, rtol)
    torch.float32: (2e-5, 1e-4),
    torch.bfloat16: (2e-2, 2e-2),  # the interpreter's bfloat16 casts round toward zero
}
GARBAGE = 1e3  # unused pool slots: large enough that reading one shows


def scatter_pool(
    seq_lens: list[int], block_size: int, kvh: int, d: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """K/V pools full of garbage and one shuffled block table per sequence, with random K/V
    (not garbage) at every position a sequence holds."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    needed = sum(-(-s // block_size) for s in seq_lens)
    num_blocks = needed + 6
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    k_cache = torch.full((num_blocks, block_size, kvh, d), GARBAGE, dtype=dtype)
    v_cache = torch.full((num_blocks, block_size, kvh, d), -GARBAGE, dtype=dtype)
    tables = []
    for s in seq_lens:
        table = [ids.pop() for _ in range(-(-s // block_size))]
        tables.append(table)
        for pos in range(s):
            block, off = table[pos // block_size], pos % block_size
            k_cache[block, off] = torch.randn(kvh, d, generator=gen).to(dtype)
            v_cache[block, off] = torch.randn(kvh, d, generator=gen).to(dtype)
    return k_cache, v_cache, tables


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(out).all(), "the kernel returned NaN or inf"
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


# (num_heads, num_kv_heads, head_dim, block_size, window, softcap, dtype, num_splits)
DECODE_CASES = [
    (4, 4, 16, 4, None, None, torch.float32, 1),  # MHA
    (8, 2, 32, 4, 5, None, torch.float32, 3),  # GQA 4:1, window inside a block
    (9, 3, 64, 16, 20, None, torch.bfloat16, 2),  # SmolLM2's 9:3, window over blocks
    (8, 2, 32, 16, None, 30.0, torch.float32, 1),  # soft-capped logits
    (4, 1, 32, 4, None, None, torch.bfloat16, 8),  # Gemma 270M's 4:1; more splits than needed
]
DECODE_LENS = [1, 9, 33, 64, 16, 5]


@pytest.mark.parametrize("h,kvh,d,bs,window,softcap,dtype,splits", DECODE_CASES)
def test_decode_matches_reference(request, h, kvh, d, bs, window, softcap, dtype, splits):
    if checked_in_child(request):
        return
    from kernels import triton_attention as ta

    k_cache, v_cache, tables = scatter_pool(DECODE_LENS, bs, kvh, d, dtype, seed=h * bs)
    meta = AttentionMetadata.build([1] * len(tables), DECODE_LENS, tables, bs)
    q = torch.randn(len(tables), h, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = d**-0.5
    out = ta.paged_decode_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, window, softcap, splits
    )
    ref = paged_attention(q, k_cache, v_cache, meta, scale, window, softcap)
    assert out.dtype == dtype and out.shape == q.shape
    assert_matches(out, ref, dtype)


def test_decode_never_reads_what_the_query_cannot_see(request):
    """Slots past each row's length, out-of-window blocks and unused blocks hold NaN."""
    if checked_in_child(request):
        return
    from kernels import triton_attention as ta

    h, kvh, d, bs, window = 8, 2, 16, 4, 6
    lens = [3, 14, 21]
    clean_k, clean_v, tables = scatter_pool(lens, bs, kvh, d, torch.float32, seed=7)
    k_cache, v_cache = clean_k.clone(), clean_v.clone()
    visible = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for table, s in zip(tables, lens, strict=True):
        for pos in range(max(0, s - window), s):
            visible[table[pos // bs], pos % bs] = True
    k_cache[~visible] = float("nan")
    v_cache[~visible] = float("nan")
    clean_k[~visible] = 0.0
    clean_v[~visible] = 0.0
    # table entries past each row's blocks point at a poisoned block, not the null block
    poisoned = next(b for b in range(1, k_cache.shape[0]) if not visible[b].any())
    width = max(len(t) for t in tables) + 2
    padded = torch.tensor([t + [poisoned] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, bs)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(3))
    for splits in (1, 4):
        out = ta.paged_decode_attention(
            q, k_cache, v_cache, padded, meta.seq_lens, 0.25, window, None, splits
        )
        ref = paged_attention(q, clean_k, clean_v, meta, 0.25, window)
        assert_matches(out, ref, torch.float32)


@pytest.mark.parametrize(
    "dtype,window", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 22)]
)
def test_cascade_decode_matches_reference(request, dtype, window):
    """Five rows share a 3-block prefix (one row does not; with the window of 22, the row of
    26 tokens leaves the group too); the Triton path attends to the prefix once
    (`_prefix_kernel`) and merges, the reference runs its own cascade."""
    if checked_in_child(request):
        return
    from kernels import triton_attention as ta

    h, kvh, d, bs = 8, 2, 32, 4
    prefix = 12  # 3 full blocks
    own = [1, 5, 9, 2, 14, 30]  # tokens after the prefix, the last row has its own prompt
    lens = [prefix + n for n in own]
    k_cache, v_cache, tables = scatter_pool(lens, bs, kvh, d, dtype, seed=11)
    for table in tables[1:5]:
        table[:3] = tables[0][:3]  # rows 0-4 share the prefix blocks (row 5 does not)
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, bs)
    shared = shared_prefixes(meta, bs, window)
    # with a window, a row whose window no longer covers position 0 leaves the cascade
    expected_rows = [r for r in range(5) if window is None or lens[r] <= window]
    assert shared and shared[0][1] == expected_rows, shared
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    out = ta.triton_paged_attention(q, k_cache, v_cache, meta, d**-0.5, window)
    ref = paged_attention(q, k_cache, v_cache, meta, d**-0.5, window)
    assert_matches(out, ref, dtype)


# (query_len, seq_len) per sequence: prefill chunks (first and later ones), decode rows, and a
# chunk longer than one BLOCK_M tile of queries
MIXED = [(5, 5), (1, 17), (8, 30), (1, 3), (3, 40), (16, 16), (45, 50)]


@pytest.mark.parametrize(
    "h,kvh,d,bs,window,softcap,dtype",
    [
        (8, 2, 32, 4, None, None, torch.float32),
        (9, 3, 64, 16, 20, None, torch.bfloat16),
        (4, 1, 16, 4, 5, 30.0, torch.float32),
    ],
)
def test_varlen_matches_reference(request, h, kvh, d, bs, window, softcap, dtype):
    if checked_in_child(request):
        return
    from kernels import triton_attention as ta

    q_lens = [q for q, _ in MIXED]
    lens = [s for _, s in MIXED]
    k_cache, v_cache, tables = scatter_pool(lens, bs, kvh, d, dtype, seed=bs + h)
    meta = AttentionMetadata.build(q_lens, lens, tables, bs)
    q = torch.randn(sum(q_lens), h, d, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = ta.triton_paged_attention(q, k_cache, v_cache, meta, d**-0.5, window, softcap)
    ref = paged_attention(q, k_cache, v_cache, meta, d**-0.5, window, softcap)
    assert_matches(out, ref, dtype)


def test_decode_reference_is_the_paged_op(request):
    """`paged_decode_attention_reference` (tensor metadata) is `paged_attention` on the same
    step, null-padded tables included."""
    if checked_in_child(request):
        return
    from kernels import triton_attention as ta

    lens = [2, 11, 7]
    k_cache, v_cache, tables = scatter_pool(lens, 4, 2, 16, torch.float32, seed=4)
    meta = AttentionMetadata.build([1] * 3, lens, tables, 4)
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(6))
    padded = torch.nn.functional.pad(meta.block_tables, (0, 3))  # null columns at the end
    got = ta.paged_decode_attention_reference(q, k_cache, v_cache, padded, meta.seq_lens, 0.3, 5)
    torch.testing.assert_close(got, paged_attention(q, k_cache, v_cache, meta, 0.3, 5))
    out = ta.paged_decode_attention(q, k_cache, v_cache, padded, meta.seq_lens, 0.3, 5)
    assert_matches(out, got, torch.float32)
