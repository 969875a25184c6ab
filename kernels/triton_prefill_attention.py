"""Varlen prefill attention in Triton over the paged cache: prefill and decode rows in one launch.

The prefill/mixed half of `kernels/triton_attention.py` (whose `triton_paged_attention` calls
`varlen_paged_attention` for every step that is not decode-only), over the same block-major
pool `[num_blocks, block_size, KVH, D]` and with the same rules: a sequence's position `p` lives
in block `block_tables[b, p // block_size]` at offset `p % block_size`, block 0 is the null
block, and the query at position `p` sees positions `<= p` and, with a sliding window `W`,
`> p - W`.

- `varlen_paged_attention`: a flattened varlen batch (prefill chunks and decode rows mixed) in
  one launch, one program per (sequence, query head, tile of `BLOCK_M` queries), causal and
  windowed masks from positions. It replaces the reference's per-sequence SDPA loop (one
  gather and one SDPA call per prefilling sequence); for long single prompts SDPA's flash
  kernel over a contiguous copy is as fast, but a step's many short chunks are one launch here.

Numerics as in `kernels/triton_attention.py`; the jit helpers both use (`_dot`: the dtype of
`tl.dot` on a GPU and under the interpreter, `_softcap`, `_softmax_tile`: one key tile of the
online softmax) and the host checks are in `kernels/triton_common.py`; its torch reference is
`kernels.attention.paged_attention`.

A leaf: torch, triton and `kernels.triton_common`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_common import _check, _dot, _dot_dtypes, _softcap, _softmax_tile

__all__ = ["BLOCK_M_PREFILL", "BLOCK_N_PREFILL", "varlen_paged_attention"]

BLOCK_M_PREFILL = 32  # queries per program
BLOCK_N_PREFILL = 32  # key positions per loop iteration


@triton.jit
def _varlen_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
    scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_bt,
    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_LOW: tl.constexpr, LOW: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    tile = tl.program_id(2)
    kh = h // G
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    q_pos = seq_len - q_len + offs_m  # [BLOCK_M] absolute positions of the queries
    first_q = seq_len - q_len + tile * BLOCK_M
    lo = first_q * 0
    if WINDOW > 0:
        lo = tl.maximum(first_q - WINDOW + 1, 0)
    # keys up to the tile's last query; an empty tile (past this sequence's queries) loops 0 times
    hi = tl.where(tile * BLOCK_M < q_len, tl.minimum(first_q + BLOCK_M, seq_len), lo)

    q_rows = (q_start + offs_m).to(tl.int64) * stride_qt + h * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=m_mask[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        p_mask = pos < hi
        blk = tl.load(bt_ptr + b * stride_bt + pos // BS, mask=p_mask, other=0).to(tl.int64)
        base = blk * stride_kb + (pos % BS) * stride_ks + kh * stride_kh
        k = tl.load(k_ptr + base[:, None] + offs_d[None, :], mask=p_mask[:, None], other=0.0)
        s = _dot(q, tl.trans(k), DOT_LOW, LOW) * scale  # [BLOCK_M, BLOCK_N]
        s = _softcap(s, SOFTCAP)
        seen = (pos[None, :] <= q_pos[:, None]) & p_mask[None, :] & m_mask[:, None]
        if WINDOW > 0:
            seen &= pos[None, :] > q_pos[:, None] - WINDOW
        s = tl.where(seen, s, float("-inf"))
        v = tl.load(v_ptr + base[:, None] + offs_d[None, :], mask=p_mask[:, None], other=0.0)
        m_i, l_i, acc = _softmax_tile(s, v, m_i, l_i, acc, DOT_LOW, LOW)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None])  # fmt: skip


def varlen_paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Attention of a flattened varlen batch over the paged cache. q [T, H, D] -> [T, H, D].

    Sequence `b`'s queries are `q[query_start_loc[b]:query_start_loc[b + 1]]`, the last ones of
    its `seq_lens[b]` positions (their K/V written already); `max_query_len` sizes the grid."""
    _check(q, k_cache)
    t, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    out = torch.empty_like(q)
    b = seq_lens.shape[0]
    if t == 0 or b == 0:
        return out
    dot_low, low = _dot_dtypes(k_cache)
    grid = (b, h, triton.cdiv(max_query_len, BLOCK_M_PREFILL))
    _varlen_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        G=h // kvh, D=d, BS=bs, BLOCK_M=BLOCK_M_PREFILL, BLOCK_N=BLOCK_N_PREFILL,
        WINDOW=sliding_window or 0, SOFTCAP=float(softcap or 0.0),
        DOT_LOW=dot_low, LOW=low,
    )  # fmt: skip
    return out
