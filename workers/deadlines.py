"""A request's deadline: the conversion to the engine's clock and the one expiry rule.

The `deadline` of a `TranslationRequest` is wall-clock epoch milliseconds (Avro
`timestamp-millis`, the client sets it to its send time + the time it will wait), or null for
none. It is the last instant at which an answer is still of use to the caller. Two rules follow
from that, and every part of the worker uses them from here:

* Before the engine (`workers/validation.py`): a request with no time left, `now >= deadline`,
  is answered EXPIRED without translating; a translation takes more than no time, so it could
  only finish past the deadline (`ms_past_deadline_at_intake`).
* After the engine (`workers/replies.py`, and the engine's own check): a result that finished
  past its deadline, `finished > deadline`, goes out as EXPIRED even when the engine said OK;
  the caller has given up on it by then (`late_by`, `expired_despite_ok`). A result exactly at
  the deadline is in time.

The engine keeps deadlines on its own monotonic clock (seconds, `time.monotonic()`), immune to
wall-clock steps while a request waits; `engine_deadline` converts at the moment of submission
by the time left on the wall clock. `late_by` takes any one clock and unit, so the engine side
(`FairEngine._enforce_deadline`, monotonic seconds) can apply the same rule.

Pure functions over plain numbers: the callers pass the clock readings in, so tests give exact
values.
"""

from __future__ import annotations

__all__ = [
    "engine_deadline",
    "expired_despite_ok",
    "late_by",
    "ms_past_deadline_at_intake",
]


def engine_deadline(deadline_ms: int | None, *, now_ms: int, now_monotonic: float) -> float | None:
    """The request's deadline on the engine's monotonic clock (seconds), given the wall clock
    (`now_ms`, epoch millis) and the monotonic clock (`now_monotonic`) read at the same moment.
    None (no deadline) stays None; a deadline already passed maps to the monotonic past."""
    if deadline_ms is None:
        return None
    return now_monotonic + (int(deadline_ms) - now_ms) / 1000.0


def ms_past_deadline_at_intake(deadline_ms: int | None, now_ms: int) -> int | None:
    """How many ms the deadline lies behind `now_ms` (0 = exactly now) when the request has no
    time left and must be answered EXPIRED instead of translated; None when time is left or
    there is no deadline."""
    if deadline_ms is None:
        return None
    late_ms = now_ms - int(deadline_ms)
    return late_ms if late_ms >= 0 else None


def late_by(deadline: float | None, finished_at: float) -> float | None:
    """How far past `deadline` a result that finished at `finished_at` came (same clock and
    unit for both); None when it came in time (at the deadline counts as in time) or there is
    no deadline."""
    if deadline is None:
        return None
    late = finished_at - deadline
    return late if late > 0 else None


def expired_despite_ok(deadline_ms: int | None, finished_ms: int) -> str | None:
    """The error text of an OK result that must go out as EXPIRED because it finished past the
    request's deadline (epoch millis); None when it may go out as OK."""
    late = late_by(None if deadline_ms is None else int(deadline_ms), finished_ms)
    if late is None:
        return None
    return f"translated {late:.0f} ms after the request's deadline"
