"""Paged attention: the torch reference op over a block-major KV cache.

The KV cache of one layer is a pool of fixed-size blocks, `[num_blocks, block_size, KVH, D]`
(block-major, then sequence-major inside a block). A sequence owns a list of block ids (its row
of `block_tables`); the token at absolute position `p` lives in block `block_table[p //
block_size]` at offset `p % block_size`. Block 0 of every pool is a reserved null block: padding
and out-of-window entries of a block table point at it and are masked anyway.

One engine step runs a flattened, variable-length batch (vLLM v1 style): the new tokens of every
sequence concatenated into `[T, ...]`, each sequence contributing `query_len` tokens (a chunk of
its prompt, or one decode token). `AttentionMetadata` describes that batch for one KV group
("full" or "sliding"); the model writes the new tokens' K/V at `slot_mapping` first, then
attends over the paged cache, which now holds the cached prefix and the new tokens alike.

Masking: new token `i` of sequence `b` sits at position `seq_len_b - query_len_b + i`; it sees
positions `p <= own` and, with a sliding window `W`, `p > own - W` (Hugging Face's convention).

Two paths:
- decode-only batches (every query_len == 1, the steady state): one batched gather of the blocks
  each sequence can see, `k_cache[blocks] -> [B, L, KVH, D]`, and one masked attention call
  over the whole batch. For the sliding group only the blocks that can hold in-window positions
  are gathered. On the CPU the gather (a copy) dominates: ~6 of ~9 ms for B=32, 300-token
  contexts, SmolLM2 shapes; a device kernel reads the blocks in place instead.
  Cascade: when `CASCADE_MIN_ROWS` or more decoding rows start with the same blocks (a warm
  language prompt handed out by the prefix cache), their attention over those blocks runs once
  for all of them as one matmul per KV head, read in place from the pool when the ids are
  consecutive; each row gathers only what follows, and the two softmax parts are merged by
  their log-sum-exps. SmolLM2, B=32, 435-token shared prefix: a decode step 225 -> 91 ms.
- prefill / mixed batches: the one-token rows (sequences decoding beside a newcomer's prefill
  chunk, the steady state of continuous batching) go through the batched decode path above; the
  multi-token chunks loop over sequences with `F.scaled_dot_product_attention` and an explicit
  boolean mask (a manual softmax path when logits are soft-capped). A sequence's decode step
  thus runs the same kernel whether or not another sequence is prefilling.

- compiled decode steps (`workers/engine/compiled.py`): `DecodeBatch` (tensors only, no python
  lists to guard on), `write_kv_decode` and `decode_attention` (on the CPU the C++ op
  `tolk::decode_attention`, reading the pool in place) live in `kernels/decode_batch.py` and are
  re-exported here.

Everything derived from the metadata alone (the decode path's block ids and mask, the mixed
split) is built by the first layer that needs it and memoized on the step's metadata.

Where things are: `AttentionMetadata`, the memoized plans and `gather_blocks` are
`kernels/attention_metadata.py` (re-exported here); the decode plan and the cascade (which rows
share a prefix, the merge by log-sum-exp) `kernels/cascade.py`; this module keeps the op, its
decode, mixed and prefill paths and `write_kv`.

Softmax runs in float32 as Hugging Face's eager attention does. This module is a leaf: it
imports torch and `kernels.decode_batch`, `kernels.attention_metadata` and `kernels.cascade`
only. A faster version of an op (C++ here; a GPU kernel later) keeps its signature and is
chosen inside the op by device and dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import cascade
from kernels.attention_metadata import AttentionMetadata, gather_blocks
from kernels.decode_batch import (
    DecodeBatch,
    decode_attention,
    decode_attention_reference,
    write_kv_decode,
)

# re-exported: the metadata and gather (kernels/attention_metadata.py) and the compiled decode
# step's names (kernels/decode_batch.py), so every caller of the op imports one module
__all__ = [
    "AttentionMetadata",
    "DecodeBatch",
    "decode_attention",
    "decode_attention_reference",
    "gather_blocks",
    "paged_attention",
    "write_kv",
    "write_kv_decode",
]


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter the new tokens' K/V into the paged cache (in place)."""
    # k, v: [T, KVH, D]; caches: [NB, BS, KVH, D] viewed as [NB * BS, KVH, D]
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
) -> Tensor:
    """Attention of the new tokens over the paged cache. q [T, H, D] -> [T, H, D]."""
    if meta.decode_only:
        return _decode_attention(q, k_cache, v_cache, meta, scale, sliding_window, softcap)
    return _varlen_attention(q, k_cache, v_cache, meta, scale, sliding_window, softcap)


