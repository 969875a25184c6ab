"""The deadline rule: the one owner of "when is a request too late", on any clock.

The `deadline` of a `TranslationRequest` is wall-clock epoch milliseconds (Avro
`timestamp-millis`; the client sets it to its send time + the time it will wait), or null for
none. It is the last instant at which an answer is still of use to the caller. Every part of
the service that asks "too late?" asks this module, with its own clock readings:

* **No time left** (`expired`): `now >= deadline`. A translation takes more than no time, so a
  request with no time left could only finish past its deadline: the worker answers it EXPIRED
  without the engine (`workers/kafka/intake.py`'s `check_request`, with the text of
  `ms_past_deadline_at_intake`), the scheduler expires it before spending prefill on it
  (`workers/engine/scheduler.py`), the latency model's admission says EXPIRED
  (`workers/fairness/latency_model.py`), and the fair engine's watchdog cancels a running
  request at that moment (`DeadlineWatch`, read by `workers/serving/fair_engine.py`'s thread).
* **Would miss it** (`would_miss`): `now + needed > deadline`, with `needed` the predicted time
  to answer (queue wait, service, margins): refused at admission (the latency model; and the
  idle-engine exploration of `workers/serving/admission.py` admits only what would not miss it).
* **Late** (`late_by`): a result that finished at `finished > deadline` is never OK; the caller
  has given up on it by then. At the deadline exactly is in time. On the engine's clock a late
  OK (or a cancel at the deadline) becomes an EXPIRED result (`expire_if_late`, the fair
  engine); on the wall clock a late OK reply goes out as EXPIRED (`expired_despite_ok`,
  `workers/kafka/replies.py`), so the rule holds whichever engine stack answered.

The engine keeps deadlines on its own monotonic clock (seconds, `time.monotonic()`), immune to
wall-clock steps while a request waits; `engine_deadline` converts at the moment of submission
by the time left on the wall clock.

It lives in the engine package because the engine's scheduler applies it and the engine may
import nothing from the worker (tests/test_architecture.py); it imports only the engine's
boundary types, and the fair-share package may import it too. Pure functions over plain
numbers (plus one small heap, `DeadlineWatch`, with no thread and no lock of its own): callers
pass the clock readings in, so tests give exact values (tests/workers/test_deadlines.py).
"""

from __future__ import annotations

import heapq

from workers.engine.types import FinishReason, GenerationResult

__all__ = [
    "DeadlineWatch",
    "engine_deadline",
    "expire_if_late",
    "expired",
    "expired_despite_ok",
    "late_by",
    "ms_past_deadline_at_intake",
    "would_miss",
]


def engine_deadline(deadline_ms: int | None, *, now_ms: int, now_monotonic: float) -> float | None:
    """The request's deadline on the engine's monotonic clock (seconds), given the wall clock
    (`now_ms`, epoch millis) and the monotonic clock (`now_monotonic`) read at the same moment.
    None (no deadline) stays None; a deadline already passed maps to the monotonic past."""
    if deadline_ms is None:
        return None
    return now_monotonic + (int(deadline_ms) - now_ms) / 1000.0


def expired(deadline: float | None, now: float) -> bool:
    """No time left at `now` (same clock and unit as `deadline`): `now >= deadline`. Never
    true without a deadline."""
    return deadline is not None and now >= deadline


def would_miss(deadline: float | None, now: float, needed: float) -> bool:
    """Would an answer that takes `needed` from `now` come past `deadline`? (`now + needed >
    deadline`; finishing exactly at the deadline is in time.) Never true without a deadline."""
    return deadline is not None and now + needed > deadline


def late_by(deadline: float | None, finished_at: float) -> float | None:
    """How far past `deadline` a result that finished at `finished_at` came (same clock and
    unit for both); None when it came in time (at the deadline counts as in time) or there is
    no deadline."""
    if deadline is None:
        return None
    late = finished_at - deadline
    return late if late > 0 else None


def ms_past_deadline_at_intake(deadline_ms: int | None, now_ms: int) -> int | None:
    """How many ms the deadline lies behind `now_ms` (0 = exactly now) when the request has no
    time left (`expired`) and must be answered EXPIRED instead of translated; None when time is
    left or there is no deadline."""
    if deadline_ms is None or not expired(int(deadline_ms), now_ms):
        return None
    return now_ms - int(deadline_ms)


def expired_despite_ok(deadline_ms: int | None, finished_ms: int) -> str | None:
    """The error text of an OK reply that must go out as EXPIRED because it finished past the
    request's deadline (epoch millis); None when it may go out as OK."""
    late = late_by(None if deadline_ms is None else int(deadline_ms), finished_ms)
    if late is None:
        return None
    return f"translated {late:.0f} ms after the request's deadline"


def expire_if_late(
    result: GenerationResult, deadline: float | None, finished_at: float
) -> GenerationResult:
    """The engine-side rule on a finished result (monotonic seconds): an OK that finished past
    `deadline` becomes EXPIRED with no text; so does a request cancelled at or after its
    deadline (the watchdog's cancel). Changes `result` in place and returns it."""
    if deadline is None:
        return result
    late = late_by(deadline, finished_at)
    if result.ok and late is not None:
        result.finish_reason = FinishReason.EXPIRED
        result.error = f"finished {late * 1e3:.0f} ms after its deadline"
        result.text = ""
    elif result.finish_reason is FinishReason.CANCELLED and expired(deadline, finished_at):
        result.finish_reason = FinishReason.EXPIRED
        result.error = f"deadline passed while running; stopped after {result.tokens_out} tokens"
        result.text = ""
    return result


class DeadlineWatch:
    """The running requests with a deadline, soonest first: `due(now)` names those whose time
    ran out (`expired`), each once, so a watchdog can cancel them. Not thread-safe: the caller
    holds its lock around every call."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []  # (deadline, request id)
        self._live: set[str] = set()

    def watch(self, request_id: str, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, request_id))
        self._live.add(request_id)

    def finished(self, request_id: str) -> None:
        """`request_id` finished (or was cancelled): never due any more."""
        self._live.discard(request_id)

    def due(self, now: float) -> list[str]:
        """The live requests whose deadline passed at `now`; they leave the watch."""
        out: list[str] = []
        while self._heap and expired(self._heap[0][0], now):
            _, rid = heapq.heappop(self._heap)
            if rid in self._live:
                self._live.discard(rid)
                out.append(rid)
        return out
