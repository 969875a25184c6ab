"""Which results the cache keeps (workers/tm/cache_policy.py): only clean OK translations."""

from __future__ import annotations

import pytest

from workers.engine.types import FinishReason, GenerationResult
from workers.tm.cache_policy import is_cacheable, is_flagged


def result(
    reason: FinishReason = FinishReason.STOP, text: str = "Thank you.", **notes: str
) -> GenerationResult:
    return GenerationResult("r1", [1, 2], text, reason, notes=notes)


def test_a_clean_stop_is_cacheable() -> None:
    assert is_cacheable(result())
    assert is_cacheable(result(**{"tolk.protected_spans": "restored"}))
    assert is_cacheable(result(**{"tolk.protected_spans": "skipped"}))
    assert is_cacheable(result(**{"tolk.faithful.retries": "0"}))


@pytest.mark.parametrize(
    "reason",
    [
        FinishReason.LENGTH,
        FinishReason.ERROR,
        FinishReason.EXPIRED,
        FinishReason.REJECTED,
        FinishReason.CANCELLED,
    ],
)
def test_anything_but_a_stop_is_not_cached(reason: FinishReason) -> None:
    assert not is_cacheable(result(reason))


def test_an_empty_translation_is_not_cached() -> None:
    assert not is_cacheable(result(text=""))


@pytest.mark.parametrize(
    "notes",
    [
        {"tolk.protected_spans": "flagged"},
        {"tolk.protected_spans": "retried_unmasked"},
        {"tolk.faithful": "retried"},
        {"tolk.faithful": "flagged", "tolk.faithful.problems": "leak"},
        {"tolk.faithful.flagged": "1"},
        {"tolk.something.retries": "2"},
        {"tolk.finish_reason": "length_guard"},  # a wrapper cut it
        {"tolk.cache": "l1"},  # made by the cache itself
    ],
)
def test_a_flagged_retried_cut_or_cached_result_is_not_cached(notes: dict[str, str]) -> None:
    assert not is_cacheable(result(**notes))


def test_is_flagged_reads_values_and_key_suffixes() -> None:
    assert is_flagged({"x": "Flagged"})
    assert is_flagged({"x.retry": "unmasked retry failed"})
    assert not is_flagged({"x.retries": "false", "y": "restored"})
