"""Cascade attention for decode steps: rows that share a cached prefix attend to it once.

The decode path of kernels/attention.py asks `decode_plan` which blocks each row gathers and
which of their positions it sees; rows whose block tables start with the same full blocks (a
warm language prompt handed out by the prefix cache, `shared_prefixes`: at least
`CASCADE_MIN_ROWS` rows) have those blocks taken out of their gathers and attend to them
together in `cascade_attention`, one matmul per KV head, the two softmax parts merged by their
log-sum-exps (`attend_with_lse`). `kernels/triton_attention.py` applies the same rule
(`shared_prefixes`) in its kernel.

Split out of kernels/attention.py (issue 27: no product file over 400 lines), bodies
unchanged; the op calls these through the module (`cascade.decode_plan`), so a test may
replace one. A leaf: torch and `kernels.attention_metadata`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.attention_metadata import AttentionMetadata, DecodePlan, SharedPrefix, gather_blocks

__all__ = [
    "CASCADE_MIN_ROWS",
    "FUSED_CPU_LSE",
    "attend_with_lse",
    "cascade_attention",
    "decode_plan",
    "shared_prefixes",
]

CASCADE_MIN_ROWS = 4  # rows that must share a prefix before it is attended to once for all
FUSED_CPU_LSE = True  # CPU: SDPA's fused kernel, which returns the log-sum-exp too (tests: off)


def cascade_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    plan: DecodePlan,
    scale: float,
) -> Tensor:
    """Decode attention split at shared prefixes (cascade attention, as in FlashInfer / vLLM).

    Rows of a `SharedPrefix` attend to its blocks together: their queries of one KV head are
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
    out_s, lse_s = attend_with_lse(
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
        out_p, lse_p = attend_with_lse(qp.reshape(1, kvh, r * g, d), kp, vp, None, scale)
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


def attend_with_lse(
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


def decode_plan(
    meta: AttentionMetadata, block_size: int, window: int | None, cascade: bool = True
) -> DecodePlan:
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
    shared = shared_prefixes(meta, block_size, window) if cascade else []
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
            SharedPrefix(
                torch.tensor(members, dtype=torch.long, device=device),
                torch.tensor(ids, dtype=torch.long, device=device),
                ids[0] if consecutive else None,
            )
        )
    return DecodePlan(blocks, valid, n_blocks, groups)


def shared_prefixes(
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