def _decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> Tensor:
    b, h, d = q.shape  # one query per sequence: T == B
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    groups = h // kvh
    plan = meta._decode_plans.get(window)
    if plan is None:
        plan = meta._decode_plans[window] = cascade.decode_plan(
            meta, block_size, window, cascade=softcap is None
        )
    k = gather_blocks(k_cache, plan.blocks).view(b, -1, kvh, d)  # [B, L, KVH, D]
    v = gather_blocks(v_cache, plan.blocks).view(b, -1, kvh, d)  # [B, L, KVH, D]
    if plan.shared:
        return cascade.cascade_attention(q, k, v, k_cache, v_cache, plan, scale)

    if softcap is None:  # fused CPU/GPU kernel, mask broadcast over heads
        out = F.scaled_dot_product_attention(
            q[:, :, None, :],  # [B, H, 1, D]
            k.transpose(1, 2),  # [B, KVH, L, D]
            v.transpose(1, 2),
            attn_mask=plan.valid[:, None, None, :],  # [B, 1, 1, L]
            scale=scale,
            enable_gqa=True,
        )  # [B, H, 1, D]
        return out.view(b, h, d)
    qg = q.view(b, kvh, groups, d)  # [B, KVH, G, D]
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)) * scale  # [B, KVH, G, L]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~plan.valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [B, KVH, G, L]
    out = torch.matmul(probs, v.permute(0, 2, 1, 3))  # [B, KVH, G, D]
    return out.reshape(b, h, d)


def _varlen_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> Tensor:
    _, h, d = q.shape
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    split = meta.mixed_split()
    if split.decode is not None:
        # one-token rows (decoding sequences beside a newcomer's prefill chunk): one batched
        # call, the same kernel as in decode-only steps
        decode_meta, tokens = split.decode
        out[tokens] = _decode_attention(
            q.index_select(0, tokens), k_cache, v_cache, decode_meta, scale, window, softcap
        )
    for b, start, q_len, s_len in split.prefill:
        first_pos = 0 if window is None else max(0, s_len - q_len - window + 1)
        first_block, end_block = first_pos // block_size, -(-s_len // block_size)
        blocks = meta.block_tables[b, first_block:end_block].long()  # [n]
        k = gather_blocks(k_cache, blocks).view(-1, kvh, d)  # [S, KVH, D] from first_block * bs
        v = gather_blocks(v_cache, blocks).view(-1, kvh, d)
        k_pos = torch.arange(first_block * block_size, end_block * block_size, device=q.device)
        q_pos = torch.arange(s_len - q_len, s_len, device=q.device)
        valid = k_pos[None, :] <= q_pos[:, None]  # [Lq, S]
        if window is not None:
            valid &= k_pos[None, :] > q_pos[:, None] - window
        qs = q[start : start + q_len].transpose(0, 1)  # [H, Lq, D]
        out[start : start + q_len] = _dense_attention(
            qs, k.transpose(0, 1), v.transpose(0, 1), valid, scale, softcap
        ).transpose(0, 1)
    return out


def _dense_attention(
    q: Tensor, k: Tensor, v: Tensor, valid: Tensor, scale: float, softcap: float | None
) -> Tensor:
    """q [H, Lq, D], k/v [KVH, S, D], valid [Lq, S] -> [H, Lq, D]."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=valid, scale=scale, enable_gqa=True
        )[0]
    groups = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(groups, dim=0)  # [H, S, D]
    v = v.repeat_interleave(groups, dim=0)
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, Lq, S]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
