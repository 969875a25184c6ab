"""Paged attention in Triton: decode (split-KV, cascade) and varlen prefill over the paged cache.

The same op as `kernels/attention.py`'s `paged_attention` (its torch reference), over the same
block-major pool `[num_blocks, block_size, KVH, D]`: a sequence's position `p` lives in block
`block_tables[b, p // block_size]` at offset `p % block_size`, block 0 is the null block, and
the query at position `p` sees positions `<= p` and, with a sliding window `W`, `> p - W`.
Softmax runs in float32; the kernels read the pool in place (no gather of whole blocks, which
is what the torch reference spends its time on).

- `paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, ...)`: one query per
  row, tensors only (the CUDA-graph decode step, `workers/engine/cuda_graphs.py`, captures it
  with its static buffers). One program per (row, KV head, split): the `G` query heads of a KV
  head are one `[G, D]` tile (padded to 16 rows for `tl.dot`), so each K/V tile is read once
  for the whole group (grouped-query attention). The context is cut into `num_splits` ranges
  (flash-decoding) so that small batches still fill the device; each split leaves its partial
  output and log-sum-exp, and `_merge_kernel` combines them. The loop starts at the window's
  first position, so a sliding layer reads only its window.
- Cascade (shared prefix): rows whose block tables start with the same full blocks (a warm
  language prompt, the rule of `kernels.cascade.shared_prefixes`) attend to those blocks
  once together: `_prefix_kernel` stacks the rows' query heads of one KV head into the M
  dimension of one tile and reads each prefix K/V tile once per KV head for all of them; the
  decode kernel then starts those rows after the prefix, and the merge adds the prefix part by
  its log-sum-exp (`out = sum_i out_i * exp(lse_i - lse)`), as the reference's cascade does.
- `triton_paged_attention(q, k_cache, v_cache, meta, scale, sliding_window, softcap)`: the
  reference's signature, choosing the decode path (with cascade) or the varlen prefill kernel
  (`varlen_paged_attention`, in `kernels/triton_prefill_attention.py`; the jit helpers
  `_dot` / `_softcap` / `_softmax_tile` and the host checks both use are in
  `kernels/triton_common.py`).

Numerics: scores, softmax and accumulation in float32. On a GPU, bfloat16/float16 pools feed
`tl.dot` in their own dtype (tensor cores) with the probabilities rounded to it, as flash
attention does; float32 pools use `input_precision="ieee"` (no TF32), so float32 matches the
reference up to summation order. Soft-capped logits (`tanh(s / c) * c`) use `2 sigmoid(2x) - 1`.
Under `TRITON_INTERPRET=1` (CPU tests) every `tl.dot` runs on float32 operands: the
interpreter's bfloat16 dot is wrong (raw bits); loads and casts of bfloat16 are right.

A leaf: torch, triton, `kernels.attention` (the metadata and the cascade rule),
`kernels.triton_common` and, for the varlen path, `kernels.triton_prefill_attention`. Triton
reads `TRITON_INTERPRET` when the kernels are decorated, i.e. when these modules are imported;
`kernels.triton_common.INTERPRETED` records what it got (tests run the
kernels in a child process under the interpreter, `tests/kernels/triton_interpreter.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.attention_metadata import AttentionMetadata
from kernels.cascade import shared_prefixes
from kernels.triton_common import (
    _check,
    _dot,
    _dot_dtypes,
    _softcap,
    _softmax_tile,
)
from kernels.triton_prefill_attention import varlen_paged_attention

# (rows, block ids) of one shared prefix: the rows' block tables all start with these blocks
SharedPrefix = tuple[Sequence[int], Sequence[int]]

BLOCK_N_DECODE = 32  # key positions per loop iteration (decode)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, start_ptr, out_ptr, po_ptr, plse_ptr,
    scale,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_bt,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    SPLITS: tl.constexpr, PARTIAL: tl.constexpr, HAS_START: tl.constexpr,
    DOT_LOW: tl.constexpr, LOW: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    heads = kh * G + offs_g  # [BLOCK_G]

    seq_len = tl.load(seq_lens_ptr + b)
    lo = seq_len * 0
    if HAS_START:  # cascade rows start after their shared prefix
        lo = tl.load(start_ptr + b)
    if WINDOW > 0:  # the query at seq_len - 1 sees positions > seq_len - 1 - WINDOW
        lo = tl.maximum(lo, seq_len - WINDOW)
    span = tl.maximum(seq_len - lo, 0)
    chunk = tl.cdiv(tl.cdiv(span, SPLITS), BLOCK_N) * BLOCK_N
    s_lo = lo + split * chunk
    s_hi = tl.minimum(seq_len, s_lo + chunk)

    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    )  # [BLOCK_G, D]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for start in range(s_lo, s_hi, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N] absolute positions
        p_mask = pos < s_hi
        blk = tl.load(bt_ptr + b * stride_bt + pos // BS, mask=p_mask, other=0).to(tl.int64)
        base = blk * stride_kb + (pos % BS) * stride_ks + kh * stride_kh  # [BLOCK_N]
        k = tl.load(k_ptr + base[:, None] + offs_d[None, :], mask=p_mask[:, None], other=0.0)
        s = _dot(q, tl.trans(k), DOT_LOW, LOW) * scale  # [BLOCK_G, BLOCK_N]
        s = _softcap(s, SOFTCAP)
        s = tl.where(p_mask[None, :], s, float("-inf"))
        v = tl.load(v_ptr + base[:, None] + offs_d[None, :], mask=p_mask[:, None], other=0.0)
        m_i, l_i, acc = _softmax_tile(s, v, m_i, l_i, acc, DOT_LOW, LOW)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if PARTIAL:  # this split's output and log-sum-exp, merged by _merge_kernel
        lse = tl.where(l_i > 0.0, m_i + tl.log(l_safe), float("-inf"))
        row = (b * tl.num_programs(1) * G + heads) * SPLITS + split  # [B, H, SPLITS]
        tl.store(po_ptr + row[:, None] * D + offs_d[None, :], o, mask=g_mask[:, None])
        tl.store(plse_ptr + row, lse, mask=g_mask)
    else:
        out = out_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit
def _prefix_kernel(
    q_ptr, k_ptr, v_ptr, rows_ptr, blocks_ptr, po_ptr, plse_ptr,
    scale, num_m, num_pos,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_LOW: tl.constexpr, LOW: tl.constexpr,
):  # fmt: skip
    """Attention of R rows x G query heads of one KV head over a shared prefix of `num_pos`
    positions (every one visible to every row): each K/V tile is read once for all of them."""
    kh = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # r * G + g
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < num_m
    row = tl.load(rows_ptr + offs_m // G, mask=m_mask, other=0)
    head = kh * G + offs_m % G
    q = tl.load(
        q_ptr + row[:, None] * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
        mask=m_mask[:, None],
        other=0.0,
    )  # [BLOCK_M, D]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(0, num_pos, BLOCK_N):
        pos = start + offs_n
        p_mask = pos < num_pos
        blk = tl.load(blocks_ptr + pos // BS, mask=p_mask, other=0).to(tl.int64)
        base = blk * stride_kb + (pos % BS) * stride_ks + kh * stride_kh
        k = tl.load(k_ptr + base[:, None] + offs_d[None, :], mask=p_mask[:, None], other=0.0)
        s = _dot(q, tl.trans(k), DOT_LOW, LOW) * scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(p_mask[None, :], s, float("-inf"))
        v = tl.load(v_ptr + base[:, None] + offs_d[None, :], mask=p_mask[:, None], other=0.0)
        m_i, l_i, acc = _softmax_tile(s, v, m_i, l_i, acc, DOT_LOW, LOW)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    lse = tl.where(l_i > 0.0, m_i + tl.log(l_safe), float("-inf"))
    flat = row * H + head  # [B, H]
    tl.store(po_ptr + flat[:, None] * D + offs_d[None, :], acc / l_safe[:, None],
             mask=m_mask[:, None])  # fmt: skip
    tl.store(plse_ptr + flat, lse, mask=m_mask)


@triton.jit
def _merge_kernel(
    po_ptr, plse_ptr, pre_o_ptr, pre_lse_ptr, out_ptr,
    stride_ob, stride_oh,
    H: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
):  # fmt: skip
    """out[b, h] = sum_i o_i * exp(lse_i - lse) over the splits (and the shared prefix)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    s_mask = offs_s < SPLITS
    row = (b * H + h) * SPLITS + offs_s
    lse = tl.load(plse_ptr + row, mask=s_mask, other=float("-inf"))  # [BLOCK_S]
    o = tl.load(po_ptr + row[:, None] * D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    m = tl.max(lse, 0)
    if HAS_PREFIX:
        lse_p = tl.load(pre_lse_ptr + b * H + h)
        m = tl.maximum(m, lse_p)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_use)  # [BLOCK_S]
    total = tl.sum(w, 0)
    acc = tl.sum(o * w[:, None], 0)  # [D]
    if HAS_PREFIX:
        w_p = tl.exp(lse_p - m_use)
        total += w_p
        acc += tl.load(pre_o_ptr + (b * H + h) * D + offs_d) * w_p
    acc = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, acc.to(out_ptr.dtype.element_ty))


