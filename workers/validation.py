"""Checks on a decoded request before it may reach the engine.

Each failed check becomes a reply, not an exception: the client waiting on that request id
hears why (REJECTED for what will never work, EXPIRED for what came too late), and the metric
reason says which check it was. Order matters: the cheapest and most basic checks go first.
The deadline check is `workers.engine.deadlines`' rule (no time left: EXPIRED).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from workers.engine.deadlines import ms_past_deadline_at_intake

__all__ = ["Problem", "validate_request"]


class Problem(NamedTuple):
    status: str  # the reply's ResultStatus: REJECTED or EXPIRED
    reason: str  # the `reason` label of tolk_worker_errors_total
    error: str  # the reply's error text


def validate_request(
    request: dict[str, Any],
    *,
    topic: str,
    topic_lang: str,
    served: Sequence[str],
    engine_languages: Sequence[str],
    max_text_bytes: int,
    now_ms: int,
) -> Problem | None:
    """None when `request` (read from `topic`, whose language is `topic_lang`) can be
    translated by a worker serving the target languages `served`."""
    target = str(request.get("target_lang", ""))
    source = str(request.get("source_lang", ""))
    text = request.get("text", "")
    if target not in served:
        return Problem(
            "REJECTED",
            "unknown_language",
            f"unknown target language {target!r}; this worker serves {', '.join(served)}",
        )
    if target != topic_lang:
        return Problem(
            "REJECTED",
            "wrong_topic",
            f"target_lang {target!r} does not match topic {topic!r} ({topic_lang!r})",
        )
    if source and engine_languages and source not in engine_languages:
        return Problem(
            "REJECTED",
            "unknown_language",
            f"unknown source language {source!r}; the model knows {', '.join(engine_languages)}",
        )
    if not text or not text.strip():
        return Problem("REJECTED", "empty_text", "text is empty")
    size = len(text.encode("utf-8"))
    if size > max_text_bytes:
        return Problem(
            "REJECTED", "too_large", f"text is {size} bytes; the limit is {max_text_bytes}"
        )
    late_ms = ms_past_deadline_at_intake(request.get("deadline"), now_ms)
    if late_ms is not None:
        return Problem(
            "EXPIRED",
            "deadline_passed",
            f"deadline passed {late_ms} ms before the worker read the request",
        )
    return None
