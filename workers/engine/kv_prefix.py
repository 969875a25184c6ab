"""The KV cache manager's prefix cache: publishing written blocks, finding cached prefixes.

`PrefixCache` is a member of `KVCacheManager` (`kv.prefix`), over the manager's groups and
sequence tables (the same objects, shared: the manager allocates and frees, the prefix cache
hashes and publishes; kv_cache.py's notes describe the design as a whole):

* `find_cached_prefix`: a pure lookup of the longest cached prefix, whole blocks (every full
  group, and the live window of every sliding group) and then, with `share_partial_blocks`,
  the leading slots of one more block (`_partial_hit`);
* `commit_computed`: blocks that became full and written are published under their chain
  hash, and offer their leading slots for partial hits; `offer_tail`: a freed sequence's last,
  partly filled block offers its computed slots;
* `hold_copy` / `take_block_copies`: the copies of the partial hits of the last allocations,
  for the engine to run before the step's forward, their sources held until then; `reset`.

It also holds what both sides share: the group spec and block copy (`KVGroupSpec`,
`BlockCopy`, re-exported by kv_cache.py), a group with its pool (`KVGroup`), a sequence's
tables (`SeqBlocks`), the window rule (`first_live_block`) and the hash chain
(`extend_hashes`).
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
    "BlockCopy",
    "KVGroup",
    "KVGroupSpec",
    "PrefixCache",
    "SeqBlocks",
    "cdiv",
    "extend_hashes",
    "first_live_block",
]


def cdiv(a: int, b: int) -> int:
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
class KVGroup:
    """One KV group's spec and its pool."""

    spec: KVGroupSpec
    pool: BlockPool


@dataclass(slots=True)
class SeqBlocks:
    """One sequence's blocks in every group, and how far its prefix is hashed and published."""

    tables: dict[str, list[KVBlock]]  # per group; the null block where a block was dropped
    num_dropped: dict[str, int]  # per group: leading table entries already released (null)
    hashes: list[BlockHash] = field(default_factory=list)  # chain hashes of its full blocks
    num_published: int = 0  # leading full blocks already offered to the hash maps
    num_computed: int = 0  # highest num_computed seen (allocate_slots / commit_computed)


def first_live_block(group: KVGroup, num_computed: int, block_size: int) -> int:
    """Index of the first block still needed to compute position `num_computed`."""
    window = group.spec.sliding_window
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


def extend_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], num_blocks: int, block_size: int
) -> None:
    """Chain-hash the blocks of `token_ids` after the `hashes` known, up to `num_blocks`."""
    bs = block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_blocks):
        parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
        hashes.append(parent)


class PrefixCache:
    """The hashing side of `workers.engine.kv_cache.KVCacheManager` (module notes)."""

    def __init__(
        self,
        groups: list[KVGroup],
        seqs: dict[str, SeqBlocks],
        *,
        block_size: int,
        enable_prefix_caching: bool,
        share_partial_blocks: bool,
        stats: PrefixCacheStats,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.share_partial_blocks = share_partial_blocks
        self.stats = stats
        self._groups = groups  # the manager's: the same list
        self._seqs = seqs  # the manager's: the same dict
        # partial hits of this step: copies to run, and the sources held until they run
        self._copies: list[BlockCopy] = []
        self._copy_refs: list[tuple[BlockPool, KVBlock]] = []

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
                if run < k - first_live_block(g, k * bs, bs):
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
        extend_hashes(seq.hashes, token_ids, num_full, self.block_size)
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

    def offer_tail(self, seq: SeqBlocks, token_ids: Sequence[int]) -> None:
        """A freed sequence's last, partly filled block offers its computed slots."""
        i, r = divmod(min(seq.num_computed, len(token_ids)), self.block_size)
        if r == 0:
            return
        extend_hashes(seq.hashes, token_ids, i, self.block_size)
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

    def hold_copy(self, pool: BlockPool, src: KVBlock, copy: BlockCopy) -> None:
        """A first allocation's partial hit: `copy` runs before the next forward; its source
        block (touched by the caller) is held until then."""
        self._copy_refs.append((pool, src))
        self._copies.append(copy)

    def take_block_copies(self) -> list[BlockCopy]:
        """The partial-hit copies of the allocations since the last call, in order; their
        sources are released, so run the copies before the next allocation."""
        copies, self._copies = self._copies, []
        for pool, block in self._copy_refs:
            pool.free_blocks([block])
        self._copy_refs = []
        return copies

    def reset(self) -> None:
        """Forget all published prefixes (e.g. after weights change). Running sequences keep
        their blocks; they are simply no longer shareable."""
        for g in self._groups:
            g.pool.reset_prefix_cache()