# -- host side --------------------------------------------------------------------------------


def default_num_splits(batch: int, kv_heads: int, max_context: int, device: torch.device) -> int:
    """Splits of the context so that about two programs per SM run (flash-decoding), at least
    256 positions per split; 1 on the CPU."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(2 * sms, max(1, batch * kv_heads))
    return max(1, min(want, 32, triton.cdiv(max_context, 256)))


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int = 1,
    shared: Sequence[SharedPrefix] = (),
) -> Tensor:
    """One query per row over its paged context. q [B, H, D] -> [B, H, D] in q's dtype.

    `block_tables` [B, max_blocks] int32, `seq_lens` [B] int32 (the context length including
    the query's own token, whose K/V is in the pool already). `num_splits` ranges of the
    context per row are attended separately and merged (fixed per call: a CUDA graph captures
    it). `shared`: (rows, block ids) of prefixes attended once for all their rows (cascade);
    the caller guarantees the blocks lie wholly before each row's query and inside its window.
    """
    _check(q, k_cache)
    b, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    g = h // kvh
    out = torch.empty_like(q)
    if b == 0:
        return out
    dot_low, low = _dot_dtypes(k_cache)
    window = sliding_window or 0
    cap = float(softcap or 0.0)
    starts = seq_lens  # unused unless cascade
    pre_o = pre_lse = None
    if shared:
        starts = torch.zeros(b, dtype=torch.int32, device=q.device)
        pre_o = torch.zeros(b, h, d, dtype=torch.float32, device=q.device)
        pre_lse = torch.full((b, h), float("-inf"), dtype=torch.float32, device=q.device)
        block_m = 16
        for rows, blocks in shared:
            rows_t = torch.tensor(list(rows), dtype=torch.int32, device=q.device)
            blocks_t = torch.tensor(list(blocks), dtype=torch.int32, device=q.device)
            starts[rows_t.long()] = len(blocks) * bs
            num_m = len(rows) * g
            _prefix_kernel[(kvh, triton.cdiv(num_m, block_m))](
                q, k_cache, v_cache, rows_t, blocks_t, pre_o, pre_lse,
                scale, num_m, len(blocks) * bs,
                q.stride(0), q.stride(1),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                H=h, G=g, D=d, BS=bs, BLOCK_M=block_m, BLOCK_N=BLOCK_N_DECODE,
                DOT_LOW=dot_low, LOW=low,
            )  # fmt: skip
    splits = max(1, num_splits)
    partial = splits > 1 or bool(shared)
    po = plse = out  # placeholders when the kernel writes `out` directly
    if partial:
        po = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
        plse = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(b, kvh, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, starts, out, po, plse,
        scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, BS=bs,
        BLOCK_N=BLOCK_N_DECODE, WINDOW=window, SOFTCAP=cap,
        SPLITS=splits, PARTIAL=partial, HAS_START=bool(shared),
        DOT_LOW=dot_low, LOW=low,
    )  # fmt: skip
    if partial:
        _merge_kernel[(b, h)](
            po, plse, pre_o if pre_o is not None else po, pre_lse if pre_lse is not None else plse,
            out,
            out.stride(0), out.stride(1),
            H=h, D=d, SPLITS=splits, BLOCK_S=max(2, triton.next_power_of_2(splits)),
            HAS_PREFIX=bool(shared),
        )  # fmt: skip
    return out


def triton_paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
) -> Tensor:
    """`kernels.attention.paged_attention` in Triton: the same signature and function.

    Decode-only steps run `paged_decode_attention` with the reference's cascade rule (rows
    sharing a prefix, not with soft-capped logits, which the reference keeps on the plain
    path); prefill and mixed steps run `varlen_paged_attention` in one launch."""
    bs = k_cache.shape[1]
    if meta.decode_only:
        shared: list[SharedPrefix] = []
        if softcap is None:
            for n_blocks, rows in shared_prefixes(meta, bs, sliding_window):
                shared.append((rows, meta.block_tables_list[rows[0]][:n_blocks]))
        splits = default_num_splits(q.shape[0], k_cache.shape[2], meta.max_seq_len, q.device)
        return paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, sliding_window,
            softcap, num_splits=splits, shared=shared,
        )  # fmt: skip
    return varlen_paged_attention(
        q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
        max(meta.query_lens_list, default=1), scale, sliding_window, softcap,
    )  # fmt: skip


def paged_decode_attention_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int = 1,
    shared: Sequence[SharedPrefix] = (),
) -> Tensor:
    """`paged_decode_attention` through the torch reference op (`kernels.attention.
    paged_attention` on a decode-only `AttentionMetadata`); `num_splits` and `shared` change
    only how the kernel computes, not the function, and are ignored here."""
    from kernels.attention import paged_attention

    lens = [int(s) for s in seq_lens.tolist()]
    bs = k_cache.shape[1]
    tables = [row[: -(-s // bs)] for row, s in zip(block_tables.tolist(), lens, strict=True)]
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, bs, q.device)
    return paged_attention(q, k_cache, v_cache, meta, scale, sliding_window, softcap)


@dataclass
class PagedDecodeBatch:
    """A decode-only step for one KV group as fixed-shape tensors, for `paged_decode_attention`
    inside a captured CUDA graph (`workers/engine/cuda_graphs.py` fills them from its static
    buffers; padded rows have position 0 and an all-null table, so they read and write only
    slot 0 of the null block)."""

    block_tables: Tensor  # [B, max_blocks] int32 (0 = null block)
    seq_lens: Tensor  # [B] int32: context length including the new token
    slot_mapping: Tensor  # [B] int64: block_id * block_size + offset of the new token's K/V
    num_splits: int = 1  # fixed per captured graph
