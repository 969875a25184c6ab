"""The serving benchmark's arithmetic: arrival schedules, per-request outcomes, percentiles,
goodput, intervals over repeats. Pure Python, no services (tested in tests/bench/).

Definitions (the ones DistServe, vLLM's `bench serve` and MLPerf Server use, made strict):

* **Arrivals** are open loop: each language has its own schedule of send times fixed before
  the run (`constant`: every 1/rate s from a seeded random phase; `poisson`: exponential gaps
  of mean 1/rate from a seeded generator), so a slow system never lowers the offered rate.
* **Latency** of a request runs from its *scheduled* send time to its reply (a late send
  counts against the system: no coordinated omission). **TTFT** is the latency minus the
  system's own decode time (tolk's `decode_ms`, llama-server's `predicted_ms`): when the first
  token would have reached the client had it been streamed.
* **Every offered request is an outcome**: OK, or a miss (EXPIRED, REJECTED, ERROR, WITHHELD
  by the faithfulness checks, TIMEOUT: no reply within the client's wait, NOT_DELIVERED).
* **Goodput** = OK replies within the SLO / offered requests. Dropping work can only lower it.
* Percentiles are nearest-rank (always a measured value). `p*_ok_s` are over the OK replies
  (what `tolk load` and vLLM report); `p*_s` are over *all offered* requests with every miss
  counted as an infinite latency (None in the JSON when the percentile falls on a miss), so a
  system cannot improve its tail by turning requests away. The highest rate within the SLO
  uses the latter.
* **Withheld answers counted apart** (issue #28: a quality outcome, not a service error):
  `p*_served_s` are over all offered requests too, with an answer the faithfulness checks
  withheld counted at its reply's latency (the service answered, in time or not, and said
  why) and every service miss (EXPIRED, REJECTED, ERROR, TIMEOUT, NOT_DELIVERED) infinite.
  Goodput still counts a withheld answer as a miss; `withheld` is its share of offered.
* Repeats: each figure's mean, min, max and a Student-t 95 % interval of the mean.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from workers.loadtest.report import nearest_rank

__all__ = [
    "MISS_STATUSES",
    "QUALITY_STATUSES",
    "Outcome",
    "arrival_times",
    "interval",
    "language_figures",
    "max_rate_within_slo",
    "parse_lang_values",
    "percentile",
    "stage_split",
    "point_rates",
    "schedule",
]

PERCENTILES = (50.0, 95.0, 99.0)
MISS_STATUSES = ("EXPIRED", "REJECTED", "ERROR", "WITHHELD", "TIMEOUT", "NOT_DELIVERED")
QUALITY_STATUSES = ("WITHHELD",)  # replies a quality check decided: counted apart in p*_served_s
# two-sided 95 % Student t quantiles by degrees of freedom (n - 1)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Outcome:
    """One offered request."""

    lang: str
    status: str  # OK or one of MISS_STATUSES
    latency_s: float | None  # scheduled send -> reply (None: no reply at all)
    ttft_s: float | None = None
    tokens_out: int = 0
    send_lag_s: float = 0.0
    # Where an OK reply's time went, seconds (the system's own timings; see `stage_split`).
    stages: Mapping[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "OK"


STAGES = ("queue", "prefill", "decode", "finish", "outside")


def stage_split(latency_s: float, worker_s: Mapping[str, float]) -> dict[str, float]:
    """An OK reply's latency split by the server's timings (seconds: queue, prefill, decode,
    total): `queue` from the request's timestamp to its admission, `prefill`, `decode`,
    `finish` = the server's total - the three (checks and producing the reply), `outside` =
    latency - the server's total (send lag, the request's and the reply's way through Kafka
    or HTTP). Empty when the server gave no total."""
    total = worker_s.get("total")
    if total is None:
        return {}
    parts = {k: max(0.0, worker_s.get(k, 0.0)) for k in ("queue", "prefill", "decode")}
    return {
        **parts,
        "finish": max(0.0, total - sum(parts.values())),
        "outside": max(0.0, latency_s - total),
    }


# -- load points ----------------------------------------------------------------------------


def parse_lang_values(spec: str, *, what: str = "value") -> dict[str, float]:
    """`de=0.5,en=0.5` -> {"de": 0.5, "en": 0.5}; every value > 0, no language twice."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lang, sep, value = part.partition("=")
        lang = lang.strip().lower()
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not sep or not lang or not (number > 0 and math.isfinite(number)):
            raise ValueError(f"bad {what} {part!r}: want LANG=NUMBER (> 0), e.g. de=0.5")
        if lang in out:
            raise ValueError(f"language {lang!r} given twice")
        out[lang] = number
    if not out:
        raise ValueError(f"no {what} given")
    return out


def point_rates(total: float, mix: Mapping[str, float]) -> dict[str, float]:
    """Per-language rates of a total rate split by the mix's shares (normalized)."""
    weight = sum(mix.values())
    return {lang: total * share / weight for lang, share in mix.items()}


# -- arrivals -------------------------------------------------------------------------------


