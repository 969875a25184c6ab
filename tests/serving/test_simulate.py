"""The batching simulation: weighted shares under overload, light-language latency, sanity."""

from __future__ import annotations

import dataclasses
import json

import pytest

from workers.fairness.vtc import FCFSQueue, VTCQueue
from workers.serving.sim_config import (
    CostModel,
    LanguageLoad,
    ScriptedArrival,
    SimConfig,
    estimate_capacity_rps,
    issue_scenario,
)
from workers.serving.simulate import simulate

CAP = estimate_capacity_rps(80, 30)  # defaults: prompts 60-100, outputs 20-40


def overloaded(queue: str, weights: dict[str, float], duration_s: float = 600.0) -> SimConfig:
    return SimConfig(
        languages={g: LanguageLoad(rate_rps=CAP, weight=w) for g, w in weights.items()},
        queue=queue,
        duration_s=duration_s,
        warmup_s=30.0,
    )


def test_weights_1_2_3_4_give_service_1_2_3_4_under_overload() -> None:
    weights = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}  # each offers 1x capacity: 4x overload
    res = simulate(overloaded("vtc", weights))
    assert res.backlogged == ["a", "b", "c", "d"]
    base = res.languages["a"].service
    for g, w in weights.items():
        assert res.languages[g].service / base == pytest.approx(w, rel=0.05), g
    assert res.jain_index > 0.99
    # FCFS serves by arrival, so equal rates get equal service: far from 1:2:3:4
    fcfs = simulate(overloaded("fcfs", weights))
    assert fcfs.languages["d"].service / fcfs.languages["a"].service < 1.5
    assert fcfs.jain_index < 0.85
    # same engine, same work: the policy costs no throughput
    assert res.throughput_tokens_s == pytest.approx(fcfs.throughput_tokens_s, rel=0.02)


def test_light_language_latency_much_lower_under_vtc() -> None:
    vtc = simulate(issue_scenario("vtc"))
    fcfs = simulate(issue_scenario("fcfs"))
    assert vtc.backlogged == ["de", "es", "fr"]  # Italian is light under VTC
    it_vtc, it_fcfs = vtc.languages["it"], fcfs.languages["it"]
    assert it_vtc.latency_p99_s < 0.25 * it_fcfs.latency_p99_s
    assert it_vtc.queue_p50_s < 0.05 * it_fcfs.queue_p50_s
    assert it_vtc.unfinished <= 0.2 * it_vtc.arrived
    # the backlogged languages share by weight 4:3:2 under VTC
    assert vtc.jain_index > 0.99
    assert vtc.languages["de"].service / vtc.languages["es"].service == pytest.approx(2, rel=0.05)
    assert fcfs.jain_index < 0.9
    assert vtc.throughput_tokens_s == pytest.approx(fcfs.throughput_tokens_s, rel=0.02)


def test_light_language_meets_slo_with_a_fast_engine() -> None:
    # GPU-like constants: a step is ~20 ms, so a request's own service time is well under SLO
    cost = CostModel(step_base_s=0.01, prefill_s_per_token=0.00002, batch_s_per_seq=0.0002)
    vtc = simulate(issue_scenario("vtc", cost=cost, duration_s=120, warmup_s=20))
    fcfs = simulate(issue_scenario("fcfs", cost=cost, duration_s=120, warmup_s=20))
    assert vtc.languages["it"].slo_attainment >= 0.99
    assert vtc.languages["it"].latency_p99_s < vtc.languages["it"].slo_s
    assert fcfs.languages["it"].slo_attainment < 0.5


def test_deterministic_and_json_ready() -> None:
    cfg = issue_scenario("vtc", duration_s=120, warmup_s=10, seed=3)
    a, b = simulate(cfg), simulate(cfg)
    assert a == b
    blob = json.dumps(a.to_dict(), allow_nan=False)
    assert '"jain_index"' in blob
    c = simulate(dataclasses.replace(cfg, seed=4))
    assert c.languages["de"].arrived != a.languages["de"].arrived


