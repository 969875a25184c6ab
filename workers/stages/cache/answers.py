"""What the cache stage answers each participant of a flight (workers/stages/cache/stage.py):
the run's result under the participant's own request id and cache note, or a CANCELLED /
ERROR result of its own. Pure functions over `GenerationResult`."""

from __future__ import annotations

import dataclasses

from workers import reply_metadata as meta
from workers.engine.types import FinishReason, GenerationResult

# A run that ended so for the request it ran under may still succeed for a joined one.
NOT_FOR_THE_OTHERS = (FinishReason.EXPIRED, FinishReason.REJECTED, FinishReason.CANCELLED)


def answer_as(result: GenerationResult, request_id: str, how: str) -> GenerationResult:
    """`result` for one participant: its own id, the cache note; a joined one reports no
    tokens (the run's tokens are counted once, on the request that ran it)."""
    notes = {**result.notes, meta.CACHE: how}
    if how == "miss":
        return dataclasses.replace(result, request_id=request_id, notes=notes, cache_tier=how)
    return dataclasses.replace(
        result,
        request_id=request_id,
        notes=notes,
        cache_tier=how,
        token_ids=[],
        tokens_in=0,
        tokens_out=0,
        cached_tokens=0,
    )


def cancelled(request_id: str) -> GenerationResult:
    return GenerationResult(request_id, [], "", FinishReason.CANCELLED, error="cancelled")


def failed(request_id: str, error: str) -> GenerationResult:
    return GenerationResult(request_id, [], "", FinishReason.ERROR, error=error)
