"""What the guard counts per window: replies turned into observations, and window figures.

Pure logic (no Kafka, no faust, no clocks): the faust app (`workers.guard.app`) calls
`observe()` on each reply record and folds the observation into a `WindowCounts` value of its
windowed table; the judging step merges the counts of one window (over the reply partitions)
into `WindowStats` and hands them to `workers.guard.policy`.

* **Observation.** A reply (the Avro `TranslationResult`, decoded by the caller) becomes an
  `Observation` (language, arm, status, latency, and the faithfulness checks' outcome when they
  withheld the answer or sent it flagged: a quality outcome, counted apart from service
  errors, issue #28) or an `Ignored` with a reason:
  `malformed` (undecodable, or fields that make no sense), `no_arm` (a worker without
  `--arm`: it belongs to no rollout), `clock_skew` (a latency below zero or not finite, longer
  than `max_latency_ms`, or a `completed_at` further than `max_skew_ms` from the reply
  record's own timestamp: the clocks of the client, the worker and the broker disagree).
  Ignored replies are counted (`tolk_guard_ignored_total{reason}`), never fatal. Whether an
  arm is known is decided later, at judging time, against the rollout of the language.
* **Latency** is the reply's `timings.total_ms`: from the request record's timestamp (the
  client's create time) to the reply being produced.
* **Counts** are plain JSON-able dicts (the table's changelog serializes them as JSON):
  requests, per status, a latency histogram with buckets 2 % wide (geometric), withheld and
  flagged answers, and the last source offset folded in. `add_observation` refuses an offset
  it has already folded, which is what makes a restarted guard count exactly once: it reads
  again the replies after the newest one its restored table holds (core.py, "Resuming after a
  crash"), and those whose update already reached the changelog are skipped here.
* **Percentiles** come from the histogram (the upper edge of the bucket holding the rank, so
  within 2 % above the exact value): the same counts give the same figures in every process.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from schemas.wire import WireResult
from workers.arms import split_arm, validate_arm_name
from workers.reply_metadata import FAITHFUL

__all__ = [
    "BUCKET_GROWTH",
    "IGNORED_REASONS",
    "STATUSES",
    "Ignored",
    "Observation",
    "WindowStats",
    "add_observation",
    "bucket_of",
    "bucket_upper_ms",
    "empty_counts",
    "merge_counts",
    "observe",
    "over_ms",
    "percentile_ms",
    "stats_of",
    "window_start_ms",
]

STATUSES = ("OK", "ERROR", "REJECTED", "EXPIRED")
IGNORED_REASONS = ("malformed", "no_arm", "clock_skew", "unknown_arm")
BUCKET_GROWTH = 1.02  # histogram buckets: each 2 % wider than the one before
DEFAULT_MAX_SKEW_MS = 60_000  # completed_at vs the reply record's timestamp
DEFAULT_MAX_LATENCY_MS = 3_600_000  # an hour: anything longer is a clock, not a model


@dataclass(frozen=True, slots=True)
class Observation:
    """One reply the guard counts."""

    lang: str  # the reply's target language
    arm: str  # the arm that answered (from model_version "<version>@<arm>")
    status: str  # OK | ERROR | REJECTED | EXPIRED
    latency_ms: float  # timings.total_ms: request created -> reply produced
    quality: str = ""  # "withheld" (an ERROR) | "flagged" (an OK) by the faithfulness checks


@dataclass(frozen=True, slots=True)
class Ignored:
    """A reply the guard does not count, and why (one of IGNORED_REASONS)."""

    reason: str
    detail: str = ""


def observe(
    reply: WireResult | None,
    *,
    record_ts_ms: int,
    max_skew_ms: int = DEFAULT_MAX_SKEW_MS,
    max_latency_ms: int = DEFAULT_MAX_LATENCY_MS,
) -> Observation | Ignored:
    """The observation of one decoded reply (None: it did not decode), see the docstring."""
    if reply is None:
        return Ignored("malformed", "not a TranslationResult")
    lang, status, model_version = reply.target_lang, reply.status, reply.model_version
    latency, completed_at = reply.timings.total_ms, reply.completed_at
    if not lang or status not in STATUSES:
        return Ignored("malformed", f"target_lang {lang!r}, status {status!r}")
    _, arm = split_arm(model_version)
    if arm is None:
        return Ignored("no_arm", f"model_version {model_version!r}")
    try:
        validate_arm_name(arm)
    except ValueError as exc:
        return Ignored("malformed", str(exc))
    if not math.isfinite(latency) or latency < 0 or latency > max_latency_ms:
        return Ignored("clock_skew", f"latency {latency!r} ms")
    if abs(completed_at - record_ts_ms) > max_skew_ms:
        return Ignored("clock_skew", f"completed_at {completed_at} vs record time {record_ts_ms}")
    note = reply.metadata.get(FAITHFUL)
    suspect = {"ERROR": "withheld", "OK": "flagged"}.get(status)
    return Observation(lang, arm, status, latency, suspect if suspect and note == suspect else "")


def window_start_ms(ts_ms: int, window_ms: int) -> int:
    """The start of the tumbling window (epoch millis) that holds `ts_ms`."""
    return ts_ms - ts_ms % window_ms


def bucket_of(latency_ms: float) -> int:
    """The histogram bucket of a latency: 0 for under 1 ms, else 1 + log_1.02(ms)."""
    if latency_ms < 1.0:
        return 0
    return 1 + int(math.log(latency_ms) / math.log(BUCKET_GROWTH))


def bucket_upper_ms(bucket: int) -> float:
    """The upper edge of a bucket (ms): what a percentile in it reports."""
    if bucket <= 0:
        return 1.0
    return float(BUCKET_GROWTH**bucket)


def empty_counts() -> dict[str, Any]:
    """A table value with nothing counted (`last_offset` -1: no source record folded yet)."""
    return {
        "requests": 0,
        "status": {s: 0 for s in STATUSES},
        "hist": {},
        "quality": {},
        "last_offset": -1,
    }


def add_observation(
    counts: Mapping[str, Any] | None, obs: Observation, offset: int
) -> dict[str, Any] | None:
    """`counts` with `obs` (the record at `offset`) folded in; None when that offset (or a
    later one) is already in: a record read again after a restart counts once."""
    base = dict(counts) if counts else empty_counts()
    if int(base.get("last_offset", -1)) >= offset:
        return None
    status = dict(base.get("status") or {})
    status[obs.status] = int(status.get(obs.status, 0)) + 1
    hist = dict(base.get("hist") or {})
    key = str(bucket_of(obs.latency_ms))  # JSON object keys are strings
    hist[key] = int(hist.get(key, 0)) + 1
    quality = dict(base.get("quality") or {})  # absent in a table written before issue #28
    if obs.quality:
        quality[obs.quality] = int(quality.get(obs.quality, 0)) + 1
    return {
        "requests": int(base.get("requests", 0)) + 1,
        "status": status,
        "hist": hist,
        "quality": quality,
        "last_offset": offset,
    }


def merge_counts(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The sum of several partitions' counts of one window, language and arm."""
    out = empty_counts()
    for part in parts:
        out["requests"] += int(part.get("requests", 0))
        for status, n in (part.get("status") or {}).items():
            out["status"][status] = out["status"].get(status, 0) + int(n)
        for bucket, n in (part.get("hist") or {}).items():
            out["hist"][str(bucket)] = out["hist"].get(str(bucket), 0) + int(n)
        for outcome, n in (part.get("quality") or {}).items():
            out["quality"][outcome] = out["quality"].get(outcome, 0) + int(n)
    out["last_offset"] = -1  # meaningless across partitions
    return out


