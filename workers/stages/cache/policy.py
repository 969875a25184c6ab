"""Which engine results the exact-match cache may keep: `is_cacheable(result)`, the one rule.

A cached translation is served again without any of the checks that ran when it was made, so
only a translation that needed no excuse is kept. The rule reads the result's declared fields
(`workers.engine.types.GenerationResult`, set by the serving stages), never the strings of its
reply metadata:

* it finished OK by a stop rule (`FinishReason.STOP`): not an error, not expired, not
  cancelled, not withheld, and not cut at its token cap (`LENGTH`, which the reply marks with
  `tolk.finish_reason: length`);
* it has text;
* the cache did not make it (`cache_tier`: a hit or a joined answer is not stored again);
* no stage cut it (`finish_detail`, e.g. the faithfulness stage's length guard), flagged it
  (`flagged`: sent though its checks still doubt it) or had to run it again to make it
  (`retries`: a faithfulness, unmasked or no-history retry).

A clean outcome of a stage is no excuse: spans masked and restored (`spans` = restored), a
text sent unmasked because it held mask-like tokens (skipped), retrieved examples in the prompt.
"""

from __future__ import annotations

from workers.engine.types import FinishReason, GenerationResult

__all__ = ["is_cacheable"]


def is_cacheable(result: GenerationResult) -> bool:
    """May this result answer later identical requests? (the module notes)"""
    if result.finish_reason is not FinishReason.STOP or not result.text:
        return False
    if result.cache_tier or result.finish_detail:
        return False  # made by the cache itself, or cut by a stage's length guard
    return result.retries == 0 and not result.flagged
