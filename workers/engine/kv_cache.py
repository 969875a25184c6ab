"""Paged KV cache manager: preallocated block pools, block tables and prefix caching.

Pure CPU bookkeeping in the spirit of vLLM v1's `kv_cache_manager.py` / `block_pool.py`; the
engine owns the tensors (`KVPools` of `prepare.py`: `k/v [num_blocks, block_size, kv_heads,
head_dim]` per layer, bound into the model's layers for each forward); the model only ever
sees block ids, through `block_table()` and `slot_mapping()`.

Design
------
* One `BlockPool` per KV group. A group is a set of layers with the same attention kind: "full"
  (every token kept) and, for Gemma 3, "sliding" (only the last `sliding_window` positions).
  Every pool has the same `block_size`, so block `i` of a sequence covers positions
  `[i * block_size, (i + 1) * block_size)` in every group and the hash chain is shared.
* Block 0 of every pool is the reserved NULL block: never handed out, never freed. A sliding
  group's table holds it for blocks that fell out of the window, so a table stays indexable by
  `position // block_size`.
* Blocks are preallocated `KVBlock` records (`slots=True`) with a refcount. A block with
  `ref_cnt == 0` sits in exactly one of two O(1) structures:
    - the free list (a deque, FIFO): blocks holding nothing reusable;
    - the evictable LRU (an OrderedDict keyed by block id): blocks holding a published prefix
      (`block_hash` set), in the order they were released. They still count as free capacity;
      `get_new_blocks` takes from the free list first and evicts the LRU head only when it is
      empty. A prefix hit (`touch`) pulls a block back out of the LRU in O(1).
* Prefix caching: once a block is FULL and its KV written (`commit_computed`), it gets a chain
  hash `sha256(parent_hash || token bytes)` and is published in its group's `hash -> block`
  map. The digest covers the whole chain, so equal tokens under different parents hash apart and
  a lookup can not be fooled by a weak-hash collision. If the hash is already published by
  another block the first one stays published; the duplicate stays private to its sequence and
  goes straight to the free list when released.
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

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

NULL_BLOCK_ID = 0

BlockHash = bytes  # sha256 digest of (parent digest, block tokens)

_ROOT_HASH: BlockHash = hashlib.sha256(b"tolk.kv_cache.root").digest()


def hash_block_tokens(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """Chain hash of one full block: sha256 over the parent's digest and the block's token ids."""
    h = hashlib.sha256(_ROOT_HASH if parent is None else parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def prefix_keys(parent: BlockHash | None, tokens: Sequence[int]) -> list[BlockHash]:
    """Keys of a block's leading slots: key `j - 1` is `hash_block_tokens(parent, tokens[:j])`."""
    h = hashlib.sha256(_ROOT_HASH if parent is None else parent)
    keys = []
    for token in tokens:
        h.update(array("q", (token,)).tobytes())
        keys.append(h.copy().digest())
    return keys


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
class KVBlock:
    block_id: int  # index into the group's k_cache/v_cache
    ref_cnt: int = 0  # sequences holding it; 0 = on the free list or in the evictable LRU
    block_hash: BlockHash | None = None  # set while published in the pool's hash map
    # keys under which its leading slots are offered for partial reuse (see BlockPool)
    prefix_keys: tuple[BlockHash, ...] = ()

    @property
    def reusable(self) -> bool:
        """Holds K/V that a lookup can find: kept in the evictable LRU once unreferenced."""
        return self.block_hash is not None or bool(self.prefix_keys)


@dataclass(slots=True)
class PrefixCacheStats:
    requests: int = 0  # sequences admitted (first allocate_slots) with prefix caching on
    queries: int = 0  # prompt tokens of those sequences
    hits: int = 0  # of those, tokens served from the prefix cache
    evictions: int = 0  # cached blocks evicted (hash dropped) to make room, all groups

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        self.requests = self.queries = self.hits = self.evictions = 0


class BlockPool:
    """The blocks of one KV group: free list, evictable LRU and the published-prefix map."""

    def __init__(self, num_blocks: int, stats: PrefixCacheStats | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need the null block plus at least one")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.stats = stats if stats is not None else PrefixCacheStats()
        self._free: deque[KVBlock] = deque(self.blocks[1:])  # ref 0, no hash; FIFO
        self._evictable: OrderedDict[int, KVBlock] = OrderedDict()  # ref 0, hashed; LRU first
        self._cached: dict[BlockHash, KVBlock] = {}  # published full blocks
        self._prefixes: dict[BlockHash, KVBlock] = {}  # leading slots of blocks, newest wins

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def num_free_blocks(self) -> int:
        """Blocks that `get_new_blocks` can hand out: free list + evictable."""
        return len(self._free) + len(self._evictable)

    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def num_prefix_keys(self) -> int:
        return len(self._prefixes)

    def evictable_ids(self) -> list[int]:
        """Evictable block ids, next to be evicted first (for tests and debugging)."""
        return list(self._evictable)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take `n` blocks (ref_cnt 1): the free list first, then evict LRU cached blocks."""
        if n > self.num_free_blocks():
            raise ValueError(f"cannot get {n} blocks, only {self.num_free_blocks()} free")
        out: list[KVBlock] = []
        for _ in range(n):
            if not self._free:
                self.evict()
            block = self._free.popleft()
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (prefix hit); an unreferenced one leaves the LRU."""
        for block in blocks:
            if block.ref_cnt == 0:
                if not block.reusable:
                    raise ValueError(f"block {block.block_id} is on the free list, not cached")
                del self._evictable[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the order given (callers pass tail first)."""
        for block in blocks:
            if block.block_id == NULL_BLOCK_ID or block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.reusable:
                    self._evictable[block.block_id] = block
                else:
                    self._free.append(block)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Publish a full, written block. False if another block already holds this hash."""
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def get_prefix_block(self, key: BlockHash) -> KVBlock | None:
        return self._prefixes.get(key)

    def offer_prefixes(self, block: KVBlock, keys: Sequence[BlockHash]) -> None:
        """Offer the block's leading slots under `keys` (key j-1 covers its first j tokens).
        Only for slots whose K/V is final: a published full block, or a freed sequence's tail."""
        for key in keys:
            self._prefixes[key] = block
        block.prefix_keys = (*block.prefix_keys, *keys)

    def _forget(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
        for key in block.prefix_keys:
            if self._prefixes.get(key) is block:  # a newer block may hold the key now
                del self._prefixes[key]
        block.prefix_keys = ()

    def evict(self) -> KVBlock | None:
        """Evict the least recently released cached block onto the free list; None if none."""
        if not self._evictable:
            return None
        _, block = self._evictable.popitem(last=False)
        assert block.reusable
        self._forget(block)
        self._free.append(block)
        self.stats.evictions += 1
        return block

    def reset_prefix_cache(self) -> None:
        """Forget every published hash; unreferenced cached blocks go back to the free list."""
        for block in [*self._cached.values(), *self._prefixes.values()]:
            block.block_hash = None
            block.prefix_keys = ()
        self._cached.clear()
        self._prefixes.clear()
        self._free.extend(self._evictable.values())
        self._evictable.clear()


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