def test_accepts_a_queue_instance() -> None:
    cfg = overloaded("vtc", {"a": 1.0, "b": 3.0}, duration_s=120)
    res = simulate(cfg, VTCQueue({"a": 1.0, "b": 3.0}))
    assert res.queue == "VTCQueue"
    assert res.languages["b"].service / res.languages["a"].service == pytest.approx(3, rel=0.1)
    assert simulate(cfg, FCFSQueue()).queue == "FCFSQueue"


def test_cached_prefix_is_not_charged_so_that_language_gets_more_requests() -> None:
    # equal weights, equal prompts, but "a" has 60 of its 60-100 prompt tokens cached
    langs = {
        "a": LanguageLoad(rate_rps=2 * CAP, cached_prefix_tokens=60),
        "b": LanguageLoad(rate_rps=2 * CAP),
    }
    res = simulate(SimConfig(languages=langs, duration_s=300.0))
    a, b = res.languages["a"], res.languages["b"]
    assert a.service == pytest.approx(b.service, rel=0.05)  # equal charged service...
    assert a.output_tokens > 1.5 * b.output_tokens  # ...buys a more translations


def test_light_load_is_served_without_backlog() -> None:
    langs = {"de": LanguageLoad(rate_rps=0.2 * CAP), "it": LanguageLoad(rate_rps=0.1 * CAP)}
    res = simulate(SimConfig(languages=langs, duration_s=200.0, drain_s=60.0))
    assert res.backlogged == []
    for lang in langs:
        r = res.languages[lang]
        assert r.unfinished == 0 and r.completed == r.arrived > 0
    assert res.jain_index == 1.0  # nobody backlogged: nothing to be unfair about


def test_drop_expired_drops_before_prefill() -> None:
    cfg = dataclasses.replace(
        issue_scenario("fcfs", duration_s=120, warmup_s=10), drop_expired=True
    )
    res = simulate(cfg)
    assert sum(r.expired for r in res.languages.values()) > 0
    assert all(0.0 <= r.slo_attainment <= 1.0 for r in res.languages.values())


def test_bad_configs() -> None:
    with pytest.raises(ValueError):
        simulate(dataclasses.replace(overloaded("vtc", {"a": 1}), token_budget=8, max_batch=32))
    with pytest.raises(ValueError):
        simulate(dataclasses.replace(overloaded("vtc", {"a": 1}), warmup_s=1e9))
    with pytest.raises(ValueError, match="unknown queue kind"):
        simulate(overloaded("lifo", {"a": 1}))


def test_a_small_kv_pool_preempts_and_one_too_small_is_an_error() -> None:
    langs = {"a": LanguageLoad(rate_rps=3 * CAP, cached_prefix_tokens=40)}  # overloaded
    roomy = simulate(SimConfig(languages=langs, duration_s=60.0, warmup_s=5.0))
    assert roomy.preemptions == 0
    # 32 sequences of up to 100 + 40 tokens need ~290 blocks; 96 blocks force preemptions
    tight = simulate(
        SimConfig(languages=langs, duration_s=60.0, warmup_s=5.0, kv_cache_tokens=1536)
    )
    assert tight.preemptions > 0
    assert tight.languages["a"].output_tokens < roomy.languages["a"].output_tokens
    with pytest.raises(ValueError, match="kv_cache_tokens"):  # not even one request fits
        simulate(SimConfig(languages=langs, duration_s=60.0, warmup_s=5.0, kv_cache_tokens=64))


def test_scripted_arrivals_join_the_poisson_ones() -> None:
    langs = {"a": LanguageLoad(rate_rps=0.0), "b": LanguageLoad(rate_rps=0.0)}
    script = (ScriptedArrival(1.0, "a", 50, 10), ScriptedArrival(2.0, "b", 30, 5, "mine"))
    res = simulate(SimConfig(languages=langs, duration_s=30.0, warmup_s=0.0, scripted=script))
    assert res.languages["a"].completed == res.languages["b"].completed == 1
    assert res.languages["a"].output_tokens == 10 and res.languages["b"].output_tokens == 5
    bad = (ScriptedArrival(1.0, "zz", 50, 10),)
    with pytest.raises(ValueError, match="'zz' has no LanguageLoad"):
        simulate(SimConfig(languages=langs, duration_s=30.0, scripted=bad, warmup_s=0.0))
