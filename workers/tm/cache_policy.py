"""Which engine results the exact-match cache may keep: `is_cacheable(result)`, the one rule.

A cached translation is served again without any of the checks that ran when it was made, so
only a translation that needed no excuse is kept:

* it finished OK by a stop rule (`FinishReason.STOP`): not an error, not expired, not
  cancelled, and not cut at its token cap (`LENGTH`, which the reply marks with
  `tolk.finish_reason: length`);
* it has text;
* no wrapper flagged it or had to retry it. Wrappers say what they did in the result's notes
  (copied into the reply's metadata): the protected-spans wrapper writes
  `tolk.protected_spans` = restored / skipped (clean) or retried_unmasked / flagged; other
  wrappers (faithful output, ...) follow the same convention. A note counts as a flag or a
  retry when its value is one of `FLAG_VALUES` or starts with "retr" / "flag", or its key
  ends in one of `FLAG_KEY_SUFFIXES` with a value other than "0" / "false" / "" (so
  `tolk.faithful.flagged: 1` or `tolk.faithful.retries: 2` stop caching, `...retries: 0`
  does not).

A result the cache itself produced (`tolk.cache` = l1 / l2 / joined) is not stored again, nor
one a wrapper marked as cut (a `tolk.finish_reason` note, e.g. a length guard).
"""

from __future__ import annotations

from collections.abc import Mapping

from workers.engine.types import FinishReason, GenerationResult

__all__ = ["CACHE_NOTE", "FLAG_KEY_SUFFIXES", "FLAG_VALUES", "is_cacheable", "is_flagged"]

CACHE_NOTE = "tolk.cache"  # the reply metadata key saying how the cache answered
FINISH_REASON_NOTE = "tolk.finish_reason"  # a wrapper cut the output (workers.replies' key)
FLAG_VALUES = frozenset({"flagged", "retried", "retried_unmasked", "retry", "leak", "loop"})
FLAG_KEY_SUFFIXES = (".flagged", ".flag", ".flags", ".retried", ".retry", ".retries")
_FALSE_VALUES = frozenset({"", "0", "false", "no", "none"})


def is_flagged(notes: Mapping[str, str]) -> bool:
    """Does any note say the result was flagged, or needed a retry to be made?"""
    for key, value in notes.items():
        v = str(value).strip().lower()
        if v in FLAG_VALUES or v.startswith(("retr", "flag")):
            return True
        if key.lower().endswith(FLAG_KEY_SUFFIXES) and v not in _FALSE_VALUES:
            return True
    return False


def is_cacheable(result: GenerationResult) -> bool:
    """May this result answer later identical requests? (the module notes)"""
    if result.finish_reason is not FinishReason.STOP or not result.text:
        return False
    if CACHE_NOTE in result.notes or FINISH_REASON_NOTE in result.notes:
        return False  # made by the cache itself, or cut by a wrapper's length guard
    return not is_flagged(result.notes)
