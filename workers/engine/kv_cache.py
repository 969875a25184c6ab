"""Paged KV cache manager: block tables, slot mappings and prefix caching over block pools.

Pure CPU bookkeeping in the spirit of vLLM v1's `kv_cache_manager.py`; the engine owns the
tensors (`KVPools` of `prepare.py`: `k/v [num_blocks, block_size, kv_heads, head_dim]` per
layer, bound into the model's layers for each forward); the model only ever sees block ids,
through `block_table()` and `slot_mapping()`. The blocks themselves (refcounts, free list,
evictable LRU, hash maps) live in `block_pool.py`, whose names this module re-exports.

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
from dataclasses import dataclass, field

from workers.engine.block_pool import (
    NULL_BLOCK_ID,
    BlockHash,
    BlockPool,
    KVBlock,
    PrefixCacheStats,
    hash_block_tokens,
    prefix_keys,
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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVGroupSpec:
    name: str  # "full" or "sliding"
    num_blocks: int  # pool size including the reserved null block 0
    block_size: int  # tokens per block (same for all groups)
    sliding_window: int | None  # None = keeps every token


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy slots `[0, num_slots)` of block `src` into block `dst` in every layer of `group`
    before the step's forward: a partially matched prefix block (see KVCacheManager)."""

    group: str
    src: int
    dst: int
    num_slots: int


@dataclass(slots=True)
class _Group:
    spec: KVGroupSpec
    pool: BlockPool


@dataclass(slots=True)
class _SeqState:
    tables: dict[str, list[KVBlock]]  # per group; the null block where a block was dropped
    num_dropped: dict[str, int]  # per group: leading table entries already released (null)
    hashes: list[BlockHash] = field(default_factory=list)  # chain hashes of its full blocks
    num_published: int = 0  # leading full blocks already offered to the hash maps
    num_computed: int = 0  # highest num_computed seen (allocate_slots / commit_computed)


