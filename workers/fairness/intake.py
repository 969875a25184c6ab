"""Per-language intake quota at the Kafka consumer, as pure logic.

librdkafka gives no fairness across the topics one consumer reads (it fetches whatever the
brokers return, a flooded topic first), so a flood of
German would fill the engine's queue and memory before VTC gets a say. The worker therefore
counts, per language, the requests it has taken from Kafka and not yet finished, and pauses the
language's partitions when that count reaches its high water mark. A paused partition must stay
paused until the count has fallen to the *low* water mark: `pause()` drops the partition's
prefetch queue, so toggling at a single threshold would re-fetch the same records over and over
(librdkafka #2703). An optional minimum pause time adds a second guard against flapping.

The controller only decides; the worker maps languages to partitions, calls
`consumer.pause()/resume()` with the sets returned by `to_pause()` / `to_resume()`, and keeps
polling while paused. Records already fetched keep arriving after a pause: `on_enqueued()`
accepts them (the count may exceed high water), nothing is dropped here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping

from workers.fairness.policy import LanguagePolicy

__all__ = ["IntakeController"]


class IntakeController:
    """Hysteresis on in-flight requests per language: pause at high water, resume at low."""

    def __init__(
        self,
        high_water: Mapping[str, int],
        low_water_ratio: float = 0.5,
        default_high_water: int | None = None,
        min_paused_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`high_water[lang]`: in-flight count that pauses `lang`; low water is
        floor(high * low_water_ratio). Languages not in the map use `default_high_water`
        (None: never paused). `min_paused_s`: a paused language stays paused at least this long.
        """
        if not 0.0 <= low_water_ratio < 1.0:
            raise ValueError(f"low_water_ratio must be in [0, 1), got {low_water_ratio!r}")
        if min_paused_s < 0:
            raise ValueError(f"min_paused_s must be >= 0, got {min_paused_s!r}")
        self._ratio = low_water_ratio
        self._high: dict[str, int] = {}
        for lang, hw in high_water.items():
            self._high[lang] = self._check_high(lang, hw)
        self._default_high = (
            None if default_high_water is None else self._check_high("*", default_high_water)
        )
        self._min_paused_s = min_paused_s
        self._clock = clock
        self._depth: dict[str, int] = {}
        self._paused_at: dict[str, float] = {}  # paused language -> when it was paused

    @classmethod
    def from_policies(
        cls,
        policies: Mapping[str, LanguagePolicy],
        low_water_ratio: float = 0.5,
        default_high_water: int | None = None,
        min_paused_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> IntakeController:
        """High water = each policy's `max_queue`."""
        return cls(
            {lang: p.max_queue for lang, p in policies.items()},
            low_water_ratio,
            default_high_water,
            min_paused_s,
            clock,
        )

    @staticmethod
    def _check_high(lang: str, high: int) -> int:
        if high < 1:
            raise ValueError(f"high water of {lang!r} must be >= 1, got {high!r}")
        return int(high)

    def high_water(self, lang: str) -> int | None:
        return self._high.get(lang, self._default_high)

    def low_water(self, lang: str) -> int | None:
        high = self.high_water(lang)
        return None if high is None else math.floor(high * self._ratio)

    # -- events from the worker ---------------------------------------------------------------

    def on_enqueued(self, lang: str) -> None:
        """A request of `lang` was taken from Kafka and handed to the engine."""
        self._depth[lang] = self._depth.get(lang, 0) + 1

    def on_done(self, lang: str) -> None:
        """A request of `lang` finished (any outcome) or was dropped before the engine."""
        depth = self._depth.get(lang, 0)
        if depth <= 0:
            raise ValueError(f"on_done({lang!r}) without a matching on_enqueued")
        self._depth[lang] = depth - 1

    def forget(self, lang: str) -> None:
        """Drop a language's state (its partitions were revoked and its work abandoned)."""
        self._depth.pop(lang, None)
        self._paused_at.pop(lang, None)

    # -- decisions ----------------------------------------------------------------------------

    def to_pause(self) -> set[str]:
        """Languages to pause now (at or above high water and not yet paused); marks them paused."""
        now: float | None = None
        out: set[str] = set()
        for lang, depth in self._depth.items():
            if lang in self._paused_at:
                continue
            high = self.high_water(lang)
            if high is not None and depth >= high:
                if now is None:
                    now = self._clock()
                self._paused_at[lang] = now
                out.add(lang)
        return out

    def to_resume(self) -> set[str]:
        """Paused languages to resume now (at or below low water, paused long enough); marks
        them resumed."""
        if not self._paused_at:
            return set()
        now = self._clock()
        out: set[str] = set()
        for lang, since in list(self._paused_at.items()):
            low = self.low_water(lang)
            drained = low is None or self._depth.get(lang, 0) <= low
            if drained and now - since >= self._min_paused_s:
                del self._paused_at[lang]
                out.add(lang)
        return out

    # -- introspection ------------------------------------------------------------------------

    def paused(self) -> frozenset[str]:
        return frozenset(self._paused_at)

    def depth(self, lang: str) -> int:
        return self._depth.get(lang, 0)

    def depths(self) -> dict[str, int]:
        return dict(self._depth)
