"""L1 of the exact-match cache: a language-aware LRU-K (K = 2) in the worker's memory.

Why LRU-K and not LRU: support traffic is a few hot texts ("Vielen Dank.", "hi, how can i
help you?") among a long tail seen once. Under LRU a burst of new sentences (a scan) pushes
every hot entry out. LRU-K (O'Neil, O'Neil and Weikum, 1993) ranks an entry by the time of its
K-th most recent reference instead of its last one: an entry referenced fewer than K times has
an infinite backward K-distance and is evicted before any entry referenced K times. With K = 2
a one-off scan only ever evicts other one-off entries, and the hot entries stay.

The rules here, per language:

* a reference is a `put` (the translation was made) or a `get` hit;
* the victim is the entry with fewer than K references whose last reference is oldest (the
  "cold" list, plain LRU order), and only when there is none, the entry whose K-th most
  recent reference is oldest (the "hot" entries, in a heap with lazy deletion);
* the reference history of evicted entries is retained for a while (as many keys as the
  language's capacity, LRU): a text evicted cold and translated again soon comes back with
  its earlier reference counted, so it enters hot (LRU-K's retained information);
* each language has its own share of the total capacity (`shares`: a weight per language,
  "*" for the others), so a flood in one language never evicts another language's entries.

Time is a logical counter (one tick per reference), so the order is exact and tests are
deterministic. Every method takes one lock: `get` runs on the worker's poll thread, `put` on
the engine's thread. Evictions are reported to `on_evict(lang)` (the worker's metrics).
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["LanguageLRUK", "LRUK"]

K = 2  # references that make an entry "hot"

_V = TypeVar("_V")


@dataclass(slots=True)
class _Entry(Generic[_V]):
    value: _V
    last: int  # logical time of the most recent reference
    previous: int | None  # of the one before (None: referenced once)


class LRUK(Generic[_V]):
    """One language's LRU-2 of at most `capacity` entries (not thread-safe: `LanguageLRUK`
    holds the lock)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self.capacity = capacity
        self._entries: dict[Hashable, _Entry[_V]] = {}
        self._cold: OrderedDict[Hashable, None] = OrderedDict()  # < K references, LRU first
        self._hot: list[tuple[int, Hashable]] = []  # (K-th most recent reference, key), lazy
        self._history: OrderedDict[Hashable, int] = OrderedDict()  # evicted key -> its last
        self._time = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def is_hot(self, key: Hashable) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.previous is not None

    def get(self, key: Hashable) -> _V | None:
        """The value, counted as a reference; None on a miss."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._reference(key, entry)
        return entry.value

    def put(self, key: Hashable, value: _V) -> Hashable | None:
        """Insert or refresh `key`, counted as a reference; returns the evicted key, if any."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.value = value
            self._reference(key, entry)
            return None
        evicted = self._evict() if len(self._entries) >= self.capacity else None
        self._time += 1
        earlier = self._history.pop(key, None)  # referenced before it was evicted
        entry = _Entry(value, self._time, earlier)
        self._entries[key] = entry
        if earlier is None:
            self._cold[key] = None
        else:
            heapq.heappush(self._hot, (earlier, key))
        return evicted

    def _reference(self, key: Hashable, entry: _Entry[_V]) -> None:
        self._time += 1
        if entry.previous is None:
            self._cold.pop(key, None)  # second reference: cold -> hot
        entry.previous, entry.last = entry.last, self._time
        heapq.heappush(self._hot, (entry.previous, key))
        if len(self._hot) > 4 * len(self._entries) + 64:
            self._compact()

    def _evict(self) -> Hashable:
        if self._cold:
            key, _ = self._cold.popitem(last=False)
        else:
            while True:
                kth, key = heapq.heappop(self._hot)
                entry = self._entries.get(key)
                if entry is not None and entry.previous == kth:
                    break  # the heap's current record of this entry, not a stale one
        entry = self._entries.pop(key)
        self._history[key] = entry.last
        while len(self._history) > self.capacity:
            self._history.popitem(last=False)
        self.evictions += 1
        return key

    def _compact(self) -> None:
        """Drop the heap's stale records (an entry referenced again pushed a new one)."""
        self._hot = [(e.previous, k) for k, e in self._entries.items() if e.previous is not None]
        heapq.heapify(self._hot)


class LanguageLRUK(Generic[_V]):
    """`LRUK` per language with a share of `capacity` each (module notes); thread-safe."""

    def __init__(
        self,
        capacity: int,
        shares: Mapping[str, float],
        on_evict: Callable[[str], None] = lambda lang: None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        if not shares or any(not w > 0 for w in shares.values()):
            raise ValueError(f"shares must be positive weights, got {dict(shares)!r}")
        self.capacity = capacity
        total = sum(shares.values())
        self._fractions = {lang: w / total for lang, w in shares.items()}
        # a language without its own share gets "*"'s, else the smallest listed one
        self._other_fraction = self._fractions.get("*", min(self._fractions.values()))
        self.on_evict = on_evict
        self._lock = threading.Lock()
        self._caches: dict[str, LRUK[_V]] = {}

    def capacity_of(self, lang: str) -> int:
        fraction = self._fractions.get(lang, self._other_fraction)
        return max(1, math.floor(self.capacity * fraction))

    def _cache(self, lang: str) -> LRUK[_V]:
        cache = self._caches.get(lang)
        if cache is None:
            cache = self._caches[lang] = LRUK(self.capacity_of(lang))
        return cache

    def get(self, lang: str, key: Hashable) -> _V | None:
        with self._lock:
            cache = self._caches.get(lang)
            return None if cache is None else cache.get(key)

    def put(self, lang: str, key: Hashable, value: _V) -> None:
        with self._lock:
            evicted = self._cache(lang).put(key, value)
        if evicted is not None:
            self.on_evict(lang)

    def contains(self, lang: str, key: Hashable) -> bool:
        """Without counting a reference (tests, introspection)."""
        with self._lock:
            cache = self._caches.get(lang)
            return cache is not None and key in cache

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {lang: len(c) for lang, c in self._caches.items()}
