"""Issue 25 in the simulator: the worker's deadline admission under one language's overload.

The engine's real scheduler and the worker's real `EngineAdmission` (precheck at submission,
the scheduler's hook, learning on finish) on a simulated clock. German offers 3x what the
engine serves, Italian a tenth of its weighted share. On the admission before the VTC-order
wait (commit 97ca15c) the first case lost 2 of 30 Italian requests to REJECTED (goodput 0.93:
each request of a group of 6 was charged the whole group at Italian's 1/5 share), and the
second locked up (the latency model refused everything, German 0 OK, Italian 13 of 28).
"""

from __future__ import annotations

import dataclasses

import pytest

from workers.serving.sim_admission import overload_scenario
from workers.serving.sim_config import LanguageLoad, SimConfig
from workers.serving.simulate import simulate


def _check_light_admitted_heavy_shed(**kw: object) -> None:
    cfg = overload_scenario(light="it", duration_s=300.0, **kw)  # type: ignore[arg-type]
    res = simulate(cfg)
    it, de = res.languages["it"], res.languages["de"]
    assert it.arrived >= 25
    assert it.rejected == 0
    assert it.goodput >= 0.99
    assert it.latency_p99_s <= it.slo_s  # 6 s
    # German is shed: most of it refused at submission, and the engine still serves at its
    # capacity (no lock-up: ~5.6 requests/s finish in the window)
    assert de.rejected > 0.5 * de.arrived
    assert res.completed_rps > 4.5


def test_light_language_in_groups_is_admitted_while_the_heavy_one_is_shed() -> None:
    _check_light_admitted_heavy_shed(light_group=6, max_batch=8, seed=0)


@pytest.mark.slow
def test_no_lock_up_of_the_latency_model_at_a_larger_batch() -> None:
    _check_light_admitted_heavy_shed(light_group=4, max_batch=16, seed=1)


def test_group_arrivals_come_together() -> None:
    cfg = SimConfig(
        languages={"de": LanguageLoad(rate_rps=3.0, group_size=3)},
        duration_s=20.0,
        warmup_s=0.0,
    )
    res = simulate(cfg)
    de = res.languages["de"]
    assert de.arrived % 3 == 0 and 30 <= de.arrived <= 90  # ~60 requests, 20 groups of 3


def test_admission_off_keeps_the_simulation_as_it_was() -> None:
    on = overload_scenario(light="it", duration_s=40.0, warmup_s=5.0)
    off = simulate(dataclasses.replace(on, admission=False))
    res = simulate(on)
    assert off.languages["de"].rejected == 0  # no precheck without admission
    assert res.languages["de"].rejected > 0
