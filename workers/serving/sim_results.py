"""What a simulation run measures: the per-request records, the result records and the summary
that turns one run's counters into them (percentiles, SLO windows, backlog, Jain's index).

`simulate.py` runs the loop: it creates a `RequestRecord` per arrival, fills in its admission
and finish times (or marks it expired) and counts, per language, the service, output tokens and
waiting time of the steps in the measurement window; `summarize` then builds the `SimResult`.
Nothing here steps the scheduler, so the numbers can be read (and changed) apart from the loop.

Measurement: service and throughput count steps that start inside [warmup_s, duration_s)
(service = tokens computed + 2 x output tokens, per language: a cached prefix is not computed,
a preempted request's recomputation is); latency and SLO numbers count requests arriving in
that window. A request still unfinished when the run ends enters the latency percentiles with
its age at the end (a lower bound) rather than being censored away, so an ever-growing FCFS
queue shows in the tail. A language counts as backlogged when requests of it were left waiting
after admission (in the queue, or preempted) for at least `backlog_fraction` of the measured
time.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from workers.engine.types import GenerationRequest
from workers.fairness.vtc import jain_index
from workers.serving.sim_config import SimConfig

__all__ = ["LanguageResult", "RequestRecord", "SimResult", "summarize"]


@dataclass(slots=True)
class RequestRecord:
    """One arrival as the loop saw it: when it was admitted and finished, or that it expired."""

    request: GenerationRequest
    lang: str
    arrival: float
    slo_s: float
    admitted: float = math.nan
    finish: float = math.nan
    expired: bool = False  # dropped: expired or refused at admission, or refused at submission
    rejected: bool = False  # refused at submission by the deadline precheck (SimConfig.admission)


@dataclass(slots=True)
class LanguageResult:
    weight: float
    slo_s: float
    arrived: int  # arrivals inside the measurement window
    completed: int  # of those, finished
    expired: int  # of those, dropped at admission (deadline passed, or refused)
    unfinished: int  # of those, still waiting or running at the end
    service: float  # weighted tokens served in the window (prefill + 2 * output)
    normalized_service: float  # service / weight
    output_tokens: int  # tokens generated in the window
    backlogged_fraction: float  # share of measured time with requests left waiting
    latency_p50_s: float
    latency_p95_s: float
    latency_p99_s: float
    latency_p999_s: float
    queue_p50_s: float  # arrival -> admission, admitted requests only
    queue_p99_s: float
    slo_attainment: float  # met / decided (nan if none decided)
    window_attainment: list[float]  # per window_s window, by arrival (nan: none decided)
    rejected: int = 0  # of `expired`, refused at submission by the deadline precheck
    goodput: float = math.nan  # met / arrived: dropped and unfinished requests are misses


@dataclass(slots=True)
class SimResult:
    queue: str
    sim_end_s: float
    steps: int
    throughput_tokens_s: float  # output tokens per second in the window
    service_tokens_s: float  # weighted service per second in the window
    completed_rps: float  # requests finished per second in the window
    backlogged: list[str]  # languages backlogged for >= backlog_fraction of the window
    jain_index: float  # over the backlogged languages' normalized service
    service_ratio: dict[str, float]  # backlogged lang -> normalized service / their mean
    languages: dict[str, LanguageResult]
    preemptions: int = 0  # running sequences preempted for KV blocks (0 with the default pool)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: nan and inf become None."""
        return _jsonable(asdict(self))


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def summarize(
    config: SimConfig,
    kind: str,
    arrivals: list[RequestRecord],
    sim_end: float,
    steps: int,
    preemptions: int,
    service: dict[str, float],
    out_tokens: dict[str, int],
    waiting_time: dict[str, float],
    measured_time: float,
    completed_in_window: int,
) -> SimResult:
    warm, stop = config.warmup_s, config.duration_s
    n_windows = max(1, math.ceil((stop - warm) / config.window_s))
    per_lang: dict[str, LanguageResult] = {}
    for lang in sorted(config.languages):
        load = config.languages[lang]
        lat: list[float] = []
        waits: list[float] = []
        arrived = completed = expired = rejected = unfinished = met = decided = 0
        win_met = [0] * n_windows
        win_decided = [0] * n_windows
        for r in arrivals:
            if r.lang != lang or not warm <= r.arrival < stop:
                continue
            arrived += 1
            if not math.isnan(r.admitted):
                waits.append(r.admitted - r.arrival)
            w = min(n_windows - 1, int((r.arrival - warm) // config.window_s))
            if r.expired:
                expired += 1
                rejected += r.rejected
                ok: bool | None = False
            elif not math.isnan(r.finish):
                completed += 1
                lat.append(r.finish - r.arrival)
                ok = r.finish - r.arrival <= r.slo_s
            else:
                unfinished += 1
                age = sim_end - r.arrival
                lat.append(age)  # lower bound on its latency
                ok = False if age > r.slo_s else None  # None: can still make it
            if ok is not None:
                decided += 1
                win_decided[w] += 1
                if ok:
                    met += 1
                    win_met[w] += 1
        per_lang[lang] = LanguageResult(
            weight=load.weight,
            slo_s=load.slo_s,
            arrived=arrived,
            completed=completed,
            expired=expired,
            unfinished=unfinished,
            service=service[lang],
            normalized_service=service[lang] / load.weight,
            output_tokens=out_tokens[lang],
            backlogged_fraction=waiting_time[lang] / measured_time if measured_time else 0.0,
            latency_p50_s=_percentile(lat, 50),
            latency_p95_s=_percentile(lat, 95),
            latency_p99_s=_percentile(lat, 99),
            latency_p999_s=_percentile(lat, 99.9),
            queue_p50_s=_percentile(waits, 50),
            queue_p99_s=_percentile(waits, 99),
            slo_attainment=met / decided if decided else math.nan,
            window_attainment=[
                m / d if d else math.nan for m, d in zip(win_met, win_decided, strict=True)
            ],
            rejected=rejected,
            goodput=met / arrived if arrived else math.nan,
        )
    backlogged = [
        g for g, res in per_lang.items() if res.backlogged_fraction >= config.backlog_fraction
    ]
    norm = [per_lang[g].normalized_service for g in backlogged]
    mean = sum(norm) / len(norm) if norm else 0.0
    span = measured_time or math.nan
    return SimResult(
        queue=kind,
        sim_end_s=sim_end,
        steps=steps,
        throughput_tokens_s=sum(out_tokens.values()) / span,
        service_tokens_s=sum(service.values()) / span,
        completed_rps=completed_in_window / span,
        backlogged=backlogged,
        jain_index=jain_index(norm),
        service_ratio={
            g: (per_lang[g].normalized_service / mean if mean else math.nan) for g in backlogged
        },
        languages=per_lang,
        preemptions=preemptions,
    )
