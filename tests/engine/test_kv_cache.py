"""KV cache manager: exact block ids, refcounts, prefix hits, LRU order, sliding windows.

Tiny pools (block_size 4, 6-16 blocks; block 0 is the null block) so every id can be asserted.
Whole-block behaviour is tested with partial blocks off (`partial=False`, the helpers' default);
the partial-block hits have their own section at the end.
"""

from __future__ import annotations

import pytest

from workers.engine.kv_cache import (
    BlockCopy,
    BlockPool,
    KVCacheManager,
    KVGroupSpec,
    hash_block_tokens,
    prefix_keys,
)

BS = 4


def full_only(num_blocks: int = 8, caching: bool = True, partial: bool = False) -> KVCacheManager:
    return KVCacheManager([KVGroupSpec("full", num_blocks, BS, None)], caching, partial)


def full_and_sliding(
    full_blocks: int = 16, sliding_blocks: int = 8, window: int = 8, partial: bool = False
) -> KVCacheManager:
    return KVCacheManager(
        [
            KVGroupSpec("full", full_blocks, BS, None),
            KVGroupSpec("sliding", sliding_blocks, BS, window),
        ],
        share_partial_blocks=partial,
    )


def toks(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def refs(m: KVCacheManager, group: str, ids: list[int]) -> list[int]:
    return [m.pool(group).blocks[i].ref_cnt for i in ids]


def run_and_free(
    m: KVCacheManager, seq_id: str, tokens: list[int], offer_tail: bool = False
) -> None:
    """Prefill `tokens` in one step, publish its full blocks, then finish it (`offer_tail`:
    passing its tokens to `free`, which offers its partly filled last block)."""
    assert m.allocate_slots(seq_id, tokens, 0, len(tokens))
    m.prefix.commit_computed(seq_id, tokens, len(tokens))
    m.free(seq_id, tokens if offer_tail else None)


# ---------------------------------------------------------------- allocation


def test_block_ids_handed_out_in_order_and_free_list_is_fifo() -> None:
    m = full_only(8)
    a = toks(10)
    assert m.allocate_slots("a", a, 0, 10)
    assert m.block_table("a", "full") == [1, 2, 3]
    assert m.allocate_slots("b", toks(4, 500), 0, 4)
    assert m.block_table("b", "full") == [4]
    assert m.num_free_blocks("full") == 3
    # Decode inside the last block needs nothing; crossing a boundary takes the next id.
    assert m.allocate_slots("a", a, 10, 2)
    assert m.block_table("a", "full") == [1, 2, 3]
    assert m.allocate_slots("a", a + [1], 12, 1)
    assert m.block_table("a", "full") == [1, 2, 3, 5]
    # Nothing committed -> no hashes -> straight to the free list, tail first.
    m.free("a")
    assert m.num_free_blocks("full") == 6
    assert m.pool("full").num_evictable_blocks() == 0
    assert m.allocate_slots("c", toks(16, 900), 0, 16)
    assert m.block_table("c", "full") == [6, 7, 5, 3]
    m.free("unknown")  # ignored


def test_slot_mapping() -> None:
    m = full_only(8)
    assert m.allocate_slots("a", toks(10), 0, 10)  # blocks [1, 2, 3]
    assert m.slot_mapping("a", "full", 3, 6) == [7, 8, 9]
    assert m.slot_mapping("a", "full", 8, 12) == [12, 13, 14, 15]
    with pytest.raises(ValueError):
        m.slot_mapping("a", "full", 0, 13)


def test_all_or_nothing_allocation() -> None:
    m = full_only(8)
    a = toks(20)
    assert m.allocate_slots("a", a, 0, 20)
    assert m.block_table("a", "full") == [1, 2, 3, 4, 5]
    assert not m.allocate_slots("b", toks(12, 500), 0, 12)  # needs 3, 2 free
    assert "b" not in m
    assert not m.allocate_slots("a", a, 20, 12)  # needs 3 more
    assert m.block_table("a", "full") == [1, 2, 3, 4, 5]
    assert m.num_free_blocks("full") == 2
    assert m.stats.requests == 1
    assert m.allocate_slots("a", a, 20, 8)  # needs exactly 2
    assert m.block_table("a", "full") == [1, 2, 3, 4, 5, 6, 7]
    assert m.num_free_blocks("full") == 0
    assert m.usage() == 1.0


def test_all_or_nothing_across_groups() -> None:
    m = full_and_sliding(full_blocks=16, sliding_blocks=4, window=8)
    assert m.allocate_slots("a", toks(10), 0, 10)
    assert m.block_table("a", "sliding") == [1, 2, 3]
    assert not m.allocate_slots("b", toks(4, 500), 0, 4)  # full has room, sliding has none
    assert "b" not in m
    assert m.num_free_blocks("full") == 12
    assert m.num_free_blocks("sliding") == 0


def test_all_or_nothing_counts_cached_hits_taken_from_the_lru() -> None:
    m = full_only(6)  # 5 usable
    a = toks(12)
    run_and_free(m, "a", a)  # evictable [3, 2, 1], free list [4, 5]
    assert m.allocate_slots("c", toks(8, 700), 0, 8)
    assert m.block_table("c", "full") == [4, 5]
    d = a[:8] + toks(9, 300)
    assert m.prefix.find_cached_prefix(d) == 8
    # 2 hits out of the LRU + 3 fresh = 5 > 3 evictable: refused, nothing touched.
    assert not m.allocate_slots("d", d, 8, 9)
    assert m.pool("full").evictable_ids() == [3, 2, 1]
    assert refs(m, "full", [1, 2, 3]) == [0, 0, 0]
    assert m.stats.evictions == 0
    # 2 hits + 1 fresh fits: the hits are touched first, so the fresh block evicts 3, not them.
    assert m.allocate_slots("d", d, 8, 1)
    assert m.block_table("d", "full") == [1, 2, 3]
    assert refs(m, "full", [1, 2, 3]) == [1, 1, 1]
    assert m.pool("full").evictable_ids() == []
    assert m.stats.evictions == 1


def test_free_returns_blocks_and_usage() -> None:
    m = full_only(8)
    assert m.allocate_slots("a", toks(10), 0, 10)
    assert m.usage() == pytest.approx(3 / 7)
    m.prefix.commit_computed("a", toks(10), 10)  # blocks 1, 2 published; 3 partial
    m.free("a")
    assert m.num_free_blocks("full") == 7
    assert m.usage() == 0.0
    assert m.pool("full").evictable_ids() == [2, 1]
    assert refs(m, "full", [1, 2, 3]) == [0, 0, 0]


# ------------------------------------------------------------ prefix caching


def test_shared_prefix_refcounts() -> None:
    m = full_only(16)
    p = toks(10)
    assert m.allocate_slots("a", p, 0, 10)
    m.prefix.commit_computed("a", p, 10)
    assert m.pool("full").num_cached_blocks() == 2
    q = p[:8] + [7, 7, 7]
    assert m.prefix.find_cached_prefix(q) == 8
    assert m.allocate_slots("b", q, 8, 3)
    assert m.block_table("b", "full") == [1, 2, 4]
    assert refs(m, "full", [1, 2, 3, 4]) == [2, 2, 1, 1]
    m.free("a")
    assert refs(m, "full", [1, 2, 3, 4]) == [1, 1, 0, 1]
    assert m.pool("full").evictable_ids() == []  # 3 had no hash, 1 and 2 still held
    m.free("b")
    assert m.pool("full").evictable_ids() == [2, 1]  # tail first


def test_prefix_hit_is_block_aligned_and_never_the_whole_prompt() -> None:
    m = full_only(16)
    p = toks(10)
    assert m.allocate_slots("a", p, 0, 10)
    m.prefix.commit_computed("a", p, 10)
    assert m.prefix.find_cached_prefix(p) == 8
    assert m.prefix.find_cached_prefix(p[:9]) == 8
    assert m.prefix.find_cached_prefix(p[:8]) == 4  # 8 cached, but one token must be computed
    assert m.prefix.find_cached_prefix(p[:7]) == 4
    assert m.prefix.find_cached_prefix(p[:4]) == 0
    assert m.prefix.find_cached_prefix(p[:1]) == 0
    assert m.prefix.find_cached_prefix([]) == 0
    with pytest.raises(ValueError):
        m.allocate_slots("b", p[:8], 8, 0)  # the whole prompt can not be a hit
    with pytest.raises(ValueError):
        m.allocate_slots("b", p, 6, 4)  # not block aligned
    with pytest.raises(ValueError):
        m.allocate_slots("b", toks(9, 500), 4, 5)  # not cached


def test_find_cached_prefix_is_a_pure_lookup() -> None:
    m = full_only(8)
    a = toks(12)
    run_and_free(m, "a", a)
    before = (m.stats.requests, m.stats.queries, m.stats.hits)
    for _ in range(3):
        assert m.prefix.find_cached_prefix(a + [1]) == 12
    assert m.pool("full").evictable_ids() == [3, 2, 1]
    assert refs(m, "full", [1, 2, 3]) == [0, 0, 0]
    assert (m.stats.requests, m.stats.queries, m.stats.hits) == before


def test_lru_evicts_tail_before_head() -> None:
    m = full_only(8)  # 7 usable
    a = toks(12)
    run_and_free(m, "a", a)  # blocks [1, 2, 3], all full and published
    assert m.pool("full").evictable_ids() == [3, 2, 1]
    assert m.allocate_slots("b", toks(16, 500), 0, 16)
    assert m.block_table("b", "full") == [4, 5, 6, 7]  # free list first, no eviction
    assert m.stats.evictions == 0
    assert m.allocate_slots("c", toks(8, 900), 0, 8)
    assert m.block_table("c", "full") == [3, 2]  # evicted: the tail 3, then 2
    assert m.stats.evictions == 2
    assert m.pool("full").evictable_ids() == [1]
    assert m.pool("full").blocks[3].block_hash is None
    assert m.prefix.find_cached_prefix(a + [1]) == 4  # only the head block survived


def test_prefix_hit_takes_blocks_out_of_the_lru() -> None:
    m = full_only(8)
    a = toks(12)
    run_and_free(m, "a", a)  # evictable [3, 2, 1], free list [4, 5, 6, 7]
    d = a[:8] + [1, 1, 1]
    assert m.prefix.find_cached_prefix(d) == 8
    assert m.allocate_slots("d", d, 8, 3)
    assert m.block_table("d", "full") == [1, 2, 4]
    assert m.pool("full").evictable_ids() == [3]
    assert m.num_free_blocks("full") == 4  # free list [5, 6, 7] + evictable [3]
    m.free("d")
    assert m.pool("full").evictable_ids() == [3, 2, 1]  # 4 had no hash


def test_same_tokens_under_different_parents_hash_apart() -> None:
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert root == hash_block_tokens(None, [1, 2, 3, 4])
    assert len(root) == 32
    other_parent = hash_block_tokens(None, [9, 9, 9, 9])
    assert hash_block_tokens(other_parent, [1, 2, 3, 4]) != root
    assert hash_block_tokens(root, [1, 2, 3, 4]) != root

    m = full_only(16)
    a = [9, 9, 9, 9, 1, 2, 3, 4, 5]
    assert m.allocate_slots("a", a, 0, 9)
    m.prefix.commit_computed("a", a, 9)
    assert (
        m.prefix.find_cached_prefix([7, 7, 7, 7, 1, 2, 3, 4, 5]) == 0
    )  # same 2nd block, other parent
    assert m.prefix.find_cached_prefix([9, 9, 9, 9, 1, 2, 3, 4, 6]) == 8
    assert m.prefix.find_cached_prefix([9, 9, 9, 9, 1, 2, 3, 5, 5]) == 4


def test_publishing_the_same_content_twice_keeps_the_first() -> None:
    m = full_only(16)
    p = toks(9)
    assert m.allocate_slots("a", p, 0, 9)
    assert m.allocate_slots("b", p, 0, 9)  # both admitted before either computed
    assert m.block_table("a", "full") == [1, 2, 3]
    assert m.block_table("b", "full") == [4, 5, 6]
    m.prefix.commit_computed("a", p, 9)
    m.prefix.commit_computed("b", p, 9)
    pool = m.pool("full")
    assert pool.num_cached_blocks() == 2
    assert pool.get_cached_block(hash_block_tokens(None, p[:4])) is pool.blocks[1]
    assert pool.blocks[4].block_hash is None
    assert pool.blocks[5].block_hash is None
    assert not pool.cache_full_block(pool.blocks[4], hash_block_tokens(None, p[:4]))
    m.free("b")
    assert pool.evictable_ids() == []  # duplicates went straight to the free list
    m.free("a")
    assert pool.evictable_ids() == [2, 1]
    assert m.prefix.find_cached_prefix(p) == 8


def test_commit_publishes_only_full_blocks_incrementally() -> None:
    m = full_only(16)
    p = toks(6)
    assert m.allocate_slots("a", p, 0, 6)
    m.prefix.commit_computed("a", p, 6)
    assert m.pool("full").num_cached_blocks() == 1
    p = p + [1, 2]  # two decode steps fill block 1
    assert m.allocate_slots("a", p, 6, 1)
    m.prefix.commit_computed("a", p, 7)
    assert m.pool("full").num_cached_blocks() == 1
    assert m.allocate_slots("a", p, 7, 1)
    m.prefix.commit_computed("a", p, 8)
    assert m.pool("full").num_cached_blocks() == 2
    assert m.prefix.find_cached_prefix(p + [3]) == 8


def test_stats_counters() -> None:
    m = full_only(8)
    a = toks(12)
    run_and_free(m, "a", a)
    d = a[:8] + [1, 1, 1]
    assert m.allocate_slots("d", d, m.prefix.find_cached_prefix(d), 3)
    assert m.allocate_slots("e", toks(16, 500), 0, 16)  # free list 5, 6, 7, then evict 3
    assert m.block_table("e", "full") == [5, 6, 7, 3]
    assert (m.stats.requests, m.stats.queries, m.stats.hits) == (3, 12 + 11 + 16, 8)
    assert m.stats.evictions == 1
    assert m.stats.hit_rate == pytest.approx(8 / 39)
    m.stats.reset()
    assert (m.stats.requests, m.stats.queries, m.stats.hits, m.stats.evictions) == (0, 0, 0, 0)


def test_prefix_caching_disabled() -> None:
    m = full_only(8, caching=False)
    a = toks(12)
    run_and_free(m, "a", a)
    assert m.prefix.find_cached_prefix(a + [1]) == 0
    assert m.pool("full").num_cached_blocks() == 0
    assert m.pool("full").evictable_ids() == []
    assert m.num_free_blocks("full") == 7
    assert m.stats.requests == 0
    with pytest.raises(ValueError):
        m.allocate_slots("b", a + [1], 4, 9)


def test_reset_prefix_cache() -> None:
    m = full_only(8)
    a = toks(12)
    run_and_free(m, "a", a)
    b = toks(9, 500)
    assert m.allocate_slots("b", b, 0, 9)
    m.prefix.commit_computed("b", b, 9)  # b holds published blocks 4, 5
    m.prefix.reset()
    pool = m.pool("full")
    assert pool.num_cached_blocks() == 0
    assert pool.evictable_ids() == []
    assert m.num_free_blocks("full") == 4
    assert m.prefix.find_cached_prefix(a + [1]) == 0
    assert m.prefix.find_cached_prefix(b) == 0
    m.free("b")
    assert pool.evictable_ids() == []
    assert m.num_free_blocks("full") == 7


# ------------------------------------------------------------ sliding window


def test_sliding_window_bounds_live_blocks() -> None:
    window = 8
    m = full_and_sliding(full_blocks=16, sliding_blocks=8, window=window)
    cap = -(-window // BS) + 1  # 3
    tokens = toks(5)
    assert m.allocate_slots("a", tokens, 0, 5)
    m.prefix.commit_computed("a", tokens, 5)
    assert m.block_table("a", "sliding") == [1, 2]
    tokens.append(1000)
    c = 5
    while c < 40:  # one decode step per iteration
        assert m.allocate_slots("a", tokens, c, 1)
        table = m.block_table("a", "sliding")
        live = [b for b in table if b != 0]
        assert len(live) <= cap
        first_live = max(0, c - window + 1) // BS
        assert table[:first_live] == [0] * first_live
        assert 0 not in table[first_live:]
        m.prefix.commit_computed("a", tokens, c + 1)
        tokens.append(1000 + c)
        c += 1
    # Last step computed position 39: positions [32, 40) are live, blocks 8 and 9.
    # Sliding pool (7 usable): blocks 1..7 for indices 0..6, then indices 7, 8, 9 evicted
    # the earliest dropped blocks 1, 2, 3 from the LRU.
    assert m.block_table("a", "sliding") == [0] * 8 + [2, 3]
    assert m.block_table("a", "full") == list(range(1, 11))
    assert m.stats.evictions == 3
    assert m.slot_mapping("a", "sliding", 39, 40) == [3 * BS + 3]
    with pytest.raises(ValueError):
        m.slot_mapping("a", "sliding", 31, 33)  # position 31 is out of the window
    assert m.num_blocks_needed("a", 40) == {"full": 0, "sliding": 0}
    assert m.num_blocks_needed("a", 41) == {"full": 1, "sliding": 1}
    assert m.num_blocks_needed(None, 10) == {"full": 3, "sliding": 3}
    m.free("a")
    assert m.num_free_blocks("sliding") == 7
    assert m.num_free_blocks("full") == 15


def test_find_cached_prefix_needs_the_in_window_sliding_blocks() -> None:
    m = full_and_sliding(full_blocks=16, sliding_blocks=8, window=8)
    p = toks(21)
    assert m.allocate_slots("a", p, 0, 21)
    assert m.block_table("a", "sliding") == [1, 2, 3, 4, 5, 6]
    m.prefix.commit_computed("a", p, 21)  # block indices 0..4 published in both groups
    assert m.allocate_slots("a", p + [999], 21, 1)
    # Position 21 attends to [14, 21]: indices 0..2 (positions 0..11) leave the window.
    assert m.block_table("a", "sliding") == [0, 0, 0, 4, 5, 6]
    assert m.pool("sliding").evictable_ids() == [3, 2, 1]

    assert m.prefix.find_cached_prefix(p[:20] + [7]) == 20  # needs indices 3, 4
    assert m.prefix.find_cached_prefix(p[:16] + [7]) == 16  # needs indices 2, 3
    assert m.pool("sliding").evict() is m.pool("sliding").blocks[3]  # drop index 2
    # A full-only cache would still hit 16; the sliding group now needs index 2 for 16 and 12,
    # while 8 only needs indices 0, 1.
    assert m.prefix.find_cached_prefix(p[:16] + [7]) == 8
    assert m.prefix.find_cached_prefix(p[:20] + [7]) == 20

    b = p[:20] + [7]
    assert m.allocate_slots("b", b, 20, 1)
    assert m.block_table("b", "full") == [1, 2, 3, 4, 5, 7]
    assert m.block_table("b", "sliding") == [0, 0, 0, 4, 5, 7]
    assert refs(m, "full", [1, 2, 3, 4, 5]) == [2, 2, 2, 2, 2]
    assert refs(m, "sliding", [1, 2, 4, 5, 6, 7]) == [0, 0, 2, 2, 1, 1]
    assert (m.stats.requests, m.stats.queries, m.stats.hits, m.stats.evictions) == (2, 42, 20, 1)


# ----------------------------------------------------------------- BlockPool


def test_block_pool_primitives() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1]
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert pool.cache_full_block(blocks[0], h)
    assert pool.cache_full_block(blocks[0], h)  # idempotent
    assert pool.get_cached_block(h) is blocks[0]
    pool.free_blocks(reversed(blocks))
    assert pool.evictable_ids() == [1]
    assert pool.num_free_blocks() == 3
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1
    assert pool.evictable_ids() == []
    with pytest.raises(ValueError):
        pool.touch([pool.blocks[2]])  # on the free list, not cached
    pool.free_blocks([blocks[0]])
    assert pool.evict() is blocks[0]
    assert pool.evict() is None
    assert pool.get_cached_block(h) is None
    with pytest.raises(ValueError):
        pool.free_blocks([pool.null_block])
    with pytest.raises(ValueError):
        BlockPool(1)


def test_rejects_bad_group_specs() -> None:
    with pytest.raises(ValueError):
        KVCacheManager([])
    with pytest.raises(ValueError):
        KVCacheManager([KVGroupSpec("full", 8, 4, None), KVGroupSpec("sliding", 8, 8, 16)])
    with pytest.raises(ValueError):
        KVCacheManager([KVGroupSpec("full", 8, 4, None), KVGroupSpec("full", 8, 4, None)])


# ------------------------------------------------------------ partial blocks


def test_prefix_keys_extend_the_block_hash_chain() -> None:
    parent = hash_block_tokens(None, [1, 2, 3, 4])
    keys = prefix_keys(parent, [5, 6, 7, 8])
    assert keys == [hash_block_tokens(parent, [5, 6, 7, 8][:j]) for j in range(1, 5)]
    assert keys[-1] == hash_block_tokens(parent, [5, 6, 7, 8])  # the whole block's own hash
    assert prefix_keys(None, [5])[0] != prefix_keys(parent, [5])[0]  # the parent counts


def test_partial_hit_copies_the_leading_slots_of_a_published_block() -> None:
    m = full_only(16, partial=True)
    a = toks(10)
    assert m.allocate_slots("a", a, 0, 10)
    assert m.block_table("a", "full") == [1, 2, 3]
    m.prefix.commit_computed("a", a, 10)
    m.free("a", a)  # tail block 3 (2 slots) offered too; released tail first
    assert m.pool("full").evictable_ids() == [3, 2, 1]
    b = a[:6] + [999, 998]  # one whole block, then 2 of block 2's 4 tokens
    assert m.prefix.find_cached_prefix(b) == 6
    assert m.allocate_slots("b", b, 6, 2)
    assert m.block_table("b", "full") == [1, 4]  # block 1 shared, a fresh block for the rest
    assert refs(m, "full", [1, 2, 4]) == [1, 1, 1]  # the copy's source is held ...
    assert m.prefix.take_block_copies() == [BlockCopy("full", 2, 4, 2)]
    assert refs(m, "full", [1, 2, 4]) == [1, 0, 1]  # ... until the copy is taken
    assert m.pool("full").evictable_ids() == [3, 2]
    assert m.prefix.take_block_copies() == []
    assert m.stats.hits == 6


def test_partial_hit_from_a_freed_sequences_tail() -> None:
    """A warmed prefix that ends inside a block: its tail slots are reused, not recomputed."""
    m = full_only(16, partial=True)
    prefix = toks(6)
    warm = [*prefix, 7]  # prefilled 6 tokens, sampled one, finished
    assert m.allocate_slots("w", warm, 0, 6)
    m.prefix.commit_computed("w", warm, 6)
    m.free("w", warm)
    req = [*prefix, 500, 501, 502]
    assert m.prefix.find_cached_prefix(req) == 6
    assert m.allocate_slots("r", req, 6, 3)
    assert m.prefix.take_block_copies() == [BlockCopy("full", 2, 3, 2)]
    assert m.block_table("r", "full") == [1, 3, 4]
    # without the tokens, free() offers nothing: the tail goes to the free list
    m.free("r")
    assert m.prefix.find_cached_prefix([*prefix, 500, 501, 502, 9]) == 6


def test_partial_hit_leaves_one_token_to_compute() -> None:
    m = full_only(16, partial=True)
    p = toks(8)
    run_and_free(m, "a", p)
    assert m.prefix.find_cached_prefix(p) == 7  # 1 block + 3 of block 2's 4 slots
    assert m.prefix.find_cached_prefix(p[:5]) == 4  # a block boundary: nothing partial left to take
    assert m.prefix.find_cached_prefix(p[:3]) == 2  # inside the first block
    assert m.allocate_slots("b", p[:3], 2, 1)
    assert m.prefix.take_block_copies() == [BlockCopy("full", 1, 3, 2)]


def test_partial_hit_needs_every_group_and_copies_in_each() -> None:
    m = full_and_sliding(16, 8, window=8, partial=True)
    a = toks(10)
    run_and_free(m, "a", a)  # offers no tail: run_and_free passes no tokens to free()
    b = a[:6] + [999, 998]
    assert m.prefix.find_cached_prefix(b) == 6
    assert m.allocate_slots("b", b, 6, 2)
    assert m.prefix.take_block_copies() == [
        BlockCopy("full", 2, 4, 2),
        BlockCopy("sliding", 2, 4, 2),
    ]
    # a key missing from one group's pool caps the hit at the whole blocks
    m.free("b", b)
    m.pool("sliding").reset_prefix_cache()
    assert m.prefix.find_cached_prefix(b) == 0


def test_evicting_the_holder_of_a_key_ends_partial_hits() -> None:
    m = full_only(6, partial=True)  # 5 usable blocks
    a = toks(6)
    assert m.allocate_slots("a", a, 0, 6)
    m.prefix.commit_computed("a", a, 6)
    m.free("a", a)  # blocks 1 (full) and 2 (tail, 2 slots) evictable
    assert m.prefix.find_cached_prefix([*a[:5], 77]) == 5
    assert m.allocate_slots("x", toks(12, 900), 0, 12)  # free list 3, 4, 5
    assert m.allocate_slots("y", toks(4, 800), 0, 4)  # evicts the LRU head: block 2, the tail
    assert m.block_table("y", "full") == [2]
    assert m.prefix.find_cached_prefix([*a[:5], 77]) == 4  # block 1 still whole-cached
    assert m.stats.evictions == 1


def test_newest_block_holds_a_key_and_an_older_ones_eviction_keeps_it() -> None:
    m = full_only(16, partial=True)
    first, second = [*toks(6), 1], [*toks(6), 2]  # same 6 computed tokens, both finish
    for sid, ids in (("p", first), ("q", second)):
        assert m.allocate_slots(sid, ids, 0, 6)
        m.prefix.commit_computed(sid, ids, 6)
    m.free("p", first)
    m.free("q", second)  # q's tail (block 4) now holds the keys of the first 2 slots
    key = prefix_keys(hash_block_tokens(None, toks(4)), toks(2, 104))[-1]
    pool = m.pool("full")
    assert pool.get_prefix_block(key) is pool.blocks[4]
    pool.evict()  # LRU head: p's tail, block 2 (tails are released first)
    assert pool.get_prefix_block(key) is pool.blocks[4]


def test_partial_hits_are_off_on_request() -> None:
    m = full_only(16, partial=False)
    a = toks(10)
    run_and_free(m, "a", a, offer_tail=True)
    assert m.pool("full").num_prefix_keys() == 0
    assert m.prefix.find_cached_prefix(a[:6] + [1, 2]) == 4
    with pytest.raises(ValueError, match="not a cached prefix"):
        m.allocate_slots("b", a[:6] + [1, 2], 6, 2)


def test_reset_forgets_partial_keys() -> None:
    m = full_only(16, partial=True)
    a = toks(10)
    run_and_free(m, "a", a, offer_tail=True)
    assert m.pool("full").num_prefix_keys() > 0
    m.prefix.reset()
    assert m.pool("full").num_prefix_keys() == 0
    assert m.prefix.find_cached_prefix(a[:6] + [1, 2]) == 0
    assert m.num_free_blocks("full") == 15
