"""paged_attention / write_kv against a plain dense causal attention in torch.

Each case scatters random sequences over shuffled block ids of a pool filled with garbage, writes
their K/V through `write_kv`, and compares the paged op with dense attention over contiguous K/V.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from kernels import cpu_ops
from kernels.attention import (
    AttentionMetadata,
    DecodeBatch,
    decode_attention,
    decode_attention_reference,
    paged_attention,
    write_kv,
    write_kv_decode,
)

# (num_heads, num_kv_heads, head_dim): MHA, GQA 4:1, SmolLM2's 9:3
HEAD_SHAPES = [(4, 4, 16), (8, 2, 32), (9, 3, 64)]
BLOCK_SIZES = [4, 16]
WINDOWS = [None, 5, 20]
# (query_len, seq_len) per sequence
BATCHES = {
    "decode": [(1, 1), (1, 9), (1, 33), (1, 64), (1, 16)],
    "mixed": [(5, 5), (1, 17), (8, 30), (1, 3), (3, 40), (16, 16)],
}
DTYPES = [torch.float32, torch.bfloat16]
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {  # (atol, rtol)
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (2e-2, 2e-2),
}


def dense_reference(q, k, v, scale, window, softcap=None):
    """q [Lq, H, D] are the last Lq positions of k/v [S, KVH, D]; float32 math."""
    lq, h, _ = q.shape
    s, kvh, _ = k.shape
    q, k, v = q.float(), k.float(), v.float()
    k = k.repeat_interleave(h // kvh, dim=1)
    v = v.repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, Lq, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(s - lq, s)[:, None]
    k_pos = torch.arange(s)[None, :]
    valid = k_pos <= q_pos
    if window is not None:
        valid &= k_pos > q_pos - window
    scores = scores.masked_fill(~valid, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)  # [Lq, H, D]


def make_case(seqs, heads, block_size, window, dtype, seed=0):
    h, kvh, d = heads
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    n_blocks = [math.ceil(s / block_size) for _, s in seqs]
    num_blocks = sum(n_blocks) + 3  # + null block + spare
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(dtype) * 3
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(dtype) * 3
    k_cache[0] = 0  # the null block is never written: zeros, like allocate_kv_cache
    v_cache[0] = 0
    tables, ks, vs, qs = [], [], [], []
    for (q_len, s_len), n in zip(seqs, n_blocks, strict=True):
        table = [ids.pop() for _ in range(n)]
        k = torch.randn(s_len, kvh, d, generator=gen).to(dtype)
        v = torch.randn(s_len, kvh, d, generator=gen).to(dtype)
        # the cached prefix was written by earlier steps
        if s_len > q_len:
            n_cached = s_len - q_len
            cached = AttentionMetadata.build([n_cached], [n_cached], [table], block_size)
            write_kv(k[: s_len - q_len], v[: s_len - q_len], k_cache, v_cache, cached.slot_mapping)
        if window is not None:  # blocks wholly out of every query's window are freed (null)
            first_needed = max(0, s_len - q_len - window + 1) // block_size
            table = [0] * first_needed + table[first_needed:]
        tables.append(table)
        ks.append(k)
        vs.append(v)
        qs.append(torch.randn(q_len, h, d, generator=gen).to(dtype))
    meta = AttentionMetadata.build([q for q, _ in seqs], [s for _, s in seqs], tables, block_size)
    new_k = torch.cat([k[s - q :] for k, (q, s) in zip(ks, seqs, strict=True)])
    new_v = torch.cat([v[s - q :] for v, (q, s) in zip(vs, seqs, strict=True)])
    write_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    return torch.cat(qs), k_cache, v_cache, meta, qs, ks, vs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", HEAD_SHAPES)
def test_paged_attention_matches_dense(heads, block_size, window, batch, dtype):
    seqs = BATCHES[batch]
    q, k_cache, v_cache, meta, qs, ks, vs = make_case(seqs, heads, block_size, window, dtype)
    assert meta.decode_only == (batch == "decode")
    scale = heads[2] ** -0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale, window)
    expected = torch.cat(
        [dense_reference(qb, kb, vb, scale, window) for qb, kb, vb in zip(qs, ks, vs, strict=True)]
    )
    assert out.shape == q.shape and out.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_one_token_rows_of_a_mixed_batch_run_as_a_decode_batch(window, softcap):
    # A decoding sequence must get the same bits whether or not another sequence prefills in
    # the same step: its row of a mixed batch equals the decode-only batch of those rows.
    seqs = BATCHES["mixed"]
    q, k_cache, v_cache, meta, *_ = make_case(seqs, (8, 2, 32), 4, window, torch.float32)
    mixed = paged_attention(q, k_cache, v_cache, meta, 0.3, window, softcap)
    starts = meta.query_start_loc.tolist()
    rows = [b for b, (q_len, _) in enumerate(seqs) if q_len == 1]
    assert len(rows) == 2
    tokens = torch.tensor([starts[b] for b in rows])
    decode_meta = dataclasses.replace(
        meta,
        query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32),
        seq_lens=meta.seq_lens[rows],
        block_tables=meta.block_tables[rows],
        block_tables_list=[meta.block_tables_list[b] for b in rows],
        slot_mapping=meta.slot_mapping[:0],
        query_lens_list=[1] * len(rows),
        seq_lens_list=[seqs[b][1] for b in rows],
        max_seq_len=max(seqs[b][1] for b in rows),
        decode_only=True,
    )
    alone = paged_attention(q[tokens], k_cache, v_cache, decode_meta, 0.3, window, softcap)
    assert torch.equal(mixed[tokens], alone)
    # and the memoized plan is reused, not rebuilt, by the next layer of the same step
    split = meta.mixed_split()
    assert meta.mixed_split() is split and split.decode is not None
    decode_part = split.decode[0]
    plans = dict(decode_part._decode_plans)
    paged_attention(q, k_cache, v_cache, meta, 0.3, window, softcap)
    assert len(plans) == 1
    assert all(decode_part._decode_plans[w] is plan for w, plan in plans.items())


def test_softcap_matches_dense():
    seqs = BATCHES["mixed"]
    q, k_cache, v_cache, meta, qs, ks, vs = make_case(seqs, (4, 2, 16), 4, None, torch.float32)
    out = paged_attention(q, k_cache, v_cache, meta, 0.5, None, softcap=2.0)
    expected = torch.cat(
        [dense_reference(a, b, c, 0.5, None, 2.0) for a, b, c in zip(qs, ks, vs, strict=True)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_write_kv_slots():
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros(4, 2, 1, 3)
    meta = AttentionMetadata.build([3], [3], [[2, 1]], block_size=2)
    assert meta.slot_mapping.tolist() == [4, 5, 2]
    k = torch.arange(1.0, 4.0)[:, None, None].expand(3, 1, 3)
    write_kv(k, -k, k_cache, v_cache, meta.slot_mapping)
    assert k_cache[2, :, 0, 0].tolist() == [1.0, 2.0]
    assert k_cache[1, :, 0, 0].tolist() == [3.0, 0.0]
    assert v_cache[2, 1, 0, 0].item() == -2.0
    assert k_cache[0].abs().sum() == 0 and k_cache[3].abs().sum() == 0


def test_build_metadata():
    meta = AttentionMetadata.build([4, 1], [4, 10], [[3], [5, 6, 7]], block_size=4)
    assert meta.query_start_loc.tolist() == [0, 4, 5]
    assert meta.block_tables.tolist() == [[3, 0, 0], [5, 6, 7]]
    assert meta.slot_mapping.tolist() == [12, 13, 14, 15, 7 * 4 + 1]
    assert meta.max_seq_len == 10 and not meta.decode_only


def make_shared_prefix_case(prefixes, rows, heads, block_size, dtype, seed=1, scatter=False):
    """Decode rows whose block tables start with shared prefix blocks (as the prefix cache
    hands them out). prefixes: {name: number of blocks}; rows: [(prefix name or None, seq_len)];
    `scatter` gives each prefix non-consecutive block ids (descending).
    Returns q, caches, meta, and each row's dense K/V."""
    h, kvh, d = heads
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 1 + sum(prefixes.values()) + sum(math.ceil(s / block_size) for _, s in rows)
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(dtype) * 3
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(dtype) * 3
    next_id = 1
    shared = {}
    for name, n in prefixes.items():  # the prefix blocks hold whatever the pool holds
        shared[name] = list(range(next_id, next_id + n))[:: -1 if scatter else 1]
        next_id += n
    tables, ks, vs = [], [], []
    for name, s_len in rows:
        table = list(shared[name]) if name else []
        while len(table) * block_size < s_len:
            table.append(next_id)
            next_id += 1
        ids = torch.tensor(table)
        ks.append(k_cache[ids].reshape(-1, kvh, d)[:s_len])
        vs.append(v_cache[ids].reshape(-1, kvh, d)[:s_len])
        tables.append(table)
    meta = AttentionMetadata.build([1] * len(rows), [s for _, s in rows], tables, block_size)
    q = torch.randn(len(rows), h, d, generator=gen).to(dtype)
    return q, k_cache, v_cache, meta, ks, vs


