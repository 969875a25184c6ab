"""One KV group's block pool: preallocated, refcounted blocks, the free list, the evictable LRU
and the prefix-hash maps (full blocks and partial-block keys).

Pure CPU bookkeeping in the spirit of vLLM v1's `block_pool.py`; `KVCacheManager`
(`kv_cache.py`) keeps one `BlockPool` per KV group and builds the sequences' block tables from
the blocks handed out here. The pool knows nothing of sequences, windows or positions: it hands
out blocks, takes references, releases them and answers hash lookups.

Design
------
* Block 0 of every pool is the reserved NULL block: never handed out, never freed (the manager
  puts it in a sliding group's table where a block fell out of the window).
* Blocks are preallocated `KVBlock` records (`slots=True`) with a refcount. A block with
  `ref_cnt == 0` sits in exactly one of two O(1) structures:
    - the free list (a deque, FIFO): blocks holding nothing reusable;
    - the evictable LRU (an OrderedDict keyed by block id): blocks holding a published prefix
      (`block_hash` set), in the order they were released. They still count as free capacity;
      `get_new_blocks` takes from the free list first and evicts the LRU head only when it is
      empty. A prefix hit (`touch`) pulls a block back out of the LRU in O(1).
* Prefix caching: a FULL block whose KV is written is published under its chain hash
  `sha256(parent_hash || token bytes)` (`hash_block_tokens`) in the pool's `hash -> block` map.
  The digest covers the whole chain, so equal tokens under different parents hash apart and a
  lookup can not be fooled by a weak-hash collision. If the hash is already published by
  another block the first one stays published; the duplicate stays private to its sequence and
  goes straight to the free list when released.
* Partial-block keys: a block may also offer its first `j` slots under
  `hash_block_tokens(parent, first j tokens)` (`prefix_keys`, `offer_prefixes`); the newest
  block offering a key holds it. Such a block waits in the evictable LRU like a cached full
  block; evicting it (or resetting the cache) forgets its hash and every key it still holds.
* `free_blocks` drops references in the order given; the manager passes a sequence's blocks tail
  first, so in the LRU the tail of a chain is evicted before its head.

Nothing here imports torch; the engine runs on a single thread, so there are no locks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

NULL_BLOCK_ID = 0

BlockHash = bytes  # sha256 digest of (parent digest, block tokens)

# the seed names kv_cache.py, where this lived first: kept so that every digest stays the same
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