@dataclass(slots=True)
class _Plan:
    group: _Group
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
        # partial hits of this step: copies to run, and the sources held until they run
        self._copies: list[BlockCopy] = []
        self._copy_refs: list[tuple[BlockPool, KVBlock]] = []
        self._groups = [_Group(spec, BlockPool(spec.num_blocks, self.stats)) for spec in groups]
        self._by_name = {g.spec.name: g for g in self._groups}
        self._seqs: dict[str, _SeqState] = {}

    # ------------------------------------------------------------------ lookups

    @property
    def groups(self) -> list[KVGroupSpec]:
        return [g.spec for g in self._groups]

    def pool(self, group: str) -> BlockPool:
        return self._by_name[group].pool

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def _first_live_block(self, group: _Group, num_computed: int) -> int:
        """Index of the first block still needed to compute position `num_computed`."""
        window = group.spec.sliding_window
        if window is None:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    def _extend_hashes(
        self, hashes: list[BlockHash], token_ids: Sequence[int], num_blocks: int
    ) -> None:
        bs = self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)

    def find_cached_prefix(self, token_ids: Sequence[int]) -> int:
        """Longest cached prefix in tokens (at most len - 1): whole blocks, then, with
        `share_partial_blocks`, the leading slots of one more block.

        Full groups need every block of the prefix; sliding groups only the blocks covering the
        positions `[n - window + 1, n)` the next token attends to. Pure lookup.
        """
        if not self.enable_prefix_caching or len(token_ids) <= 1:
            return 0
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        full = [g.pool for g in self._groups if g.spec.sliding_window is None]
        sliding = [g for g in self._groups if g.spec.sliding_window is not None]
        # Full groups cap the hit at their first miss; stop hashing there.
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        for i in range(max_blocks):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            if any(p.get_cached_block(parent) is None for p in full):
                break
            hashes.append(parent)
        # Sliding groups: runs[i] = consecutive cached blocks ending at block i. A hit of k
        # blocks is valid if the run ending at k - 1 reaches back to the first live block.
        valid = [True] * (len(hashes) + 1)
        for g in sliding:
            run = 0
            for i, h in enumerate(hashes):
                run = run + 1 if g.pool.get_cached_block(h) is not None else 0
                k = i + 1
                if run < k - self._first_live_block(g, k * bs):
                    valid[k] = False
        k = next((k for k in range(len(hashes), 0, -1) if valid[k]), 0)
        return k * bs + self._partial_hit(token_ids, hashes[k - 1] if k else None, k)

    def _partial_hit(self, token_ids: Sequence[int], parent: BlockHash | None, k: int) -> int:
        """How many leading tokens of block `k` (after `k` whole cached blocks) some cached
        block of every group holds under the same parent; 0 to block_size - 1."""
        if not self.share_partial_blocks:
            return 0
        bs = self.block_size
        rem = min(bs - 1, len(token_ids) - 1 - k * bs)
        if rem <= 0:
            return 0
        keys = prefix_keys(parent, token_ids[k * bs : k * bs + rem])
        for j in range(rem, 0, -1):
            if all(g.pool.get_prefix_block(keys[j - 1]) is not None for g in self._groups):
                return j
        return 0

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
        num_total_blocks = _cdiv(num_computed + num_new, self.block_size)
        plans: list[_Plan] = []
        for g in self._groups:
            table = seq.tables[g.spec.name]
            live = min(self._first_live_block(g, num_computed), num_total_blocks)
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
            live = min(self._first_live_block(plan.group, num_computed), num_total_blocks)
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
        num_total_blocks = _cdiv(num_computed + num_new, bs)
        hashes: list[BlockHash] = []
        self._extend_hashes(hashes, token_ids, num_hit)
        partial_key = (
            prefix_keys(hashes[-1] if hashes else None, token_ids[num_hit * bs : num_computed])[-1]
            if num_partial
            else None
        )
        plans: list[_Plan] = []
        for g in self._groups:
            live = self._first_live_block(g, num_computed)
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
        seq = _SeqState(tables={}, num_dropped={}, hashes=hashes, num_published=num_hit)
        for plan in plans:
            pool = plan.group.pool
            # Touch before taking new blocks, so eviction can not take the blocks we hit; a
            # partial match's source is held until its copy is taken (take_block_copies).
            pool.touch(b for b in plan.touched if b.block_id != NULL_BLOCK_ID)
            if plan.copy_src is not None:
                pool.touch([plan.copy_src])
                self._copy_refs.append((pool, plan.copy_src))
            name = plan.group.spec.name
            seq.tables[name] = plan.touched + pool.get_new_blocks(plan.num_alloc)
            seq.num_dropped[name] = min(self._first_live_block(plan.group, num_computed), num_hit)
            if plan.copy_src is not None:
                dst = seq.tables[name][num_hit].block_id
                self._copies.append(BlockCopy(name, plan.copy_src.block_id, dst, num_partial))
        seq.num_computed = num_computed
        self._seqs[seq_id] = seq
        if self.enable_prefix_caching:
            self.stats.requests += 1
            self.stats.queries += len(token_ids)
            self.stats.hits += num_computed
        return True

    def commit_computed(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """KV for positions `[0, num_computed)` is written: publish the blocks that became full."""
        seq = self._seqs[seq_id]
        if num_computed > len(token_ids):
            raise ValueError(f"num_computed={num_computed} > {len(token_ids)} tokens")
        seq.num_computed = max(seq.num_computed, num_computed)
        if not self.enable_prefix_caching:
            return
        num_full = num_computed // self.block_size
        if num_full <= seq.num_published:
            return
        for g in self._groups:
            if num_full > len(seq.tables[g.spec.name]):
                raise ValueError(f"num_computed={num_computed} beyond the allocated blocks")
        self._extend_hashes(seq.hashes, token_ids, num_full)
        bs = self.block_size
        for i in range(seq.num_published, num_full):
            keys: list[BlockHash] | None = None  # the block's leading slots, for partial hits
            for g in self._groups:
                block = seq.tables[g.spec.name][i]
                if block.block_id == NULL_BLOCK_ID:
                    continue
                published = g.pool.cache_full_block(block, seq.hashes[i])
                if not published or not self.share_partial_blocks or block.prefix_keys:
                    continue
                if keys is None:
                    parent = seq.hashes[i - 1] if i else None
                    keys = prefix_keys(parent, token_ids[i * bs : (i + 1) * bs - 1])
                g.pool.offer_prefixes(block, keys)
        seq.num_published = num_full

    def free(self, seq_id: str, token_ids: Sequence[int] | None = None) -> None:
        """Release all of the sequence's blocks, tail first. Unknown ids are ignored.

        Given the sequence's `token_ids`, the computed slots of its last, partly filled block
        are offered for partial prefix hits (the block then waits in the evictable LRU)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        if token_ids is not None and self.enable_prefix_caching and self.share_partial_blocks:
            self._offer_tail(seq, token_ids)
        for g in self._groups:
            table = seq.tables[g.spec.name]
            g.pool.free_blocks(b for b in reversed(table) if b.block_id != NULL_BLOCK_ID)

    def _offer_tail(self, seq: _SeqState, token_ids: Sequence[int]) -> None:
        i, r = divmod(min(seq.num_computed, len(token_ids)), self.block_size)
        if r == 0:
            return
        self._extend_hashes(seq.hashes, token_ids, i)
        keys: list[BlockHash] | None = None
        for g in self._groups:
            table = seq.tables[g.spec.name]
            if i >= len(table) or table[i].block_id == NULL_BLOCK_ID or table[i].reusable:
                continue
            if keys is None:
                parent = seq.hashes[i - 1] if i else None
                start = i * self.block_size
                keys = prefix_keys(parent, token_ids[start : start + r])
            g.pool.offer_prefixes(table[i], keys)

    def take_block_copies(self) -> list[BlockCopy]:
        """The partial-hit copies of the allocations since the last call, in order; their
        sources are released, so run the copies before the next allocation."""
        copies, self._copies = self._copies, []
        for pool, block in self._copy_refs:
            pool.free_blocks([block])
        self._copy_refs = []
        return copies

    def reset_prefix_cache(self) -> None:
        """Forget all published prefixes (e.g. after weights change). Running sequences keep
        their blocks; they are simply no longer shareable."""
        for g in self._groups:
            g.pool.reset_prefix_cache()

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
        num_total_blocks = _cdiv(num_total_tokens, self.block_size)
        seq = self._seqs.get(seq_id) if seq_id is not None else None
        if seq is None:
            return {g.spec.name: num_total_blocks for g in self._groups}
        out: dict[str, int] = {}
        for g in self._groups:
            held = len(seq.tables[g.spec.name])
            live = min(self._first_live_block(g, seq.num_computed), num_total_blocks)
            out[g.spec.name] = max(0, num_total_blocks - held) - max(0, live - held)
        return out