@pytest.mark.parametrize("fused", [True, False], ids=["fused-lse", "portable-lse"])
@pytest.mark.parametrize("scatter", [False, True], ids=["consecutive", "scattered"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 20])
def test_shared_prefixes_are_attended_once_and_match_dense(
    dtype, window, scatter, fused, monkeypatch
):
    from kernels import cascade

    monkeypatch.setattr(cascade, "FUSED_CPU_LSE", fused)  # portable: the non-CPU math

    block_size, heads = 4, (9, 3, 16)
    rows = [("de", 14), ("fr", 10), ("de", 13), ("de", 30), ("fr", 9), ("de", 16),
            (None, 7), ("fr", 12), ("fr", 11), ("de", 17), ("fr", 21)]  # fmt: skip
    q, k_cache, v_cache, meta, ks, vs = make_shared_prefix_case(
        {"de": 3, "fr": 2}, rows, heads, block_size, dtype, scatter=scatter
    )
    out = paged_attention(q, k_cache, v_cache, meta, 0.25, window)

    plan = meta._decode_plans[window]
    groups = sorted((g.rows.tolist(), g.blocks.tolist(), g.first_block) for g in plan.shared)
    de, fr = ([3, 2, 1], [5, 4]) if scatter else ([1, 2, 3], [4, 5])
    de_first, fr_first = (None, None) if scatter else (1, 4)  # consecutive ids: a pool slice
    if window is None:
        assert groups == [([0, 2, 3, 5, 9], de, de_first), ([1, 4, 7, 8, 10], fr, fr_first)]
    else:  # rows 3 (30 tokens) and 10 (21) see only part of the prefix: they go the plain way
        assert groups == [([0, 2, 5, 9], de, de_first), ([1, 4, 7, 8], fr, fr_first)]
    expected = torch.cat(
        [dense_reference(q[i : i + 1], ks[i], vs[i], 0.25, window) for i in range(len(rows))]
    )
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)

    monkeypatch.setattr(cascade, "CASCADE_MIN_ROWS", 10**9)  # the plain, gather-all path
    meta._decode_plans.clear()
    plain = paged_attention(q, k_cache, v_cache, meta, 0.25, window)
    assert not meta._decode_plans[window].shared
    torch.testing.assert_close(out, plain, atol=atol, rtol=rtol)


