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

Softmax runs in float32 as Hugging Face's eager attention does. This module is a leaf: it imports
torch and `kernels.decode_batch` only. A faster version of an op (C++ here; a GPU kernel later)
keeps its signature and is chosen inside the op by device and dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.decode_batch import (
    DecodeBatch,
    decode_attention,
    decode_attention_reference,
    write_kv_decode,
)

__all__ = [  # the compiled decode step's names are kernels/decode_batch.py's, re-exported
    "AttentionMetadata",
    "DecodeBatch",
    "decode_attention",
    "decode_attention_reference",
    "gather_blocks",
    "paged_attention",
    "write_kv",
    "write_kv_decode",
]


@dataclass
class AttentionMetadata:
    """How one step's flattened batch maps onto one KV group's paged cache."""

    query_start_loc: Tensor  # [B+1] int32: start of each sequence's new tokens in the flat batch
    seq_lens: Tensor  # [B] int32: context length after this step (cached + new tokens)
    block_tables: Tensor  # [B, max_blocks] int32 block ids of this group (0 = null/padding)
    slot_mapping: Tensor  # [T] int64: block_id * block_size + offset of each new token's K/V
    query_lens_list: list[int]  # python copies, so the CPU path needs no .tolist() syncs
    seq_lens_list: list[int]
    max_seq_len: int
    decode_only: bool  # every query_len == 1 (fast batched path)
    block_tables_list: list[list[int]] = field(default_factory=list)  # python copy (cascade)
    # Per-step memo of the decode path's plan (block ids, mask, shared prefixes) per window:
    # every layer of the group sees the same batch, so only the first one builds it (~10 small
    # ops per layer saved). Keyed by the sliding window (None = full attention).
    _decode_plans: dict[int | None, _DecodePlan] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _split: _MixedSplit | None = field(default=None, init=False, repr=False, compare=False)

    def mixed_split(self) -> _MixedSplit:
        """A mixed batch split into its one-token rows (run batched, as a decode-only batch)
        and its multi-token prefill chunks (run one by one); memoized for the step."""
        if self._split is None:
            self._split = _MixedSplit.of(self)
        return self._split

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata from python lists (tests, simple drivers). Rows are padded with block 0."""
        assert len(query_lens) == len(seq_lens) == len(block_tables)
        starts = [0]
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            assert 0 < q_len <= s_len, (q_len, s_len)
            starts.append(starts[-1] + q_len)
            for pos in range(s_len - q_len, s_len):
                block = table[pos // block_size]
                assert block != 0, f"new token at position {pos} maps to the null block"
                slots.append(block * block_size + pos % block_size)
        width = max(1, max((len(t) for t in block_tables), default=1))
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).view(
                len(padded), width
            ),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
            max_seq_len=max(seq_lens, default=0),
            decode_only=all(q == 1 for q in query_lens),
            block_tables_list=[list(t) for t in block_tables],
        )


@dataclass
class _MixedSplit:
    # the one-token rows as a decode-only batch, and their positions [Bd] in the flat batch
    decode: tuple[AttentionMetadata, Tensor] | None
    prefill: list[tuple[int, int, int, int]]  # (row, first flat token, query_len, seq_len)

    @classmethod
    def of(cls, meta: AttentionMetadata) -> _MixedSplit:
        rows: list[int] = []
        tokens: list[int] = []
        prefill: list[tuple[int, int, int, int]] = []
        start = 0
        for b, (q_len, s_len) in enumerate(
            zip(meta.query_lens_list, meta.seq_lens_list, strict=True)
        ):
            if q_len == 1:
                rows.append(b)
                tokens.append(start)
            elif q_len > 1:
                prefill.append((b, start, q_len, s_len))
            start += q_len
        if not rows:
            return cls(None, prefill)
        device = meta.block_tables.device
        index = torch.tensor(rows, dtype=torch.long, device=device)
        lens = [meta.seq_lens_list[b] for b in rows]
        decode = AttentionMetadata(
            query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32, device=device),
            seq_lens=meta.seq_lens.index_select(0, index),
            block_tables=meta.block_tables.index_select(0, index),
            slot_mapping=meta.slot_mapping[:0],
            query_lens_list=[1] * len(rows),
            seq_lens_list=lens,
            max_seq_len=max(lens),
            decode_only=True,
            block_tables_list=[meta.block_tables_list[b] for b in rows]
            if meta.block_tables_list
            else [],
        )
        return cls((decode, torch.tensor(tokens, dtype=torch.long, device=device)), prefill)


def gather_blocks(cache: Tensor, blocks: Tensor) -> Tensor:
    """`cache[blocks]` for a pool [N, BS, KVH, D] and block ids of any shape -> [*blocks, BS, KVH,
    D], as one `index_select` of whole blocks: advanced indexing computes an offset per element
    and ran 2-3x slower for the decode gathers (one thread, EPYC Zen 4: B=8 x 20 blocks 211 ->
    61 us)."""
    return cache.index_select(0, blocks.reshape(-1)).view(*blocks.shape, *cache.shape[1:])


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


CASCADE_MIN_ROWS = 4  # rows that must share a prefix before it is attended to once for all
FUSED_CPU_LSE = True  # CPU: SDPA's fused kernel, which returns the log-sum-exp too (tests: off)


@dataclass
class _SharedPrefix:
    """Decode rows whose block tables start with the same full blocks (a warm language prompt
    served from the prefix cache): their attention over those blocks runs as one matmul."""

    rows: Tensor  # [R] long: batch rows
    blocks: Tensor  # [n] long: the shared block ids (positions 0 .. n * block_size - 1)
    first_block: int | None  # set when the ids are consecutive: the pool is sliced, not copied


@dataclass
class _DecodePlan:
    blocks: Tensor  # [B, n] block ids each row gathers (after its shared prefix, if any)
    valid: Tensor  # [B, n * block_size] bool: which gathered positions the row's query sees
    n_blocks: int
    shared: list[_SharedPrefix]  # empty: the plain path
    float_mask: Tensor | None = None  # valid as an additive mask, built on first use


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
        plan = meta._decode_plans[window] = _decode_plan(
            meta, block_size, window, cascade=softcap is None
        )
    k = gather_blocks(k_cache, plan.blocks).view(b, -1, kvh, d)  # [B, L, KVH, D]
    v = gather_blocks(v_cache, plan.blocks).view(b, -1, kvh, d)  # [B, L, KVH, D]
    if plan.shared:
        return _cascade_attention(q, k, v, k_cache, v_cache, plan, scale)

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


def _cascade_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    plan: _DecodePlan,
    scale: float,
) -> Tensor:
    """Decode attention split at shared prefixes (cascade attention, as in FlashInfer / vLLM).

    Rows of a `_SharedPrefix` attend to its blocks together: their queries of one KV head are
    stacked into one `[R * G, D] @ [D, P]` product, so the prefix K/V is read once per step
    instead of once per row (in place when its block ids are consecutive, as after a warm-up).
    Every row then attends to its own gathered blocks (`k`, `v`: what follows its shared
    prefix, or its whole context). The two partial softmaxes are merged with their
    log-sum-exps:

        out = out_p * exp(lse_p - lse) + out_s * exp(lse_s - lse),  lse = logaddexp(lse_p, lse_s)

    The same function as one softmax over the whole context, up to float rounding.
    """
    b, h, d = q.shape
    kvh = k_cache.shape[2]
    g = h // kvh
    if plan.float_mask is None:
        zeros = torch.zeros(plan.valid.shape, dtype=q.dtype, device=q.device)
        plan.float_mask = zeros.masked_fill_(~plan.valid, float("-inf"))[:, None, None, :]
    out_s, lse_s = _attend_with_lse(
        q.view(b, kvh, g, d),  # [B, KVH, G, D]: the G query heads of a KV head as a "length"
        k.transpose(1, 2),  # [B, KVH, S, D]
        v.transpose(1, 2),
        plan.float_mask,  # [B, 1, 1, S]
        scale,
    )  # [B, KVH, G, D], [B, KVH, G]
    for shared in plan.shared:  # groups have disjoint rows: each merges into out_s in place
        r = shared.rows.numel()
        if shared.first_block is not None:  # a view of the pool: no copy
            span = slice(shared.first_block, shared.first_block + shared.blocks.numel())
            kp, vp = k_cache[span], v_cache[span]
        else:
            kp, vp = gather_blocks(k_cache, shared.blocks), gather_blocks(v_cache, shared.blocks)
        kp = kp.reshape(-1, kvh, d).transpose(0, 1)[None]  # [1, KVH, P, D]
        vp = vp.reshape(-1, kvh, d).transpose(0, 1)[None]
        qp = q.index_select(0, shared.rows).view(r, kvh, g, d).transpose(0, 1)  # [KVH, R, G, D]
        out_p, lse_p = _attend_with_lse(qp.reshape(1, kvh, r * g, d), kp, vp, None, scale)
        out_p = out_p.view(kvh, r, g, d).transpose(0, 1)  # [R, KVH, G, D]
        lse_p = lse_p.view(kvh, r, g).transpose(0, 1)  # [R, KVH, G]
        lse_r = lse_s.index_select(0, shared.rows)
        lse = torch.logaddexp(lse_p, lse_r)
        merged = (
            out_p.float() * torch.exp(lse_p - lse)[..., None]
            + out_s.index_select(0, shared.rows).float() * torch.exp(lse_r - lse)[..., None]
        )
        out_s.index_copy_(0, shared.rows, merged.to(q.dtype))
    return out_s.reshape(b, h, d)


def _attend_with_lse(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """softmax(q k^T * scale + mask) v and its log-sum-exp. q [N, KVH, M, D], k/v [N, KVH, S, D],
    mask additive, broadcastable to [N, KVH, M, S] -> ([N, KVH, M, D], [N, KVH, M] float32)."""
    if q.device.type == "cpu" and FUSED_CPU_LSE:  # SDPA's own CPU kernel, lse included
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=mask, scale=scale
        )[:2]
        return out, lse.float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [N, KVH, M, S]
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).to(v.dtype)
    return torch.matmul(probs, v), lse


def _decode_plan(
    meta: AttentionMetadata, block_size: int, window: int | None, cascade: bool = True
) -> _DecodePlan:
    """Which blocks each sequence's query reads and which of their positions it may see; with
    `cascade`, the prefixes that `CASCADE_MIN_ROWS` or more rows share are taken out of their
    gathers (they start after the shared blocks) and listed in `shared`."""
    tables = meta.block_tables
    device = tables.device
    max_blocks = tables.shape[1]
    b = tables.shape[0]
    seq_lens = meta.seq_lens.to(torch.long)  # [B]
    own = seq_lens - 1  # [B] position of the query token

    first_list = [
        0 if window is None else max(0, s - window) // block_size for s in meta.seq_lens_list
    ]  # first block in the window of each row (s - 1 - window + 1 = s - window)
    shared = _shared_prefixes(meta, block_size, window) if cascade else []
    for group_first, members in shared:
        for row in members:
            first_list[row] = group_first
    spans = zip(meta.seq_lens_list, first_list, strict=True)
    n_blocks = max(-(-s // block_size) - f for s, f in spans)
    n_blocks = max(1, min(n_blocks, max_blocks))
    first = torch.tensor(first_list, dtype=torch.long, device=device)  # [B]
    idx = first[:, None] + torch.arange(n_blocks, device=device)  # [B, n]
    blocks = tables.gather(1, idx.clamp(max=max_blocks - 1).to(tables.dtype)).long()  # [B, n]

    offsets = torch.arange(block_size, device=device)
    pos = (idx[:, :, None] * block_size + offsets).view(b, -1)  # [B, L] absolute positions
    valid = pos <= own[:, None]  # [B, L]
    if window is not None:
        valid &= pos > own[:, None] - window
    groups = []
    for n_shared, members in shared:
        ids = meta.block_tables_list[members[0]][:n_shared]
        consecutive = ids == list(range(ids[0], ids[0] + n_shared))
        groups.append(
            _SharedPrefix(
                torch.tensor(members, dtype=torch.long, device=device),
                torch.tensor(ids, dtype=torch.long, device=device),
                ids[0] if consecutive else None,
            )
        )
    return _DecodePlan(blocks, valid, n_blocks, groups)


def _shared_prefixes(
    meta: AttentionMetadata, block_size: int, window: int | None
) -> list[tuple[int, list[int]]]:
    """(number of shared blocks, rows) for each set of >= CASCADE_MIN_ROWS rows whose block
    tables start with the same blocks. Only blocks wholly before every member's query position
    count (shared blocks are full prefix-cache blocks), and with a sliding window only rows
    whose window still covers position 0 join."""
    tables = meta.block_tables_list
    if len(tables) < CASCADE_MIN_ROWS or len(tables) != len(meta.seq_lens_list):
        return []  # (metadata built without the python tables: no cascade)
    by_first: dict[int, list[int]] = {}
    for row, (table, s_len) in enumerate(zip(tables, meta.seq_lens_list, strict=True)):
        if table and table[0] != 0 and (window is None or s_len <= window):
            by_first.setdefault(table[0], []).append(row)
    out = []
    for members in by_first.values():
        if len(members) < CASCADE_MIN_ROWS:
            continue
        limit = min((meta.seq_lens_list[r] - 1) // block_size for r in members)
        ref = tables[members[0]]
        n = 0
        while n < limit and all(tables[r][n] == ref[n] for r in members):
            n += 1
        if n > 0:
            out.append((n, members))
    return out


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
