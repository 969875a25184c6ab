"""Weighted fair share, measured: VTC vs FCFS in simulation and through Kafka + the engine.

    python -m bench.fairness [--part sim|real|both|memory|all] [--out fairness.json] ...

Prints one JSON document (and writes it to --out). Parts:

* calibration (always first): times real engine steps with the configured model at a few batch
  sizes and prefill sizes and fits `step = a + b * prefill_tokens + c * batch` by least squares
  (`CostModel`); the same steps' requests feed a `LatencyModel`, whose held-out median absolute
  error is reported. Then the engine's capacity is *measured* (`measure_capacity`): the real
  run's rates are multiples of it (the cost model's estimate is reported beside it).
* sim: `workers.serving.simulate` (the engine's real scheduler and KV cache manager on a
  simulated clock) with the measured cost model: weights de 4, fr 3, es 2,
  it 1; de/fr/es together offer `--overload` x capacity, Italian `--light-fraction` of it. VTC
  and FCFS side by side: Jain index and weight-normalized service of the backlogged languages,
  Italian's p99 and SLO attainment per window, throughput ratio VTC / FCFS.
* real: the same scenario through a real broker: an open-loop producer (Poisson schedule per
  language, latency measured from the *scheduled* send time, so no coordinated omission)
  writes Avro requests to `<prefix>tolk.requests.<lang>`, an in-process `workers.worker.Worker`
  serves them with a `FairEngine` (VTC or FCFS), a reader collects the replies. Arms: `vtc`,
  `fcfs` (no deadlines: a deadline would cap FCFS's queueing and hide what it does to the
  light language) and `vtc-deadline` (every request has deadline = send + SLO: no OK reply
  may come after its deadline, refusals should come early).
* memory: 100k tiny requests on one language's topic, the worker with intake quotas for
  `--memory-seconds`; samples RSS and the worker's in-flight count against the high water.

SLOs: the configured ones, DEFAULT_POLICIES' p99 targets (de 2 s, fr 3 s, es 4 s, it 6 s), are
what every part judges by default. Scaling them is opt-in: `--slo-scale X` multiplies them by X,
`--slo-scale auto` by the machine's speed (`auto_slo_scale`: on a slow CPU one request at a full
batch may take longer than 6 s by itself, which no scheduler can fix; 1 on fast hardware). A
scale other than 1 is said in the one-line summary (stderr, after the JSON) as well as in the
JSON (`slo_scale`, `slo_s`), so a figure judged against stretched SLOs is never read as one
judged against the configured ones. Seeds are fixed; the model is warmed before timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import random
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import machine_info
from workers.fairness.latency_model import LatencyModel
from workers.fairness.policy import DEFAULT_BURST_TOKENS, DEFAULT_POLICIES, LanguagePolicy
from workers.fairness.vtc import OUTPUT_TOKEN_COST, jain_index
from workers.serving.pipeline import ServingOptions, build_served_engine
from workers.serving.sim_config import CostModel, issue_scenario
from workers.serving.simulate import simulate

log = logging.getLogger("bench.fairness")

WEIGHTS = {"de": 4.0, "fr": 3.0, "es": 2.0, "it": 1.0}
HEAVY = ("de", "fr", "es")
LIGHT = "it"


def load_texts(n: int = 2000, seed: int = 0) -> list[str]:
    """Short English sentences of the four Tatoeba pairs (`replay.datasets`; missing data
    raises, there is no built-in fallback)."""
    from replay.datasets import tatoeba_pairs

    texts = [en.strip() for lang in ("de", "fr", "it", "es") for en, _ in tatoeba_pairs(lang)]
    texts = [t for t in dict.fromkeys(texts) if 3 <= len(t.split()) <= 30]
    random.Random(seed).shuffle(texts)
    return texts[:n]


def _jsonable(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, np.floating | np.integer):
        return _jsonable(v.item())
    return v


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


# -- calibration --------------------------------------------------------------------------------


def calibrate(engine: Any, texts: Sequence[str], max_batch: int, out_tokens: int = 6) -> dict:
    """Time real engine steps; fit the simulator's CostModel and a LatencyModel."""
    from workers.serving.admission import EngineAdmission

    langs = list(WEIGHTS)
    engine.warm(langs)
    short = sorted(texts, key=len)[: len(texts) // 4] or list(texts)
    long = sorted(texts, key=len)[-max(1, len(texts) // 8) :]
    sizes = sorted({b for b in (1, 2, 4, 8, 16, 32) if b <= max_batch} | {max_batch})
    rows: list[tuple[int, int, float]] = []  # (prefill tokens, batch, seconds)
    adm = EngineAdmission(LatencyModel(min_samples=16, refit_every=8))
    rng = random.Random(1)
    uncached: list[int] = []
    # one untimed round: first-call allocations
    engine.generate([engine.translation_request(short[0], "en", "de", max_new_tokens=2)])
    for rep in range(2):
        for pool in (short, long):
            for b in sizes:
                reqs = [
                    engine.translation_request(
                        rng.choice(pool),
                        "en",
                        langs[i % 4],
                        max_new_tokens=out_tokens,
                        ignore_eos=True,
                    )
                    for i in range(b)
                ]
                handles = [engine.submit(r) for r in reqs]
                batch_at: dict[str, int] = {}
                while engine.has_unfinished():
                    p0 = engine.stats.prefill_tokens
                    t0 = time.perf_counter()
                    engine.step()
                    dt = time.perf_counter() - t0
                    batch = engine.stats.last_batch_size
                    if batch:
                        rows.append((engine.stats.prefill_tokens - p0, batch, dt))
                    for r in reqs:
                        batch_at.setdefault(r.request_id, batch)
                for r, h in zip(reqs, handles, strict=True):
                    res = h.result(0)
                    uncached.append(res.tokens_in - res.cached_tokens)
                    if rep > 0 or b > 1:
                        adm.observe(res, batch_size=batch_at[r.request_id], group=r.group)
    x = np.array([[1.0, p, b] for p, b, _ in rows])
    y = np.array([dt for *_, dt in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    a, bp, cb = (max(0.0, float(c)) for c in coef)
    resid = y - x @ coef
    cost = CostModel(step_base_s=a, prefill_s_per_token=bp, batch_s_per_seq=cb)
    adm.model.refit()
    return {
        "cost_model": dataclasses.asdict(cost),
        "steps_timed": len(rows),
        "fit_r2": float(1 - resid.var() / y.var()) if y.var() > 0 else math.nan,
        "step_median_s": float(np.median(y)),
        "uncached_prompt_tokens": [
            int(np.percentile(uncached, 10)),
            int(np.percentile(uncached, 90)),
        ],
        "latency_model": {
            "median_abs_error_s": adm.model.median_abs_error(),
            "observations": adm.model.observations,
            "coefficients": adm.model.coefficients,
        },
        "_cost": cost,
    }


def measure_capacity(
    engine: Any, texts: Sequence[str], max_batch: int, max_new_tokens: int, seed: int = 2
) -> dict:
    """Requests per second the engine finishes when saturated, measured: 6 x max_batch requests
    of the benchmark's own mix (random texts, the four languages, real stop rules) submitted at
    once and run to completion. The simulator's analytic estimate assumes every request runs to
    0.75 x max_new_tokens and no per-request overhead; it came out 1.2-1.3x too high on CPU."""
    rng = random.Random(seed)
    langs = list(WEIGHTS)
    reqs = [
        engine.translation_request(
            rng.choice(texts), "en", langs[i % 4], max_new_tokens=max_new_tokens
        )
        for i in range(6 * max_batch)
    ]
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    dt = time.perf_counter() - t0
    return {
        "capacity_rps": len(reqs) / dt,
        "requests": len(reqs),
        "seconds": dt,
        "mean_tokens_out": sum(r.tokens_out for r in results) / len(results),
    }


def auto_slo_scale(
    cost: CostModel, max_batch: int, prompt_tokens: float, out_tokens: int, budget: int
) -> float:
    """Scale on DEFAULT_POLICIES' SLOs so the light language's target is reachable on this
    machine: 1.5 x (its own service at a full batch + one VTC round). A round is the time the
    others need to catch up one request of the light language: with weights summing to W and
    the light one's w, about W / w requests' worth of service at full throughput, i.e.
    (W / w) / capacity_rps. Both terms scale with the machine's speed, so the ratio between
    the SLOs stays the issue's; on a GPU the scale is 1."""
    from workers.serving.sim_config import estimate_capacity_rps

    service = cost.step_time(int(prompt_tokens), max_batch) + out_tokens * cost.step_time(
        0, max_batch
    )
    cap = estimate_capacity_rps(prompt_tokens, 0.75 * out_tokens, budget, max_batch, cost)
    vtc_round = sum(WEIGHTS.values()) / WEIGHTS[LIGHT] / cap
    return max(1.0, 1.5 * (service + vtc_round) / DEFAULT_POLICIES[LIGHT].slo_p99_s)


def scaled_policies(scale: float, max_queue: int, max_new_tokens: int) -> dict[str, LanguagePolicy]:
    return {
        g: LanguagePolicy(
            weight=w,
            slo_p99_s=DEFAULT_POLICIES[g].slo_p99_s * scale,
            max_queue=max_queue,
            max_new_tokens=max_new_tokens,
        )
        for g, w in WEIGHTS.items()
    }


# -- simulation ---------------------------------------------------------------------------------


def run_sim(args: argparse.Namespace, cal: dict, slo_scale: float) -> dict:
    cost: CostModel = cal["_cost"]
    lo, hi = cal["uncached_prompt_tokens"]
    out_rng = (max(1, args.max_new_tokens // 2), args.max_new_tokens)
    res: dict[str, Any] = {}
    for kind in ("vtc", "fcfs"):
        cfg = issue_scenario(
            kind,
            overload=args.overload,
            light_fraction=args.light_fraction,
            duration_s=args.sim_duration,
            warmup_s=args.sim_duration / 10,
            seed=args.seed,
            cost=cost,
            token_budget=args.max_num_batched_tokens,
            max_batch=args.max_num_seqs,
            prompt_tokens=(max(1, lo), max(lo + 1, hi)),
            output_tokens=out_rng,
            burst_tokens=args.burst_tokens,
        )
        langs = {
            g: dataclasses.replace(v, slo_s=v.slo_s * slo_scale) for g, v in cfg.languages.items()
        }
        cfg = dataclasses.replace(cfg, languages=langs, window_s=args.window)
        res[kind] = simulate(cfg).to_dict()
    return {**_summary(res["vtc"], res["fcfs"]), "runs": res}


def _summary(vtc: Mapping[str, Any], fcfs: Mapping[str, Any]) -> dict:
    def light(r: Mapping[str, Any]) -> dict:
        it = r["languages"][LIGHT]
        wins = [w for w in it["window_attainment"] if w is not None]
        return {
            "p99_s": it["latency_p99_s"],
            "slo_s": it["slo_s"],
            "windows_p99_met": _windows_met(it),
            "window_attainment": it["window_attainment"],
            "min_window_attainment": min(wins) if wins else None,
        }

    return {
        "jain_vtc": vtc["jain_index"],
        "jain_fcfs": fcfs["jain_index"],
        "backlogged_vtc": vtc["backlogged"],
        "service_ratio_vtc": vtc["service_ratio"],
        "service_ratio_fcfs": fcfs["service_ratio"],
        "normalized_service_vtc": {g: v["normalized_service"] for g, v in vtc["languages"].items()},
        "light_vtc": light(vtc),
        "light_fcfs": light(fcfs),
        "throughput_ratio_vtc_over_fcfs": (
            vtc["throughput_tokens_s"] / fcfs["throughput_tokens_s"]
            if fcfs["throughput_tokens_s"]
            else None
        ),
    }


def _windows_met(lang: Mapping[str, Any]) -> float | None:
    """Share of windows whose attainment >= 0.99 (their p99 within the SLO)."""
    wins = [w for w in lang["window_attainment"] if w is not None]
    return sum(1 for w in wins if w >= 0.99) / len(wins) if wins else None


# -- the real run -------------------------------------------------------------------------------


class _ReplyReader(threading.Thread):
    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(name="bench-replies", daemon=True)
        from confluent_kafka import Consumer

        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"bench-replies-{uuid.uuid4().hex[:8]}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
            }
        )
        self.consumer.subscribe([topic])
        self.replies: dict[str, tuple[int, dict[str, Any]]] = {}  # rid -> (recv ms, reply)
        self.stop_event = threading.Event()

    def run(self) -> None:
        from schemas.codec import decode_result

        while not self.stop_event.is_set():
            for m in self.consumer.consume(500, 0.1):
                value = m.value()
                if m.error() is None and value:
                    r = decode_result(value)
                    self.replies.setdefault(r["request_id"], (int(time.time() * 1000), r))
        self.consumer.close()


def _schedule(rates: Mapping[str, float], duration: float, seed: int) -> list[tuple[float, str]]:
    out: list[tuple[float, str]] = []
    for lang, rate in sorted(rates.items()):
        rng = random.Random(f"{seed}:{lang}")
        t = 0.0
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= duration:
                break
            out.append((t, lang))
    return sorted(out)


def run_real_arm(
    loaded: Any,
    arm: str,
    args: argparse.Namespace,
    rates: Mapping[str, float],
    policies: Mapping[str, LanguagePolicy],
    texts: Sequence[str],
    cost: CostModel,
) -> dict:
    from confluent_kafka import Producer
    from prometheus_client import CollectorRegistry

    from schemas.codec import encode_request
    from topics.admin import ensure_topics
    from topics.catalog import catalog, replies_topic, request_topic
    from workers.engine.engine import EngineConfig
    from workers.fairness.latency_model import prior_from_step_costs
    from workers.serving.fair_engine import build_fair_engine
    from workers.settings import Settings
    from workers.worker import Worker

    langs = tuple(WEIGHTS)
    prefix = f"bench-fair-{arm}-{uuid.uuid4().hex[:8]}."
    ensure_topics(args.bootstrap, catalog(langs, partitions=1, prefix=prefix))
    fe = build_fair_engine(
        loaded,
        policies,
        fair=(arm != "fcfs"),
        burst_tokens=args.burst_tokens,
        latency_model=LatencyModel(prior_from_step_costs(**dataclasses.asdict(cost))),
        config=EngineConfig(
            kv_cache_tokens=args.kv_cache_tokens,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_new_tokens=args.max_new_tokens,
            model_version=arm,
        ),
    )
    fe.engine.warm(list(langs))
    settings = Settings(
        bootstrap=args.bootstrap,
        redis_url=args.redis_url,
        group_id=f"bench-fair-{uuid.uuid4().hex[:8]}",
        languages=langs,
        topic_prefix=prefix,
        metrics_port=0,
        worker_id=f"bench-{arm}",
        policies=policies,
        max_in_flight=4 * args.high_water + 16,
        drain_timeout_s=1.0,
    )
    reader = _ReplyReader(args.bootstrap, replies_topic(prefix))
    reader.start()
    # the builder with no stage on: the fair engine alone (workers/serving/pipeline.py)
    served = build_served_engine(fe, ServingOptions.of(settings, faithful=False))
    worker = Worker(settings, served, registry=CollectorRegistry())
    wthread = worker.run_in_thread()
    if not worker.assigned_event.wait(60):
        raise RuntimeError("worker got no partitions")

    sched = _schedule(rates, args.real_duration, args.seed)
    run_id = uuid.uuid4().hex[:8]
    sent: dict[str, tuple[str, float, int | None]] = {}  # rid -> (lang, sched wall s, deadline)
    producer = Producer({"bootstrap.servers": args.bootstrap, "linger.ms": 2})
    with_deadline = arm.endswith("deadline")
    samples: list[dict[str, Any]] = []
    stop_sampling = threading.Event()
    queue = fe.queue

    def sample() -> None:
        while not stop_sampling.wait(0.5):
            samples.append(
                {
                    "t": time.time(),
                    "depths": dict(queue.depths()),  # type: ignore[attr-defined]
                    "service": dict(queue.service_by_group()),  # type: ignore[attr-defined]
                    "decode_tokens": fe.engine.stats.decode_tokens,
                    "in_flight": worker.in_flight(),
                }
            )

    sampler = threading.Thread(target=sample, name="bench-sampler", daemon=True)
    sampler.start()
    t0 = time.time() + 0.5
    rng = random.Random(args.seed)
    for i, (at, lang) in enumerate(sched):
        wait = t0 + at - time.time()
        if wait > 0:
            time.sleep(wait)
        rid = f"{arm}-{run_id}-{lang}-{i}"  # unique per run: the worker's redis store
        # answers a request id it has seen before from the stored reply
        sched_ms = int((t0 + at) * 1000)
        deadline = sched_ms + int(policies[lang].slo_p99_s * 1000) if with_deadline else None
        value = encode_request(
            {
                "request_id": rid,
                "source_lang": "en",
                "target_lang": lang,
                "text": rng.choice(texts),
                "created_at": sched_ms,
                "deadline": deadline,
                "reply_topic": replies_topic(prefix),
            }
        )
        producer.produce(request_topic(lang, prefix), value=value, key=rid.encode())
        producer.poll(0)
        sent[rid] = (lang, t0 + at, deadline)
    producer.flush(10)
    # Let the light language's last requests finish (the heavy backlog never will).
    end = time.time() + args.real_drain
    while time.time() < end:
        pending = [r for r, (g, *_) in sent.items() if g == LIGHT and r not in reader.replies]
        if not pending:
            break
        time.sleep(0.2)
    t_end = time.time()
    stop_sampling.set()
    sampler.join()
    worker.stop()
    wthread.join(30)
    reader.stop_event.set()
    reader.join(10)
    return _real_summary(arm, args, policies, sent, reader.replies, samples, t0, t_end, fe)


def _real_summary(
    arm: str,
    args: argparse.Namespace,
    policies: Mapping[str, LanguagePolicy],
    sent: Mapping[str, tuple[str, float, int | None]],
    replies: Mapping[str, tuple[int, dict[str, Any]]],
    samples: list[dict[str, Any]],
    t0: float,
    t_end: float,
    fe: Any,
) -> dict:
    warm, stop = t0 + args.real_warmup, t0 + args.real_duration
    win = [s for s in samples if warm <= s["t"] < stop]
    per_lang: dict[str, Any] = {}
    if len(win) >= 2:
        first, last = win[0], win[-1]
        span = last["t"] - first["t"]
        svc = {g: last["service"].get(g, 0.0) - first["service"].get(g, 0.0) for g in WEIGHTS}
        backlog = {g: sum(1 for s in win if s["depths"].get(g, 0) > 0) / len(win) for g in WEIGHTS}
        tokens_s = (last["decode_tokens"] - first["decode_tokens"]) / span
    else:
        span, svc, backlog, tokens_s = math.nan, dict.fromkeys(WEIGHTS, 0.0), {}, math.nan
    backlogged = [g for g in WEIGHTS if backlog.get(g, 0.0) >= 0.9]
    norm = {g: svc[g] / WEIGHTS[g] for g in WEIGHTS}
    bl_norm = [norm[g] for g in backlogged]
    mean = sum(bl_norm) / len(bl_norm) if bl_norm else math.nan
    # reply-side service (uncached prompt + 2 * output) of requests completed in the window
    reply_svc = dict.fromkeys(WEIGHTS, 0.0)
    statuses: dict[str, int] = {}
    ok_after_deadline = 0
    refused_early_s: list[float] = []
    n_windows = max(1, math.ceil((args.real_duration - args.real_warmup) / args.window))
    for g in WEIGHTS:
        lat: list[float] = []
        met = [0] * n_windows
        dec = [0] * n_windows
        for rid, (lang, at, deadline) in sent.items():
            if lang != g:
                continue
            got = replies.get(rid)
            if got is not None:
                recv_ms, r = got
                statuses[r["status"]] = statuses.get(r["status"], 0) + 1
                done_ms = r["completed_at"]
                if r["status"] == "OK":
                    if deadline is not None and done_ms > deadline:
                        ok_after_deadline += 1
                    if warm * 1000 <= done_ms < stop * 1000:
                        reply_svc[g] += (
                            r["tokens_in"]
                            - r["cached_prefix_tokens"]
                            + OUTPUT_TOKEN_COST * r["tokens_out"]
                        )
                elif deadline is not None and r["status"] in ("REJECTED", "EXPIRED"):
                    refused_early_s.append((deadline - done_ms) / 1000)
            if not warm <= at < stop:
                continue
            w = min(n_windows - 1, int((at - warm) // args.window))
            slo = policies[g].slo_p99_s
            if got is not None and got[1]["status"] == "OK":
                latency = got[0] / 1000 - at
                lat.append(latency)
                dec[w] += 1
                met[w] += latency <= slo
            elif got is not None:
                dec[w] += 1  # refused: counts as a miss
            else:
                age = t_end - at
                lat.append(age)  # lower bound, as in the simulation
                if age > slo:
                    dec[w] += 1
        attain = [m / d if d else math.nan for m, d in zip(met, dec, strict=True)]
        per_lang[g] = {
            "phases_ms": _phases(g, sent, replies, warm, stop),
            "weight": WEIGHTS[g],
            "slo_s": policies[g].slo_p99_s,
            "sent_in_window": sum(
                1 for lang, at, _ in sent.values() if lang == g and warm <= at < stop
            ),
            "service": svc[g],
            "normalized_service": norm[g],
            "reply_service": reply_svc[g],
            "backlogged_fraction": backlog.get(g),
            "latency_p50_s": _pct(lat, 50),
            "latency_p99_s": _pct(lat, 99),
            "window_attainment": attain,
        }
    light = per_lang[LIGHT]
    wins = [w for w in light["window_attainment"] if not math.isnan(w)]
    stats = fe.stats()
    return {
        "arm": arm,
        "window_s": span,
        "backlogged": backlogged,
        "jain_index": jain_index(bl_norm) if bl_norm else math.nan,
        "service_ratio": {g: norm[g] / mean for g in backlogged} if bl_norm else {},
        "throughput_tokens_s": tokens_s,
        "light": {
            "p99_s": light["latency_p99_s"],
            "slo_s": light["slo_s"],
            "windows_p99_met": sum(1 for w in wins if w >= 0.99) / len(wins) if wins else None,
        },
        "statuses": statuses,
        "ok_after_deadline": ok_after_deadline,
        "refused_seconds_before_deadline_p50": _pct(refused_early_s, 50),
        "refused_seconds_before_deadline_min": min(refused_early_s) if refused_early_s else None,
        "latency_model_median_abs_error_s": stats["latency_model_mae_s"],
        "engine": stats,
        "max_in_flight_seen": max((s["in_flight"] for s in samples), default=0),
        "languages": per_lang,
    }


def _phases(
    lang: str,
    sent: Mapping[str, tuple[str, float, int | None]],
    replies: Mapping[str, tuple[int, dict[str, Any]]],
    warm: float,
    stop: float,
) -> dict[str, dict[str, float]]:
    """Where an OK request's latency went (p50 / p99 / max, ms), from the reply's timings:
    `to_worker` (scheduled send -> broker timestamp: producer batching), `queue` (broker
    timestamp -> admitted by the scheduler: Kafka fetch + intake + engine queue), `prefill`,
    `decode`, `reply_leg` (result produced -> read by the client) and `end_to_end`."""
    rows: dict[str, list[float]] = {
        k: [] for k in ("to_worker", "queue", "prefill", "decode", "reply_leg", "end_to_end")
    }
    for rid, (g, at, _) in sent.items():
        got = replies.get(rid)
        if g != lang or got is None or got[1]["status"] != "OK" or not warm <= at < stop:
            continue
        recv_ms, r = got
        t = r["timings"]
        e2e = recv_ms - at * 1000
        rows["end_to_end"].append(e2e)
        rows["queue"].append(t["queue_ms"])
        rows["prefill"].append(t["prefill_ms"])
        rows["decode"].append(t["decode_ms"])
        reply_leg = recv_ms - r["completed_at"]
        rows["reply_leg"].append(reply_leg)
        rows["to_worker"].append(e2e - t["total_ms"] - reply_leg)
    return {
        k: {"p50": _pct(v, 50), "p99": _pct(v, 99), "max": max(v)} for k, v in rows.items() if v
    }


def run_real(
    args: argparse.Namespace, loaded: Any, cal: dict, slo_scale: float, texts: Sequence[str]
) -> dict:
    from workers.serving.sim_config import estimate_capacity_rps

    lo, hi = cal["uncached_prompt_tokens"]
    out = 0.75 * args.max_new_tokens
    cap = cal["capacity"]["capacity_rps"]
    cap_model = estimate_capacity_rps(
        (lo + hi) / 2, out, args.max_num_batched_tokens, args.max_num_seqs, cal["_cost"]
    )
    heavy = args.overload * cap / len(HEAVY)
    rates = {**dict.fromkeys(HEAVY, heavy), LIGHT: args.light_fraction * cap}
    policies = scaled_policies(slo_scale, args.high_water, args.max_new_tokens)
    arms = {}
    for arm in args.arms.split(","):
        log.info("real arm %s: rates %s", arm, rates)
        arms[arm] = run_real_arm(loaded, arm, args, rates, policies, texts, cal["_cost"])
    out_d: dict[str, Any] = {
        "capacity_rps_measured": cap,
        "capacity_rps_cost_model": cap_model,
        "rates_rps": rates,
        "arms": arms,
    }
    if "vtc" in arms and "fcfs" in arms:
        v, f = arms["vtc"], arms["fcfs"]
        out_d["throughput_ratio_vtc_over_fcfs"] = (
            v["throughput_tokens_s"] / f["throughput_tokens_s"]
            if f["throughput_tokens_s"]
            else None
        )
    return out_d


# -- memory bound -------------------------------------------------------------------------------


def run_memory(args: argparse.Namespace, loaded: Any) -> dict:
    import psutil
    from confluent_kafka import Producer
    from prometheus_client import CollectorRegistry

    from schemas.codec import encode_request
    from topics.admin import ensure_topics
    from topics.catalog import catalog, replies_topic, request_topic
    from workers.engine.engine import EngineConfig
    from workers.serving.fair_engine import build_fair_engine
    from workers.settings import Settings
    from workers.worker import Worker

    proc = psutil.Process()
    langs = tuple(WEIGHTS)
    prefix = f"bench-mem-{uuid.uuid4().hex[:8]}."
    ensure_topics(args.bootstrap, catalog(langs, partitions=1, prefix=prefix))
    producer = Producer(
        {
            "bootstrap.servers": args.bootstrap,
            "linger.ms": 50,
            "batch.num.messages": 10000,
            "queue.buffering.max.messages": 200000,
            "compression.type": "lz4",
        }
    )
    t = time.time()
    now_ms = int(t * 1000)
    run_id = uuid.uuid4().hex[:8]
    for i in range(args.memory_requests):
        value = encode_request(
            {
                "request_id": f"m-{run_id}-{i}",
                "source_lang": "en",
                "target_lang": "de",
                "text": "Hi.",
                "created_at": now_ms,
                "reply_topic": replies_topic(prefix),
            }
        )
        while True:
            try:
                producer.produce(request_topic("de", prefix), value=value)
                break
            except BufferError:
                producer.poll(0.05)
    producer.flush(60)
    produce_s = time.time() - t
    hw = args.high_water
    policies = scaled_policies(1.0, hw, 4)
    fe = build_fair_engine(
        loaded,
        policies,
        fair=True,
        config=EngineConfig(
            kv_cache_tokens=args.kv_cache_tokens, max_num_seqs=args.max_num_seqs, max_new_tokens=4
        ),
    )
    rss0 = proc.memory_info().rss
    settings = Settings(
        bootstrap=args.bootstrap,
        redis_url=args.redis_url,
        group_id=f"bench-mem-{uuid.uuid4().hex[:8]}",
        languages=langs,
        topic_prefix=prefix,
        metrics_port=0,
        worker_id="bench-mem",
        policies=policies,
        drain_timeout_s=1.0,
        max_in_flight=4 * hw + 16,
        max_poll_records=max(1, hw // 2),  # one consume() batch may overshoot high water
    )
    # the builder with no stage on: the fair engine alone (workers/serving/pipeline.py)
    served = build_served_engine(fe, ServingOptions.of(settings, faithful=False))
    worker = Worker(settings, served, registry=CollectorRegistry())
    th = worker.run_in_thread()
    rss: list[int] = []
    inflight: list[int] = []
    paused_seen = False
    end = time.time() + args.memory_seconds
    while time.time() < end:
        rss.append(proc.memory_info().rss)
        inflight.append(worker.in_flight())
        paused_seen |= "de" in worker.paused_languages()
        time.sleep(0.2)
    answered = worker.metrics.requests_total.labels(lang="de", status="OK")._value.get()
    worker.stop()
    th.join(30)
    return {
        "requests_on_topic": args.memory_requests,
        "produce_s": produce_s,
        "high_water": hw,
        "max_poll_records": settings.max_poll_records,
        "max_in_flight_seen": max(inflight, default=0),
        "in_flight_bound": hw + settings.max_poll_records,
        "in_flight_within_high_water": max(inflight, default=0) <= hw,
        "paused_seen": paused_seen,
        "answered_ok": answered,
        "rss_before_worker_mib": rss0 / 2**20,
        "rss_peak_mib": max(rss, default=rss0) / 2**20,
        "rss_growth_mib": (max(rss, default=rss0) - rss0) / 2**20,
        "rss_last_mib": (rss[-1] if rss else rss0) / 2**20,
    }


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.fairness", description=__doc__.split("\n")[0])
    p.add_argument("--part", default="both", choices=["sim", "real", "both", "memory", "all"])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--kv-cache-tokens", type=int, default=8192)
    p.add_argument("--overload", type=float, default=3.0)
    p.add_argument("--light-fraction", type=float, default=0.05)
    p.add_argument(
        "--slo-scale",
        default="1",
        help="multiply the policies' SLOs by this number, or by the machine's speed ('auto'); "
        "default 1: judge by the configured SLOs",
    )
    p.add_argument("--window", type=float, default=30.0, help="SLO attainment window, seconds")
    p.add_argument("--sim-duration", type=float, default=600.0)
    p.add_argument("--real-duration", type=float, default=150.0)
    p.add_argument("--real-warmup", type=float, default=30.0)
    p.add_argument("--real-drain", type=float, default=20.0)
    p.add_argument("--arms", default="vtc,fcfs,vtc-deadline")
    p.add_argument("--high-water", type=int, default=64, help="intake max_queue per language")
    p.add_argument(
        "--burst-tokens",
        type=float,
        default=DEFAULT_BURST_TOKENS,
        help="VTC burst credit of a language back from idle (0: the paper's lift)",
    )
    p.add_argument("--bootstrap", default="127.0.0.1:9092")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--memory-requests", type=int, default=100_000)
    p.add_argument("--memory-seconds", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    _check_slo_scale(args.slo_scale)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    log.setLevel(logging.INFO)
    logging.getLogger("workers.worker").setLevel(logging.ERROR)  # drain-timeout noise per arm
    import torch

    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.loader import load_model

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype), device="cpu")
    texts = load_texts(seed=args.seed)
    out: dict[str, Any] = {
        "machine": machine_info(args.threads or None),  # the CPU the figures belong to
        "config": {k: v for k, v in vars(args).items()},
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    cal_engine = Engine(
        loaded,
        EngineConfig(
            kv_cache_tokens=args.kv_cache_tokens,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        ),
    )
    cal = calibrate(cal_engine, texts, args.max_num_seqs)
    cal["capacity"] = measure_capacity(cal_engine, texts, args.max_num_seqs, args.max_new_tokens)
    del cal_engine
    lo, hi = cal["uncached_prompt_tokens"]
    scale = (
        auto_slo_scale(
            cal["_cost"],
            args.max_num_seqs,
            (lo + hi) / 2,
            args.max_new_tokens,
            args.max_num_batched_tokens,
        )
        if args.slo_scale == "auto"
        else float(args.slo_scale)
    )
    out["calibration"] = {k: v for k, v in cal.items() if not k.startswith("_")}
    out["slo_scale"] = scale  # 1 unless --slo-scale asked for another
    out["slo_s"] = {g: DEFAULT_POLICIES[g].slo_p99_s * scale for g in WEIGHTS}  # judged against
    if args.part in ("sim", "both", "all"):
        log.info("simulation")
        out["sim"] = run_sim(args, cal, scale)
    if args.part in ("real", "both", "all"):
        out["real"] = run_real(args, loaded, cal, scale, texts)
    if args.part in ("memory", "all"):
        log.info("memory bound")
        out["memory"] = run_memory(args, loaded)
    out["load_average_end"] = os.getloadavg()
    out["summary"] = summary_line(out)
    doc = _jsonable(out)
    text = json.dumps(doc, indent=2)
    print(text)
    print(out["summary"], file=sys.stderr)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return doc


def _check_slo_scale(value: str) -> None:
    """Fail before loading the model: 'auto' or a positive number."""
    if value == "auto":
        return
    try:
        ok = math.isfinite(float(value)) and float(value) > 0
    except ValueError:
        ok = False
    if not ok:
        raise SystemExit(f"--slo-scale must be 'auto' or a number > 0, got {value!r}")


def summary_line(out: Mapping[str, Any]) -> str:
    """One line: the SLOs judged against (and any scaling of them, loudly), then the headline
    figures of each part that ran."""
    scale = out["slo_scale"]
    slos = ", ".join(f"{g} {s:g} s" for g, s in out["slo_s"].items())
    if scale == 1:
        parts = [f"SLOs as configured ({slos})"]
    else:
        parts = [f"SLOs SCALED x{scale:.2f} by --slo-scale ({slos}; configured: x1)"]
    sim = out.get("sim")
    if sim:
        lv, lf = sim["light_vtc"], sim["light_fcfs"]
        parts.append(
            f"sim: Jain VTC {sim['jain_vtc']:.4f} / FCFS {sim['jain_fcfs']:.4f}, "
            f"{LIGHT} P99 {lv['p99_s']:.2f} s / {lf['p99_s']:.2f} s, "
            f"windows meeting its SLO {_share(lv['windows_p99_met'])} / "
            f"{_share(lf['windows_p99_met'])}"
        )
    for arm, r in (out.get("real") or {}).get("arms", {}).items():
        parts.append(
            f"real {arm}: Jain {r['jain_index']:.4f}, {LIGHT} P99 {r['light']['p99_s']:.2f} s, "
            f"windows meeting its SLO {_share(r['light']['windows_p99_met'])}, "
            f"OK after deadline {r['ok_after_deadline']}"
        )
    mem = out.get("memory")
    if mem:
        parts.append(
            f"memory: max in flight {mem['max_in_flight_seen']} (high water {mem['high_water']})"
        )
    return "fairness: " + " | ".join(parts)


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


if __name__ == "__main__":
    main(sys.argv[1:])