def test_no_cascade_below_min_rows_or_for_a_prefix_a_row_is_still_writing():
    from kernels.cascade import CASCADE_MIN_ROWS

    block_size, heads = 4, (4, 2, 8)
    few = [("de", 10)] * (CASCADE_MIN_ROWS - 1) + [(None, 6)]
    q, kc, vc, meta, *_ = make_shared_prefix_case({"de": 2}, few, heads, block_size, torch.float32)
    paged_attention(q, kc, vc, meta, 0.3, None)
    assert meta._decode_plans[None].shared == []
    # only blocks wholly before every member's query are shared: a row of 9 tokens has its
    # query at position 8, inside the third prefix block, so the group shares blocks 0-1
    rows = [("de", 9)] + [("de", 20)] * CASCADE_MIN_ROWS
    q, kc, vc, meta, *_ = make_shared_prefix_case({"de": 3}, rows, heads, block_size, torch.float32)
    paged_attention(q, kc, vc, meta, 0.3, None)
    (group,) = meta._decode_plans[None].shared
    assert group.blocks.tolist() == [1, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("scatter", [False, True], ids=["consecutive", "scattered"])
def test_cascade_on_cuda_matches_dense_cpu_reference(dtype, window, scatter):
    rows = [("de", 14), ("fr", 10), ("de", 13), ("de", 30), ("fr", 9), ("de", 16),
            (None, 7), ("fr", 12), ("fr", 11), ("de", 17), ("fr", 21)]  # fmt: skip
    q, kc, vc, meta, ks, vs = make_shared_prefix_case(
        {"de": 3, "fr": 2}, rows, (9, 3, 16), 4, dtype, scatter=scatter
    )
    on_gpu = AttentionMetadata.build(
        meta.query_lens_list, meta.seq_lens_list, meta.block_tables_list, 4, "cuda"
    )
    out = paged_attention(q.cuda(), kc.cuda(), vc.cuda(), on_gpu, 0.25, window)
    assert len(on_gpu._decode_plans[window].shared) == 2
    expected = torch.cat(
        [dense_reference(q[i : i + 1], ks[i], vs[i], 0.25, window) for i in range(len(rows))]
    )
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("impl", ["cpp", "torch"])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", HEAD_SHAPES)
def test_decode_batch_attention_matches_dense(heads, block_size, window, softcap, impl):
    # The compiled decode graphs' path: DecodeBatch (tensors only), write_kv_decode, and
    # decode_attention (the C++ op reading the pool in place, or the torch reference), on the
    # same paged pool and tables as the eager path.
    if impl == "cpp":
        assert cpu_ops.load(), cpu_ops.error()
    seqs = BATCHES["decode"]
    q, k_cache, v_cache, meta, qs, ks, vs = make_case(
        seqs, heads, block_size, window, torch.float32
    )
    positions = [s - 1 for _, s in seqs]
    batch = DecodeBatch.build(positions, meta.block_tables_list, block_size, window)
    assert batch.blocks.shape[1] >= 2  # no size-1 dim to specialize a compiled graph on
    # writing the new tokens again through write_kv_decode lands on the same slots
    new_k = torch.stack([k[-1] for k in ks])
    new_v = torch.stack([v[-1] for v in vs])
    k_again, v_again = k_cache.clone(), v_cache.clone()
    write_kv_decode(new_k * 0, new_v * 0, k_again, v_again, batch)
    changed = (k_again != k_cache).any(dim=(2, 3)).nonzero().tolist()
    assert sorted(map(tuple, changed)) == sorted(
        (int(b), int(o)) for b, o in zip(batch.slot_blocks, batch.slot_offsets, strict=True)
    )
    scale = heads[2] ** -0.5
    attend = decode_attention if impl == "cpp" else decode_attention_reference
    out = attend(q, k_cache, v_cache, batch, scale, softcap)
    expected = torch.cat(
        [
            dense_reference(qb, kb, vb, scale, window, softcap)
            for qb, kb, vb in zip(qs, ks, vs, strict=True)
        ]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("seqs", [[(1, 300)], [(1, 1), (1, 257)]], ids=["one", "two"])
def test_decode_attention_split_over_positions_matches_dense(seqs, window, threads):
    # Fewer (row, KV head) tasks than threads: the C++ op splits each task's positions into
    # chunks (one per thread, >= 64 positions each) and merges them; 1 thread never splits, and
    # a row shorter than a chunk (the 1-position row) is split into empty chunks.
    assert cpu_ops.load(), cpu_ops.error()
    heads = (4, 1, 32)  # Gemma 3 270M's layout: one KV head
    q, k_cache, v_cache, meta, qs, ks, vs = make_case(seqs, heads, 16, window, torch.float32)
    batch = DecodeBatch.build([s - 1 for _, s in seqs], meta.block_tables_list, 16, window)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = decode_attention(q, k_cache, v_cache, batch, 32**-0.5, 5.0)
    finally:
        torch.set_num_threads(before)
    expected = torch.cat(
        [
            dense_reference(qb, kb, vb, 32**-0.5, window, 5.0)
            for qb, kb, vb in zip(qs, ks, vs, strict=True)
        ]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_decode_batch_build_blocks_and_mask():
    # block_size 4, window 6: position 9 sees 4..9, so it reads blocks from index 1 on
    batch = DecodeBatch.build([9, 2], [[5, 6, 7], [8]], block_size=4, window=6)
    assert batch.blocks.tolist() == [[6, 7], [8, 0]]
    assert batch.slot_blocks.tolist() == [7, 8] and batch.slot_offsets.tolist() == [1, 2]
    assert batch.valid[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]  # positions 4..9
    assert batch.valid[1].nonzero().flatten().tolist() == [0, 1, 2]
