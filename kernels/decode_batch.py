"""Compiled decode steps: a decode-only batch as tensors alone, and the ops that run on it.

`workers/engine/compiled.py` runs decode-only steps through `torch.compile`. The general
`AttentionMetadata` of `kernels/attention.py` carries python lists and per-step memoized plans
that a graph would guard on and recompile for; here a step is a `DecodeBatch` of tensors whose
sizes are dynamic, built outside the graph, and three ops a graph traces as they are:

- `write_kv_decode`: the new token's K/V into the block-major pool `[num_blocks, block_size,
  KVH, D]` (layout and null block as in `kernels/attention.py`) as an in-place index_put, which
  a compiled graph keeps in place;
- `decode_attention`: one query per row over the blocks its position can see (with a sliding
  window only those that can hold in-window positions). On the CPU in float32 it is the C++ op
  `tolk::decode_attention` (`kernels/cpu/`, loaded by `kernels.cpu_ops`), which reads each row's
  K/V from the pool by slot without a gather; `decode_attention_reference` (a gather and one
  SDPA call) elsewhere, with the same signature.

Masking follows `kernels/attention.py`: the query at position `p` sees positions `<= p` and,
with a window `W`, `> p - W`. Softmax runs in float32. A leaf: torch and `kernels.cpu_ops` only;
`kernels.attention` re-exports every name for its callers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import cpu_ops


@dataclass
class DecodeBatch:
    """A decode-only step for one KV group as tensors alone, for compiled graphs.

    `AttentionMetadata` carries python lists (and memoized plans) that a `torch.compile` graph
    would guard on and recompile for; this carries only tensors whose sizes are dynamic. Built
    outside the graph by `DecodeBatch.build`; `blocks` has at least 2 columns so that no
    sequence length specializes a graph (dynamo specializes sizes 0 and 1).
    """

    slot_blocks: Tensor  # [B] long: block of each new token's K/V
    slot_offsets: Tensor  # [B] long: its offset inside the block
    blocks: Tensor  # [B, n] long: the blocks each row's query reads (0 = null, masked)
    valid: Tensor  # [B, n * block_size] bool: which of those positions it sees

    @classmethod
    def build(
        cls,
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        window: int | None,
        device: torch.device | str = "cpu",
    ) -> DecodeBatch:
        """One new token per row at `positions[b]` (0-based), its table `block_tables[b]`."""
        firsts = [0 if window is None else max(0, p + 1 - window) // block_size for p in positions]
        spans = [p // block_size + 1 - f for p, f in zip(positions, firsts, strict=True)]
        n = max(2, *spans)
        rows = [
            [*table[f : f + span], *([0] * (n - span))]
            for table, f, span in zip(block_tables, firsts, spans, strict=True)
        ]
        pos = torch.tensor(list(positions), dtype=torch.long, device=device)  # [B]
        first = torch.tensor(firsts, dtype=torch.long, device=device)
        seen = first[:, None] * block_size + torch.arange(n * block_size, device=device)  # [B, L]
        valid = seen <= pos[:, None]
        if window is not None:
            valid &= seen > pos[:, None] - window
        slot_blocks = [
            table[p // block_size] for p, table in zip(positions, block_tables, strict=True)
        ]
        return cls(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=device),
            slot_offsets=pos % block_size,
            blocks=torch.tensor(rows, dtype=torch.long, device=device),
            valid=valid,
        )


def write_kv_decode(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, batch: DecodeBatch
) -> None:
    """`write_kv` for a `DecodeBatch`: an index_put on the 4-d cache, which a compiled graph
    does in place (a scatter into a reshaped view of a graph input copies the whole pool)."""
    index = (batch.slot_blocks, batch.slot_offsets)
    k_cache.index_put_(index, k.to(k_cache.dtype))  # k, v: [B, KVH, D]
    v_cache.index_put_(index, v.to(v_cache.dtype))


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    batch: DecodeBatch,
    scale: float,
    softcap: float | None = None,
) -> Tensor:
    """Attention of one query per row over its `DecodeBatch` blocks. q [B, H, D] -> [B, H, D].

    On the CPU in float32, once `kernels.cpu_ops.load()` has run: the C++ op
    `tolk::decode_attention` (`kernels/cpu/`), which reads the K/V rows in place from the pool;
    otherwise `decode_attention_reference`."""
    on_cpu = q.device.type == "cpu" and q.dtype == k_cache.dtype == torch.float32
    if on_cpu and cpu_ops.LOADED:
        return torch.ops.tolk.decode_attention(
            q, k_cache, v_cache, batch.blocks, batch.valid, scale, softcap
        )
    return decode_attention_reference(q, k_cache, v_cache, batch, scale, softcap)


def decode_attention_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    batch: DecodeBatch,
    scale: float,
    softcap: float | None = None,
) -> Tensor:
    """The torch version of `decode_attention` (any device and dtype).

    A gather and one SDPA call (a manual float32 softmax when logits are soft-capped): ops that
    `torch.compile` traces as they are. The eager engine uses `paged_attention` instead."""
    b, h, d = q.shape
    kvh = k_cache.shape[2]
    k = k_cache[batch.blocks].view(b, -1, kvh, d).transpose(1, 2)  # [B, KVH, L, D]
    v = v_cache[batch.blocks].view(b, -1, kvh, d).transpose(1, 2)
    if softcap is None:
        out = F.scaled_dot_product_attention(
            q[:, :, None, :],  # [B, H, 1, D]
            k,
            v,
            attn_mask=batch.valid[:, None, None, :],  # [B, 1, 1, L]
            scale=scale,
            enable_gqa=True,
        )  # [B, H, 1, D]
        return out.view(b, h, d)
    qg = q.view(b, kvh, h // kvh, d)  # [B, KVH, G, D]
    scores = torch.matmul(qg, k.transpose(2, 3)) * scale  # [B, KVH, G, L]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~batch.valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).reshape(b, h, d)  # [B, KVH, G, D] -> [B, H, D]