def percentile_ms(hist: Mapping[str, int], q: float) -> float:
    """The q-quantile (0 < q <= 1) of a histogram, nearest rank, as its bucket's upper edge;
    NaN for an empty histogram."""
    total = sum(int(n) for n in hist.values())
    if total == 0:
        return math.nan
    rank = max(1, math.ceil(q * total))
    seen = 0
    for bucket in sorted(int(b) for b in hist):
        seen += int(hist[str(bucket)])
        if seen >= rank:
            return bucket_upper_ms(bucket)
    return bucket_upper_ms(max(int(b) for b in hist))  # unreachable: seen ends at total


@dataclass(frozen=True, slots=True)
class WindowStats:
    """The figures of one window, language and arm (what the policy judges)."""

    lang: str
    arm: str
    window_start_ms: int
    window_end_ms: int
    requests: int
    errors: int  # ERROR replies that are service errors (a withheld answer is not one)
    expired: int  # EXPIRED replies
    rejected: int  # REJECTED replies
    p95_ms: float  # NaN without requests
    p99_ms: float
    withheld: int = 0  # answers the faithfulness checks withheld (ERROR replies)
    flagged: int = 0  # answers they sent flagged (OK replies)
    over_slo: int = 0  # replies slower than the SLO given to `stats_of` (histogram: +-2 %)

    @property
    def bad(self) -> int:
        """Replies the customer did not get: service errors, expired, withheld (issue #29)."""
        return self.errors + self.expired + self.withheld

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def expired_rate(self) -> float:
        return self.expired / self.requests if self.requests else 0.0

    @property
    def suspect(self) -> int:
        """Answers the faithfulness checks still found suspect after the retry."""
        return self.withheld + self.flagged

    @property
    def suspect_rate(self) -> float:
        return self.suspect / self.requests if self.requests else 0.0

    def figures(self, prefix: str) -> dict[str, float]:
        """Flat figures for an event or a log line: `<prefix>_requests`, ..."""
        return {
            f"{prefix}_requests": float(self.requests),
            f"{prefix}_error_rate": round(self.error_rate, 6),
            f"{prefix}_expired_rate": round(self.expired_rate, 6),
            f"{prefix}_withheld_rate": round(self.withheld / max(self.requests, 1), 6),
            f"{prefix}_flagged_rate": round(self.flagged / max(self.requests, 1), 6),
            f"{prefix}_p95_ms": round(self.p95_ms, 3) if self.requests else -1.0,
            f"{prefix}_p99_ms": round(self.p99_ms, 3) if self.requests else -1.0,
        }


