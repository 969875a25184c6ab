"""Paged KV cache manager: block tables, slot mappings and prefix caching over block pools.

Pure CPU bookkeeping in the spirit of vLLM v1's `kv_cache_manager.py`; the engine owns the
tensors (`KVPools` of `prepare.py`: `k/v [num_blocks, block_size, kv_heads, head_dim]` per
layer, bound into the model's layers for each forward); the model only ever sees block ids,
through `block_table()` and `slot_mapping()`. The blocks themselves (refcounts, free list,
evictable LRU, hash maps) live in `block_pool.py`, whose names this module re-exports. The
manager's prefix-cache side (lookup, publishing, partial-block copies) is its member
`kv.prefix`, a `PrefixCache` (`kv_prefix.py`) over the same groups and tables; this module
keeps the tables, allocation, freeing, the model's inputs and the accounting, and re-exports
`KVGroupSpec` and `BlockCopy` (the manager's public types, defined there because both sides
use them).

Design
------
* One `BlockPool` per KV group. A group is a set of layers with the same attention kind: "full"
  (every token kept) and, for Gemma 3, "sliding" (only the last `sliding_window` positions).
  Every pool has the same `block_size`, so block `i` of a sequence covers positions
  `[i * block_size, (i + 1) * block_size)` in every group and the hash chain is shared.
* A sliding group's table holds the pool's NULL block (block 0) for blocks that fell out of the
  window, so a table stays indexable by `position // block_size`.
* Prefix caching: once a block is FULL and its KV written (`commit_computed`), it is published
  under its chain hash in every group's pool (see `block_pool.py` for the hash and the LRU).
* Partial blocks (`share_partial_blocks`, on by default): a prompt rarely ends its shared part
  on a block boundary (a language's few-shot prefix of 264 tokens leaves 8 in a 16-token
  block), so after the whole-block hit a lookup also tries the leading slots of the next
  block. Every published full block and the last, partly filled block of every freed sequence
  offer their first `j` slots under `hash_block_tokens(parent, first j tokens)` (the
  `prefix_keys`; the newest block offering a key holds it). A hit of `j` slots gets a fresh
  block plus a `BlockCopy` of those slots, which the engine runs before the step's forward
  (`take_block_copies`; the source is referenced until then), so the sequence computes only
  what follows. K/V at a position depends only on the tokens up to it, so a copy is exact.
  An offered tail block waits in the evictable LRU like a cached full block.
* `free()` releases a sequence's blocks tail first, so in the LRU the tail of a chain is evicted
  before its head (a head is shared by more prompts than its tail). Sliding blocks that leave
  the window are released as the sequence advances, so a decoding sequence never holds more than
  `ceil(window / block_size) + 1` sliding blocks (a prefill chunk of `n` tokens needs the window
  plus the chunk: `ceil((window - 1 + n) / block_size) + 1`).
* Window semantics follow Hugging Face Gemma 3: the query at position `p` attends keys
  `(p - window, p]`, so computing position `n` needs the cached positions `[n - window + 1, n)`.
  The same bound drives both the drop rule in `allocate_slots` and the sliding requirement in
  `find_cached_prefix`, so whatever one call keeps the other can hit.
* `allocate_slots` is all-or-nothing: every group is planned and checked against its pool before
  anything is touched, so the scheduler can preempt or wait on `False` without undoing anything.
* `find_cached_prefix` is a pure lookup (no refcount, no LRU touch, no stats). Prefix stats are
  counted once per admission, at a sequence's first `allocate_slots`, so a request that waits
  several steps is not counted several times.

Nothing here imports torch; the engine runs on a single thread, so there are no locks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from workers.engine.block_pool import (
    NULL_BLOCK_ID,
    BlockHash,
    BlockPool,
    KVBlock,
    PrefixCacheStats,
    hash_block_tokens,
    prefix_keys,
)
from workers.engine.kv_prefix import (
    BlockCopy,
    KVGroup,
    KVGroupSpec,
    PrefixCache,
    SeqBlocks,
    cdiv,
    extend_hashes,
    first_live_block,
)

__all__ = [
    "NULL_BLOCK_ID",
    "BlockCopy",
    "BlockHash",
    "BlockPool",
    "KVBlock",
    "KVCacheManager",
    "KVGroupSpec",
    "PrefixCacheStats",
    "hash_block_tokens",
    "prefix_keys",
]


@dataclass(slots=True)
class _Plan:
    group: KVGroup
    release: list[KVBlock]  # sliding blocks leaving the window (head first)
    num_null: int  # new table entries that are already out of the window
    num_alloc: int  # fresh blocks to take from the pool
    touched: list[KVBlock]  # first allocation: cached prefix blocks (null where out of window)
    copy_src: KVBlock | None = None  # first allocation: the partially matched block


class KVCacheManager:
    """Block tables of all running sequences over one pool per KV group."""

    def __init__(
        self,
        groups: Sequence[KVGroupSpec],
        enable_prefix_caching: bool = True,
        share_partial_blocks: bool = True,
    ) -> None:
        if not groups:
            raise ValueError("need at least one KV group")
        sizes = {g.block_size for g in groups}
        if len(sizes) != 1 or min(sizes) < 1:
            raise ValueError(f"all groups need the same positive block_size, got {sorted(sizes)}")
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate group names: {names}")
        for g in groups:
            if g.sliding_window is not None and g.sliding_window < 1:
                raise ValueError(f"group {g.name}: sliding_window must be >= 1")
        self.block_size: int = groups[0].block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.share_partial_blocks = share_partial_blocks
        self.stats = PrefixCacheStats()
        self._groups = [KVGroup(spec, BlockPool(spec.num_blocks, self.stats)) for spec in groups]
        self._by_name = {g.spec.name: g for g in self._groups}
        self._seqs: dict[str, SeqBlocks] = {}
        self.prefix = PrefixCache(
            self._groups,
            self._seqs,
            block_size=self.block_size,
            enable_prefix_caching=enable_prefix_caching,
            share_partial_blocks=share_partial_blocks,
            stats=self.stats,
        )

    # ------------------------------------------------------------------ lookups

    @property
    def groups(self) -> list[KVGroupSpec]:
        return [g.spec for g in self._groups]

    def pool(self, group: str) -> BlockPool:
        return self._by_name[group].pool

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    # --------------------------------------------------------------- allocation

    def allocate_slots(
        self, seq_id: str, token_ids: Sequence[int], num_computed: int, num_new: int
    ) -> bool:
        """Give `seq_id` blocks for positions `[0, num_computed + num_new)`; all or nothing.

        The first call may start from a cached prefix (`num_computed` > 0, as found by
        `find_cached_prefix(token_ids)`); a prefix that ends inside a block gets a fresh block
        and a `BlockCopy` of the matched slots (`take_block_copies`). Sliding groups release
        blocks that left the window of position `num_computed`. Returns False, changing
        nothing, if some pool cannot supply the blocks.
        """
        if num_computed < 0 or num_new < 0:
            raise ValueError(f"num_computed={num_computed}, num_new={num_new} must be >= 0")
        seq = self._seqs.get(seq_id)
        if seq is None:
            return self._allocate_first(seq_id, token_ids, num_computed, num_new)
        num_total_blocks = cdiv(num_computed + num_new, self.block_size)
        plans: list[_Plan] = []
        for g in self._groups:
            table = seq.tables[g.spec.name]
            live = min(first_live_block(g, num_computed, self.block_size), num_total_blocks)
            dropped = seq.num_dropped[g.spec.name]
            release = [b for b in table[dropped:live] if b.block_id != NULL_BLOCK_ID]
            num_null = max(0, live - len(table))
            num_alloc = max(0, num_total_blocks - len(table)) - num_null
            # Released blocks whose last reference this is become free before we allocate.
            released_free = sum(1 for b in release if b.ref_cnt == 1)
            if num_alloc > g.pool.num_free_blocks() + released_free:
                return False
            plans.append(_Plan(g, release, num_null, num_alloc, []))
        for plan in plans:
            name = plan.group.spec.name
            table = seq.tables[name]
            pool = plan.group.pool
            dropped = seq.num_dropped[name]
            live = min(
                first_live_block(plan.group, num_computed, self.block_size), num_total_blocks
            )
            if plan.release:
                for i in range(dropped, min(live, len(table))):
                    table[i] = pool.null_block
                pool.free_blocks(reversed(plan.release))
            table.extend([pool.null_block] * plan.num_null)
            table.extend(pool.get_new_blocks(plan.num_alloc))
            seq.num_dropped[name] = max(dropped, min(live, len(table)))
        seq.num_computed = max(seq.num_computed, num_computed)
        return True

    def _allocate_first(
        self, seq_id: str, token_ids: Sequence[int], num_computed: int, num_new: int
    ) -> bool:
        bs = self.block_size
        num_hit, num_partial = divmod(num_computed, bs)
        if num_computed:
            if not self.enable_prefix_caching:
                raise ValueError("num_computed > 0 on a first allocation needs prefix caching")
            if (num_partial and not self.share_partial_blocks) or num_computed >= len(token_ids):
                raise ValueError(
                    f"num_computed={num_computed} is not a cached prefix of "
                    f"{len(token_ids)} tokens (< len; a multiple of {bs} unless partial blocks "
                    "are shared)"
                )
        num_total_blocks = cdiv(num_computed + num_new, bs)
        hashes: list[BlockHash] = []
        extend_hashes(hashes, token_ids, num_hit, bs)
        partial_key = (
            prefix_keys(hashes[-1] if hashes else None, token_ids[num_hit * bs : num_computed])[-1]
            if num_partial
            else None
        )
        plans: list[_Plan] = []
        for g in self._groups:
            live = first_live_block(g, num_computed, self.block_size)
            touched = [g.pool.null_block] * live
            for h in hashes[live:]:
                block = g.pool.get_cached_block(h)
                if block is None:
                    raise ValueError(
                        f"num_computed={num_computed}: prefix block not cached in group "
                        f"{g.spec.name!r}; use find_cached_prefix()"
                    )
                touched.append(block)
            src = None
            if partial_key is not None:
                src = g.pool.get_prefix_block(partial_key)
                if src is None:
                    raise ValueError(
                        f"num_computed={num_computed}: partial block not cached in group "
                        f"{g.spec.name!r}; use find_cached_prefix()"
                    )
            num_alloc = num_total_blocks - num_hit
            # Unreferenced cached blocks leave the evictable LRU, so they use up free capacity.
            held = [b for b in (*touched, src) if b is not None and b.block_id != NULL_BLOCK_ID]
            from_lru = sum(1 for b in held if b.ref_cnt == 0)
            if num_alloc + from_lru > g.pool.num_free_blocks():
                return False
            plans.append(_Plan(g, [], 0, num_alloc, touched, src))
        seq = SeqBlocks(tables={}, num_dropped={}, hashes=hashes, num_published=num_hit)
        for plan in plans:
            pool = plan.group.pool
            # Touch before taking new blocks, so eviction can not take the blocks we hit; a
            # partial match's source is held until its copy is taken (take_block_copies).
            pool.touch(b for b in plan.touched if b.block_id != NULL_BLOCK_ID)
            if plan.copy_src is not None:
                pool.touch([plan.copy_src])
            name = plan.group.spec.name
            seq.tables[name] = plan.touched + pool.get_new_blocks(plan.num_alloc)
            live = first_live_block(plan.group, num_computed, bs)
            seq.num_dropped[name] = min(live, num_hit)
            if plan.copy_src is not None:
                dst = seq.tables[name][num_hit].block_id
                copy = BlockCopy(name, plan.copy_src.block_id, dst, num_partial)
                self.prefix.hold_copy(pool, plan.copy_src, copy)
        seq.num_computed = num_computed
        self._seqs[seq_id] = seq
        if self.enable_prefix_caching:
            self.stats.requests += 1
            self.stats.queries += len(token_ids)
            self.stats.hits += num_computed
        return True

    def free(self, seq_id: str, token_ids: Sequence[int] | None = None) -> None:
        """Release all of the sequence's blocks, tail first. Unknown ids are ignored.

        Given the sequence's `token_ids`, the computed slots of its last, partly filled block
        are offered for partial prefix hits (the block then waits in the evictable LRU)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        if token_ids is not None and self.enable_prefix_caching and self.share_partial_blocks:
            self.prefix.offer_tail(seq, token_ids)
        for g in self._groups:
            table = seq.tables[g.spec.name]
            g.pool.free_blocks(b for b in reversed(table) if b.block_id != NULL_BLOCK_ID)

    # ------------------------------------------------------------ model inputs

    def block_table(self, seq_id: str, group: str) -> list[int]:
        return [b.block_id for b in self._seqs[seq_id].tables[group]]

    def slot_mapping(self, seq_id: str, group: str, start: int, end: int) -> list[int]:
        """Cache slot (`block_id * block_size + offset`) of each position in `[start, end)`."""
        table = self._seqs[seq_id].tables[group]
        bs = self.block_size
        if start < 0 or end > len(table) * bs:
            raise ValueError(f"positions [{start}, {end}) not allocated ({len(table)} blocks)")
        out: list[int] = []
        for pos in range(start, end):
            block_id = table[pos // bs].block_id
            if block_id == NULL_BLOCK_ID:
                raise ValueError(f"position {pos} of group {group!r} is out of the window")
            out.append(block_id * bs + pos % bs)
        return out

    # -------------------------------------------------------------- accounting

    def num_free_blocks(self, group: str) -> int:
        return self._by_name[group].pool.num_free_blocks()

    def usage(self) -> float:
        """Fraction of non-null blocks referenced by sequences, max over groups."""
        return max(1.0 - g.pool.num_free_blocks() / g.pool.num_usable_blocks for g in self._groups)

    def num_blocks_needed(self, seq_id: str | None, num_total_tokens: int) -> dict[str, int]:
        """Fresh blocks per group an allocation up to `num_total_tokens` would take.

        `seq_id=None`: a new sequence computing all of `[0, num_total_tokens)` in one step (no
        prefix hit). Otherwise: the sequence's next `allocate_slots` from its last known
        `num_computed`, not counting the blocks the window would release.
        """
        num_total_blocks = cdiv(num_total_tokens, self.block_size)
        seq = self._seqs.get(seq_id) if seq_id is not None else None
        if seq is None:
            return {g.spec.name: num_total_blocks for g in self._groups}
        out: dict[str, int] = {}
        for g in self._groups:
            held = len(seq.tables[g.spec.name])
            live = min(first_live_block(g, seq.num_computed, self.block_size), num_total_blocks)
            out[g.spec.name] = max(0, num_total_blocks - held) - max(0, live - held)
        return out
