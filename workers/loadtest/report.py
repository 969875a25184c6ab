"""What a load test reports: per-language latency percentiles and throughput, from raw samples.

Locust's own stats round response times into buckets (two significant digits above 100 ms),
so the figures of `summary.json` are computed here from every request's exact latency:
nearest-rank percentiles (P_q = the ceil(q/100 * n)-th smallest latency, always a latency that
was measured) over the OK replies of a language, plus counts per status (an ERROR reply whose
answer the faithfulness checks withheld counts as WITHHELD, apart from service errors), the
offered rate (sent / sending window) and the throughput (OK replies / sending window). Every
request is also one row of `requests.csv`, so any figure can be recomputed from it.

Latency is measured from each request's scheduled send time to its reply (bridge.py), so a
slow worker shows up as latency, not as a lower send rate.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from workers.loadtest.bridge import Completion

__all__ = ["PERCENTILES", "language_summary", "nearest_rank", "write_requests_csv", "write_summary"]

PERCENTILES = (50.0, 95.0, 99.0)
REQUEST_FIELDS = tuple(Completion.__dataclass_fields__)


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank `q`-th percentile of ascending `sorted_values` (NaN when empty)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def language_summary(
    lang: str, done: Sequence[Completion], rate: float, window_s: float
) -> dict[str, Any]:
    """The figures of one language: counts by status, OK latency percentiles (ms), rates."""
    statuses: dict[str, int] = {}
    for c in done:  # a withheld answer is a quality outcome, not a service ERROR (issue #28)
        status = "WITHHELD" if c.withheld else c.status
        statuses[status] = statuses.get(status, 0) + 1
    ok = sorted(c.latency_s for c in done if c.status == "OK")
    lags = sorted(c.send_lag_s for c in done)
    window = max(window_s, 1e-9)
    out: dict[str, Any] = {
        "lang": lang,
        "rate_per_s": rate,
        "sent": len(done),
        "ok": len(ok),
        "statuses": dict(sorted(statuses.items())),
        "offered_per_s": round(len(done) / window, 4),
        "throughput_per_s": round(len(ok) / window, 4),
        "send_lag_p99_ms": _ms(nearest_rank(lags, 99.0)),
    }
    for q in PERCENTILES:
        out[f"p{q:g}_ms"] = _ms(nearest_rank(ok, q))
    out["mean_ms"] = _ms(sum(ok) / len(ok)) if ok else None
    out["max_ms"] = _ms(ok[-1]) if ok else None
    return out


def _ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else round(seconds * 1000.0, 3)


def write_requests_csv(path: Path, done: Iterable[Completion]) -> None:
    """One row per request, in the order they finished."""
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=REQUEST_FIELDS)
        writer.writeheader()
        for c in done:
            writer.writerow(asdict(c))


def write_summary(
    out_dir: Path,
    done: Sequence[Completion],
    rates: Mapping[str, float],
    window_s: float,
    run: Mapping[str, Any],
) -> dict[str, Any]:
    """`summary.json` (run settings, per-language figures) and `summary.csv` (one row per
    language); returns the summary."""
    by_lang: dict[str, list[Completion]] = {lang: [] for lang in rates}
    for c in done:
        by_lang.setdefault(c.lang, []).append(c)
    languages = [
        language_summary(lang, by_lang[lang], rates.get(lang, 0.0), window_s) for lang in by_lang
    ]
    summary = {**run, "window_s": round(window_s, 3), "languages": languages}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    fields = [
        "lang",
        "rate_per_s",
        "sent",
        "ok",
        "offered_per_s",
        "throughput_per_s",
        "p50_ms",
        "p95_ms",
        "p99_ms",
        "mean_ms",
        "max_ms",
        "send_lag_p99_ms",
    ]
    with (out_dir / "summary.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(languages)
    return summary