def over_ms(hist: Mapping[str, int], threshold_ms: float) -> int:
    """Replies in buckets whose lower edge is at or above `threshold_ms` (a reply within 2 %
    over it may be missed: the histogram's resolution)."""
    if not math.isfinite(threshold_ms):
        return 0
    return sum(
        int(n)
        for b, n in hist.items()
        if int(b) > 0 and bucket_upper_ms(int(b) - 1) >= threshold_ms
    )


def stats_of(
    counts: Mapping[str, Any] | None,
    *,
    lang: str,
    arm: str,
    start_ms: int,
    window_ms: int,
    slo_ms: float = math.inf,
) -> WindowStats:
    """`WindowStats` of merged counts (None: nothing counted); `over_slo` counts the replies
    slower than `slo_ms`."""
    c = counts if counts else empty_counts()
    status = c.get("status") or {}
    hist = c.get("hist") or {}
    quality = c.get("quality") or {}
    withheld = int(quality.get("withheld", 0))
    return WindowStats(
        lang=lang,
        arm=arm,
        window_start_ms=start_ms,
        window_end_ms=start_ms + window_ms,
        requests=int(c.get("requests", 0)),
        errors=int(status.get("ERROR", 0)) - withheld,
        expired=int(status.get("EXPIRED", 0)),
        rejected=int(status.get("REJECTED", 0)),
        p95_ms=percentile_ms(hist, 0.95),
        p99_ms=percentile_ms(hist, 0.99),
        withheld=withheld,
        flagged=int(quality.get("flagged", 0)),
        over_slo=over_ms(hist, slo_ms),
    )
