"""The translation cache's L2 lifetimes per target language (`TOLK_CACHE_TTL`): parsed at the
edge, with the other settings (workers/settings.py reads it; the cache's Redis tier,
workers/stages/cache/redis_l2.py, applies it). A leaf: it imports nothing of tolk.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DEFAULT_TTL_S", "TtlTiers", "parse_ttl_tiers", "ttl_tiers_from_mapping"]

DEFAULT_TTL_S = 86400  # one day, for the languages TOLK_CACHE_TTL does not name (no "*")


@dataclass(frozen=True, slots=True)
class TtlTiers:
    """Seconds an L2 entry lives, per target language; `default` for the others."""

    by_language: tuple[tuple[str, int], ...]  # sorted (lang, seconds) pairs
    default: int

    def ttl_s(self, lang: str) -> int:
        for name, seconds in self.by_language:
            if name == lang:
                return seconds
        return self.default

    def as_dict(self) -> dict[str, int]:
        return {**dict(self.by_language), "*": self.default}


def parse_ttl_tiers(spec: str) -> TtlTiers:
    """`"en:180,de:300,*:60"` -> TtlTiers; without "*", the default is 86400 s (one day)."""
    tiers: dict[str, int] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lang, sep, seconds = part.partition(":")
        lang = lang.strip().lower()
        if not sep or not lang:
            raise ValueError(f"TOLK_CACHE_TTL: {part!r} is not lang:seconds")
        try:
            value = int(seconds)
        except ValueError:
            raise ValueError(f"TOLK_CACHE_TTL: {part!r}: seconds must be an integer") from None
        if value < 1:
            raise ValueError(f"TOLK_CACHE_TTL: {part!r}: seconds must be >= 1")
        if lang in tiers:
            raise ValueError(f"TOLK_CACHE_TTL: {lang!r} given twice")
        tiers[lang] = value
    default = tiers.pop("*", DEFAULT_TTL_S)
    return TtlTiers(tuple(sorted(tiers.items())), default)


def ttl_tiers_from_mapping(tiers: Mapping[str, int]) -> TtlTiers:
    """A `TtlTiers` from `{"en": 180, "*": 60}` (tests, programmatic use)."""
    spec = ",".join(f"{lang}:{seconds}" for lang, seconds in tiers.items())
    return parse_ttl_tiers(spec)
