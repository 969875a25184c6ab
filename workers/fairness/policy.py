"""Per-language service policies: weight, latency SLO and quotas.

A language's *weight* is its share of the model when several languages are backlogged at once:
the VTC queue (`workers.fairness.vtc`) serves backlogged languages in proportion to their
weights. Its *SLO* is the p99 end-to-end latency target that deadline admission
(`workers.fairness.latency_model`) and the benchmarks check against. `max_queue` is the intake
high-water mark (`workers.fairness.intake`): past it the worker pauses the language's partitions.

Why a tighter SLO gets a higher weight: under overload, a backlogged language's queue drains at
a rate proportional to its weight, so its queueing delay (the part of latency that explodes) scales
roughly with 1 / weight. A language that must answer within 2 s therefore needs a larger share
than one that may take 6 s at the same offered load; giving the tight-SLO languages the higher
weights is what lets every language meet its own target with one shared model. A language that
is *not* backlogged is not limited by its weight at all: VTC serves a light language's requests
right away whatever its weight (up to `DEFAULT_BURST_TOKENS` of service ahead of the others when
a few arrive at once, then at its weighted rate), which is why Italian keeps its SLO while German
floods in.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "DEFAULT_BURST_TOKENS",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_POLICIES",
    "LanguagePolicy",
    "parse_policies",
    "weights_of",
]

DEFAULT_MAX_QUEUE = 256  # intake high water per language when a spec leaves it out
# Weighted tokens of service a language returning from idle may take ahead of the backlogged
# ones (VTCQueue's burst credit): about four short chat-turn translations (prompt ~25 uncached
# tokens + 2 x ~16 output), so a light language's small burst is not spread over VTC rounds.
DEFAULT_BURST_TOKENS = 256
DEFAULT_MAX_NEW_TOKENS = 256  # output cap per request when a spec leaves it out

_LANG_RE = re.compile(r"^[a-z]{2,3}([_-][a-z0-9]{2,8})*$")


@dataclass(frozen=True, slots=True)
class LanguagePolicy:
    weight: float  # share of the model when backlogged (relative to the other languages)
    slo_p99_s: float  # p99 end-to-end latency target in seconds
    max_queue: int  # intake high water: requests in flight before its partitions pause
    max_new_tokens: int  # output cap for this language's requests

    def __post_init__(self) -> None:
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"weight must be a positive finite number, got {self.weight!r}")
        if not (math.isfinite(self.slo_p99_s) and self.slo_p99_s > 0):
            raise ValueError(f"slo_p99_s must be a positive finite number, got {self.slo_p99_s!r}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")


# Tighter SLO -> higher weight (see the module docstring). German and English carry the
# interactive traffic (2-3 s), Spanish and Italian mostly batch-like document traffic.
DEFAULT_POLICIES: dict[str, LanguagePolicy] = {
    "de": LanguagePolicy(weight=4.0, slo_p99_s=2.0, max_queue=256, max_new_tokens=256),
    "en": LanguagePolicy(weight=3.0, slo_p99_s=3.0, max_queue=256, max_new_tokens=256),
    "fr": LanguagePolicy(weight=3.0, slo_p99_s=3.0, max_queue=256, max_new_tokens=256),
    "es": LanguagePolicy(weight=2.0, slo_p99_s=4.0, max_queue=256, max_new_tokens=256),
    "it": LanguagePolicy(weight=1.0, slo_p99_s=6.0, max_queue=256, max_new_tokens=256),
}


def _number(text: str, what: str, entry: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"policy entry {entry!r}: {what} {text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"policy entry {entry!r}: {what} must be > 0, got {text!r}")
    return value


def _count(text: str, what: str, entry: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"policy entry {entry!r}: {what} {text!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"policy entry {entry!r}: {what} must be >= 1, got {text!r}")
    return value


def parse_policies(
    spec: str, defaults: Mapping[str, LanguagePolicy] = DEFAULT_POLICIES
) -> dict[str, LanguagePolicy]:
    """Parse `"de:4:2.0,fr:3:3.0"` (lang:weight:slo_s[:max_queue[:max_new_tokens]]).

    Left-out `max_queue` / `max_new_tokens` come from `defaults[lang]` when the language is
    there, else DEFAULT_MAX_QUEUE / DEFAULT_MAX_NEW_TOKENS. Blank entries (a trailing comma) are
    skipped; whitespace around fields is ignored; language codes are lower-cased. Only the
    languages in `spec` are returned: merge with DEFAULT_POLICIES yourself if you want both.
    Raises ValueError naming the faulty entry.
    """
    out: dict[str, LanguagePolicy] = {}
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            continue
        fields = [f.strip() for f in entry.split(":")]
        if not 3 <= len(fields) <= 5:
            raise ValueError(
                f"policy entry {entry!r}: expected lang:weight:slo_s[:max_queue[:max_new_tokens]]"
                f", got {len(fields)} field(s)"
            )
        lang = fields[0].lower()
        if not _LANG_RE.match(lang):
            raise ValueError(f"policy entry {entry!r}: {fields[0]!r} is not a language code")
        if lang in out:
            raise ValueError(f"policy entry {entry!r}: language {lang!r} given twice")
        base = defaults.get(lang)
        weight = _number(fields[1], "weight", entry)
        slo = _number(fields[2], "slo_s", entry)
        max_queue = (
            _count(fields[3], "max_queue", entry)
            if len(fields) > 3
            else (base.max_queue if base else DEFAULT_MAX_QUEUE)
        )
        max_tokens = (
            _count(fields[4], "max_new_tokens", entry)
            if len(fields) > 4
            else (base.max_new_tokens if base else DEFAULT_MAX_NEW_TOKENS)
        )
        out[lang] = LanguagePolicy(weight, slo, max_queue, max_tokens)
    return out


def weights_of(policies: Mapping[str, LanguagePolicy]) -> dict[str, float]:
    """The weight map a fair-share queue takes."""
    return {lang: p.weight for lang, p in policies.items()}