def arrival_times(rate: float, duration_s: float, kind: str, rng: random.Random) -> list[float]:
    """Send times in [0, duration_s) of one language at `rate` req/s; `kind`: constant or
    poisson. A constant schedule starts at a random phase so two languages do not fire
    together at every tick."""
    if rate <= 0 or duration_s <= 0:
        return []
    gap = 1.0 / rate
    times: list[float] = []
    if kind == "constant":
        t = rng.random() * gap
        while t < duration_s:
            times.append(t)
            t += gap
    elif kind == "poisson":
        t = rng.expovariate(rate)
        while t < duration_s:
            times.append(t)
            t += rng.expovariate(rate)
    else:
        raise ValueError(f"unknown arrival kind {kind!r} (constant, poisson)")
    return times


def schedule(
    rates: Mapping[str, float], duration_s: float, kind: str, seed: int
) -> list[tuple[float, str]]:
    """(offset_s, lang) of every request of a load point, in time order; seeded per language
    so adding a language leaves the others' schedules as they were."""
    events = [
        (t, lang)
        for lang, rate in rates.items()
        for t in arrival_times(rate, duration_s, kind, random.Random(f"{seed}:{lang}:{kind}"))
    ]
    return sorted(events)


# -- one run's figures ------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of (unsorted) values that may hold math.inf; None when empty
    or when it falls on an infinite value (a miss)."""
    v = nearest_rank(sorted(values), q)
    return None if math.isnan(v) or math.isinf(v) else v


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def language_figures(
    outcomes: Sequence[Outcome], *, slo_s: float, rate: float, window_s: float
) -> dict[str, Any]:
    """One language's figures in one run (see the module notes)."""
    statuses: dict[str, int] = {}
    for o in outcomes:
        statuses[o.status] = statuses.get(o.status, 0) + 1
    ok = [o.latency_s for o in outcomes if o.ok and o.latency_s is not None]
    offered = [o.latency_s if (o.ok and o.latency_s is not None) else math.inf for o in outcomes]
    served = [
        o.latency_s
        if (o.ok or o.status in QUALITY_STATUSES) and o.latency_s is not None
        else math.inf
        for o in outcomes
    ]
    withheld = sum(1 for o in outcomes if o.status in QUALITY_STATUSES)
    good = sum(1 for x in ok if x <= slo_s)
    ttft = [o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None]
    n = len(outcomes)
    out: dict[str, Any] = {
        "rate_per_s": round(rate, 4),
        "offered": n,
        "ok": len(ok),
        "good": good,
        "goodput": round(good / n, 4) if n else None,
        "withheld": round(withheld / n, 4) if n else None,
        "statuses": dict(sorted(statuses.items())),
        "throughput_ok_per_s": round(len(ok) / window_s, 4) if window_s > 0 else None,
    }
    for q in PERCENTILES:
        out[f"p{q:g}_s"] = _r(percentile(offered, q))
    for q in PERCENTILES:
        out[f"p{q:g}_ok_s"] = _r(percentile(ok, q))
    for q in PERCENTILES:
        out[f"p{q:g}_served_s"] = _r(percentile(served, q))
    for q in (50.0, 99.0):
        out[f"ttft_p{q:g}_s"] = _r(percentile(ttft, q))
    out["mean_tokens_out"] = (
        round(sum(o.tokens_out for o in outcomes if o.ok) / len(ok), 2) if ok else None
    )
    out["send_lag_p99_s"] = _r(percentile([o.send_lag_s for o in outcomes], 99.0))
    staged = [o.stages for o in outcomes if o.ok and o.stages]
    if staged:
        out["stages_s"] = {
            stage: {
                f"p{q:g}": _r(percentile([st.get(stage, 0.0) for st in staged], q))
                for q in (50.0, 99.0)
            }
            for stage in STAGES
        }
    return out


# -- repeats ----------------------------------------------------------------------------------


def interval(values: Iterable[float | None]) -> dict[str, Any]:
    """Mean, min, max and the 95 % t interval of the mean of repeated figures; a None (a
    percentile that fell on a miss) makes the whole figure None, since it is unbounded."""
    vals = list(values)
    if not vals:
        return {"mean": None, "min": None, "max": None, "ci95": None, "n": 0, "values": []}
    if any(v is None for v in vals):
        return {"mean": None, "min": None, "max": None, "ci95": None, "n": len(vals),
                "values": vals}  # fmt: skip
    xs = [float(v) for v in vals if v is not None]
    n = len(xs)
    mean = sum(xs) / n
    ci: list[float] | None = None
    if n > 1:
        sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
        df = n - 1
        t = _T95[max(k for k in _T95 if k <= df)] if df <= 30 else 1.96
        half = t * sd / math.sqrt(n)
        ci = [round(mean - half, 4), round(mean + half, 4)]
    return {"mean": round(mean, 4), "min": round(min(xs), 4), "max": round(max(xs), 4),
            "ci95": ci, "n": n, "values": [round(x, 4) for x in xs]}  # fmt: skip


def max_rate_within_slo(
    p99_by_rate: Mapping[float, Sequence[float | None]], slo_s: float
) -> float | None:
    """The highest swept rate at which, and at every lower swept rate, the worst P99 (over
    languages and repeats; None = a miss in the tail) stays within the SLO."""
    best = None
    for rate in sorted(p99_by_rate):
        p99s = p99_by_rate[rate]
        if not p99s or any(p is None or p > slo_s for p in p99s):
            break
        best = rate
    return best
