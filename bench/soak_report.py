"""What `bench/soak.py` counts and how it reports it (pure: no processes, no Kafka).

`Tally` collects the run (requests sent, the replies seen per request id, worker exits, faults
injected, a timeline); `classify_exit` decides whether a worker's end was a native crash (a
fatal signal, or faulthandler's "Fatal Python error" on its stderr); `report` turns a tally
into the JSON figures: crashes, unexpected exits, unanswered requests, duplicate replies.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

JSON = dict[str, Any]

FATAL_SIGNALS = frozenset(
    int(s) for s in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE)
)


@dataclass
class Tally:
    sent: dict[str, float] = field(default_factory=dict)  # request id -> wall time sent
    replies: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # id -> (worker, st)
    latency_s: list[float] = field(default_factory=list)
    exits: list[JSON] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)  # (s since start, what)
    errors: dict[str, int] = field(default_factory=dict)  # non-OK reply's error text -> count
    faults: dict[str, int] = field(
        default_factory=lambda: {"redis_stalls": 0, "joins": 0, "leaves": 0, "restarts": 0}
    )


def classify_exit(exit_code: int | None, stderr_text: str) -> JSON:
    """A worker's end: `native_crash` when it died by a fatal signal or faulthandler wrote a
    dump (then its first 40 lines are kept)."""
    fatal = stderr_text.find("Fatal Python error")
    by_signal = exit_code is not None and exit_code < 0 and -exit_code in FATAL_SIGNALS
    out: JSON = {"exit_code": exit_code, "native_crash": by_signal or fatal >= 0}
    if fatal >= 0:
        out["fatal_excerpt"] = stderr_text[fatal:].splitlines()[:40]
    return out


def report(t: Tally) -> JSON:
    dups = {rid: len(r) - 1 for rid, r in t.replies.items() if len(r) > 1}
    statuses: dict[str, int] = {}
    by_worker: dict[str, int] = {}
    for r in t.replies.values():
        statuses[r[0][1]] = statuses.get(r[0][1], 0) + 1
        by_worker[r[0][0]] = by_worker.get(r[0][0], 0) + 1
    crashes = [e for e in t.exits if e["native_crash"]]
    unexpected = [
        e for e in t.exits if not e["native_crash"] and not e["asked_to_stop"] and e["exit_code"]
    ]
    lat = sorted(t.latency_s)

    def pct(q: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))], 2) if lat else None

    return {
        "native_crashes": len(crashes),
        "unexpected_exits": len(unexpected),
        "killed_by_harness": sum(1 for e in t.exits if e["killed_by_harness"]),
        "sent": len(t.sent),
        "answered": len(t.replies),
        "unanswered": len(t.sent) - len(t.replies),
        "duplicate_replies": sum(dups.values()),
        "duplicated_requests": len(dups),
        "statuses": statuses,
        "replies_by_worker": by_worker,
        "latency_s": {"p50": pct(0.5), "p95": pct(0.95), "max": round(lat[-1], 2) if lat else None},
        "faults": t.faults,
        "crashes": crashes,
        "exits": t.exits,
        "non_ok_errors": dict(sorted(t.errors.items(), key=lambda e: -e[1])[:10]),
        "duplicate_examples": {rid: t.replies[rid] for rid in list(dups)[:10]},
        "events": t.events,
    }
