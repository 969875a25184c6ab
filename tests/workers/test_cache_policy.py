"""Which results the cache keeps (workers/stages/cache/policy.py): only clean OK translations,
decided from the result's declared fields, never from its reply metadata's strings."""

from __future__ import annotations

from typing import Any

import pytest

from workers import reply_metadata as meta
from workers.engine.types import FinishReason, GenerationResult
from workers.stages.cache.policy import is_cacheable


def result(
    reason: FinishReason = FinishReason.STOP, text: str = "Thank you.", **fields: Any
) -> GenerationResult:
    return GenerationResult("r1", [1, 2], text, reason, **fields)


def test_a_clean_stop_is_cacheable() -> None:
    assert is_cacheable(result())
    assert is_cacheable(result(spans="restored"))
    assert is_cacheable(result(spans="skipped"))
    assert is_cacheable(result(examples_used=3))


@pytest.mark.parametrize(
    "reason",
    [
        FinishReason.LENGTH,
        FinishReason.ERROR,
        FinishReason.EXPIRED,
        FinishReason.REJECTED,
        FinishReason.CANCELLED,
        FinishReason.WITHHELD,
    ],
)
def test_anything_but_a_stop_is_not_cached(reason: FinishReason) -> None:
    assert not is_cacheable(result(reason))


def test_an_empty_translation_is_not_cached() -> None:
    assert not is_cacheable(result(text=""))


@pytest.mark.parametrize(
    "fields",
    [
        {"spans": "flagged", "flagged": True},
        {"spans": "retried_unmasked", "retries": 1},
        {"faithful": "retried", "retries": 1},
        {"faithful": "flagged", "flagged": True},
        {"retries": 2},  # any stage's rerun
        {"finish_detail": "length_guard"},  # a stage cut it
        {"cache_tier": "l1"},  # made by the cache itself
        {"cache_tier": "joined"},
    ],
)
def test_a_flagged_retried_cut_or_cached_result_is_not_cached(fields: dict[str, Any]) -> None:
    assert not is_cacheable(result(**fields))


def test_the_metadata_strings_decide_nothing() -> None:
    """A note alone (what a client reads) neither keeps a clean result out nor lets a flagged
    one in: the fields decide."""
    noted = result(notes={meta.FAITHFUL: "flagged", meta.CACHE: "l1"})
    assert is_cacheable(noted)
    assert not is_cacheable(result(notes={meta.SPANS: "restored"}, flagged=True))
