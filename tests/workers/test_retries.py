"""EngineRetries: which run comes next after a failed one, and the isolated last runs."""

from __future__ import annotations

import pytest

from workers.engine.types import FinishReason, GenerationResult
from workers.kafka.engine_retries import EngineRetries, is_failed_run


def result(reason: FinishReason, error: str) -> GenerationResult:
    return GenerationResult("r", [], "", reason, error=error)


def test_only_a_failed_run_with_the_engine_error_is_retried() -> None:
    assert is_failed_run(result(FinishReason.ERROR, "RuntimeError: step failed"))
    assert not is_failed_run(result(FinishReason.ERROR, ""))
    for reason in (FinishReason.REJECTED, FinishReason.EXPIRED, FinishReason.CANCELLED):
        assert not is_failed_run(result(reason, "refused"))
    assert not is_failed_run(result(FinishReason.STOP, ""))


@pytest.mark.parametrize(
    ("max_attempts", "plans"),
    [
        (1, ["give_up"]),
        (2, ["last", "give_up"]),
        (3, ["retry", "last", "give_up"]),
        (4, ["retry", "retry", "last", "give_up"]),
    ],
)
def test_plan_after_each_failed_run(max_attempts: int, plans: list[str]) -> None:
    retries = EngineRetries(max_attempts)
    assert [retries.plan(n) for n in range(1, max_attempts + 1)] == plans


def test_one_last_run_at_a_time_in_arrival_order() -> None:
    retries = EngineRetries(3)
    for rid in ("a", "b", "c"):
        retries.queue_last(rid)
    assert retries.take_last() == "a"
    assert retries.take_last() is None  # "a" is still running its last run
    retries.finished("b")  # another request's result does not free the slot
    assert retries.take_last() is None
    retries.forget("c")  # answered / dropped meanwhile: leaves the queue
    retries.finished("a")
    assert retries.take_last() == "b"
    retries.finished("b")
    assert retries.take_last() is None and retries.waiting() == 0


def test_max_attempts_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        EngineRetries(0)
