"""L1's LRU-K (workers/stages/cache/lru_k.py): scan resistance, eviction order, per-language
shares."""

from __future__ import annotations

import threading

import pytest

from workers.stages.cache.lru_k import LRUK, LanguageLRUK


def test_entries_referenced_once_are_evicted_before_hot_ones_in_lru_order() -> None:
    cache: LRUK[str] = LRUK(3)
    cache.put("hot", "H")
    assert cache.get("hot") == "H"  # second reference: hot
    cache.put("a", "A")
    cache.put("b", "B")
    assert cache.put("c", "C") == "a"  # the oldest cold entry, not the older hot one
    assert cache.put("d", "D") == "b"
    assert "hot" in cache and cache.is_hot("hot") and not cache.is_hot("d")


def test_a_scan_of_new_texts_never_evicts_the_hot_entries() -> None:
    cache: LRUK[int] = LRUK(100)
    hot = [f"hot{i}" for i in range(80)]
    for key in hot:
        cache.put(key, 1)
        cache.get(key)
    for i in range(10_000):  # a one-off scan, 100x the capacity
        cache.put(f"scan{i}", 0)
    assert all(key in cache for key in hot)
    assert len(cache) == 100 and cache.evictions == 10_000 - 20


def test_plain_lru_would_have_lost_them() -> None:
    """The same trace against an LRU of the same size keeps none of the hot entries (what
    the scan test above guards against)."""
    from collections import OrderedDict

    lru: OrderedDict[str, int] = OrderedDict()
    for key in [f"hot{i}" for i in range(80)] + [f"scan{i}" for i in range(10_000)]:
        lru[key] = 1
        lru.move_to_end(key)
        if len(lru) > 100:
            lru.popitem(last=False)
    assert not any(k.startswith("hot") for k in lru)


def test_hot_entries_go_by_their_second_most_recent_reference() -> None:
    cache: LRUK[str] = LRUK(2)
    cache.put("a", "A")  # t1
    cache.put("b", "B")  # t2
    cache.get("a")  # t3: a's 2nd most recent = t1
    cache.get("b")  # t4: b's = t2
    cache.get("a")  # t5: a's = t3 (b's t2 is now the oldest)
    assert cache.put("c", "C") == "b"
    assert "a" in cache and "c" in cache


def test_a_text_evicted_cold_and_seen_again_comes_back_hot() -> None:
    cache: LRUK[str] = LRUK(2)
    cache.put("x", "X")
    cache.put("y", "Y")
    cache.put("z", "Z")  # evicts x (cold); x's reference is remembered
    assert "x" not in cache
    cache.put("x", "X")  # second reference: hot at once, evicts the cold y
    assert cache.is_hot("x") and "y" not in cache
    for i in range(50):  # a scan evicts only cold entries
        cache.put(f"s{i}", "S")
    assert "x" in cache


def test_put_refreshes_the_value_and_counts_as_a_reference() -> None:
    cache: LRUK[str] = LRUK(2)
    cache.put("a", "old")
    assert cache.put("a", "new") is None
    assert cache.get("a") == "new" and cache.is_hot("a")


def test_the_heap_stays_bounded_under_repeated_hits() -> None:
    cache: LRUK[int] = LRUK(4)
    for i in range(4):
        cache.put(i, i)
    for _ in range(10_000):
        for i in range(4):
            cache.get(i)
    assert len(cache._hot) <= 4 * 4 + 64 + 1


def test_each_language_gets_its_share_and_a_flood_stays_in_its_language() -> None:
    evicted: list[str] = []
    cache: LanguageLRUK[str] = LanguageLRUK(
        100, {"de": 2, "en": 1, "fr": 1}, on_evict=evicted.append
    )
    assert (cache.capacity_of("de"), cache.capacity_of("en"), cache.capacity_of("fr")) == (
        50,
        25,
        25,
    )
    assert cache.capacity_of("it") == 25  # unlisted: the smallest share
    for i in range(25):
        cache.put("en", f"en{i}", "x")
    for i in range(1000):  # a German flood
        cache.put("de", f"de{i}", "y")
    assert cache.sizes() == {"en": 25, "de": 50}
    assert all(cache.contains("en", f"en{i}") for i in range(25))
    assert evicted == ["de"] * 950


def test_a_star_share_applies_to_unlisted_languages() -> None:
    cache: LanguageLRUK[str] = LanguageLRUK(100, {"en": 3, "*": 1})
    assert cache.capacity_of("en") == 75 and cache.capacity_of("ja") == 25


def test_get_is_per_language() -> None:
    cache: LanguageLRUK[str] = LanguageLRUK(10, {"de": 1, "en": 1})
    cache.put("de", "k", "DE")
    assert cache.get("de", "k") == "DE" and cache.get("en", "k") is None


@pytest.mark.parametrize("bad", [{}, {"de": 0.0}, {"de": -1.0}])
def test_shares_must_be_positive(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="shares"):
        LanguageLRUK(10, bad)


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        LRUK(0)


def test_concurrent_gets_and_puts_keep_the_capacity() -> None:
    cache: LanguageLRUK[int] = LanguageLRUK(64, {"de": 1})

    def hammer(offset: int) -> None:
        for i in range(5000):
            cache.put("de", (offset + i) % 200, i)
            cache.get("de", (offset * 7 + i) % 200)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.sizes() == {"de": 64}
