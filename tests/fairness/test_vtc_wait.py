"""vtc_wait / fcfs_wait: a request's wait in the order the queue serves, on hand-made queues.

Exact numbers on tiny queues, then a check against the real `VTCQueue`: the requests the
estimate puts ahead are the ones the queue pops first when each pop is charged its cost.
"""

from __future__ import annotations

import random

import pytest

from workers.engine.types import GenerationRequest, SamplingParams
from workers.fairness.vtc import VTCQueue
from workers.fairness.vtc_wait import GroupState, QueueState, fcfs_wait, vtc_wait

COST = 50.0  # weighted tokens per request
RATE = 100.0  # weighted tokens per second: one service slot = 0.5 s
SLOT_S = COST / RATE


def state(groups: dict[str, GroupState], **kw: float) -> QueueState:
    return QueueState(groups, service_rate=RATE, slot_cost=COST, **kw)


def test_light_language_behind_a_heavy_backlog_waits_one_slot_not_fifty() -> None:
    q = state({"de": GroupState(50, 1000.0, 1.0, COST)}, burst_tokens=256.0)
    light = vtc_wait(q, "it", GroupState(0, 0.0, 1.0, COST))
    assert light.ahead == {}  # lifted to 1000 - 256: before every German request
    assert light.pick_counter == pytest.approx(1000.0 - 256.0)
    assert light.wait_s == pytest.approx(SLOT_S)  # the full batch must free one slot
    heavy = vtc_wait(q, "de")
    assert heavy.ahead == {"de": 50}
    assert heavy.wait_s == pytest.approx(51 * SLOT_S)
    # the old estimate, the whole backlog at the engine's rate: 50 slots for both
    assert fcfs_wait(q).wait_s == pytest.approx(51 * SLOT_S)


def test_without_burst_credit_a_tie_goes_to_the_smaller_group_name() -> None:
    q = state({"de": GroupState(50, 100.0, 1.0, COST)})
    # "en" is lifted to de's counter: de wins the tie, so one German request goes first
    assert vtc_wait(q, "en").ahead == {"de": 1}
    assert vtc_wait(q, "en").wait_s == pytest.approx(2 * SLOT_S)
    # "ar" wins the tie itself
    assert vtc_wait(q, "ar").ahead == {}


def test_weights_split_the_other_backlog_by_counter_distance() -> None:
    q = state(
        {
            "de": GroupState(20, 100.0, 4.0, COST),  # 12.5 counter per request
            "it": GroupState(2, 90.0, 1.0, COST),  # 50 per request
        }
    )
    est = vtc_wait(q, "it")
    # it's new request is picked at 90 + 2 * 50 = 190; German picks at 100 + 12.5 j come
    # before 190 for j <= 7.2, and "de" < "it" wins a tie: 8 German requests
    assert est.pick_counter == pytest.approx(190.0)
    assert est.ahead == {"it": 2, "de": 8}
    assert est.work_ahead == pytest.approx(10 * COST)
    assert est.wait_s == pytest.approx(11 * SLOT_S)
    assert est.queued == 22
    # German's new request: picked at 100 + 20 * 12.5 = 350; Italian picks at 90 + 50 j < 350
    # for j <= 5.2, but only 2 wait
    assert vtc_wait(q, "de").ahead == {"de": 20, "it": 2}


def test_a_group_over_its_share_keeps_its_counter() -> None:
    """The lift never lowers a counter: a language that took more than its share recently
    waits for the others to catch up, burst credit or not."""
    q = state({"de": GroupState(10, 100.0, 1.0, COST)}, burst_tokens=256.0)
    est = vtc_wait(q, "en", GroupState(0, 300.0, 1.0, COST))
    assert est.pick_counter == 300.0
    assert est.ahead == {"de": 5}  # 100 + 50 j <= 300 for j <= 4 ("de" wins the tie at 4)


def test_nothing_waiting_means_no_wait_and_no_rate_means_unknown() -> None:
    idle = state({"de": GroupState(0, 100.0, 1.0, COST)}, idle_floor=100.0)
    est = vtc_wait(idle, "it")
    assert est.wait_s == 0.0 and est.queued == 0
    assert est.pick_counter == 100.0  # the idle floor: the counter of the last to leave
    unmeasured = QueueState({"de": GroupState(5, 0.0, 1.0, COST)}, slot_cost=COST)
    assert vtc_wait(unmeasured, "de").wait_s == 0.0
    assert fcfs_wait(unmeasured).wait_s == 0.0


def test_fcfs_counts_everything_waiting() -> None:
    q = state({"de": GroupState(3, 0.0, 4.0, COST), "it": GroupState(1, 0.0, 1.0, 2 * COST)})
    est = fcfs_wait(q)
    assert est.ahead == {"de": 3, "it": 1}
    assert est.work_ahead == pytest.approx(5 * COST)
    assert est.wait_s == pytest.approx(6 * SLOT_S)


def _req(rid: str, group: str) -> GenerationRequest:
    return GenerationRequest(rid, [1], SamplingParams(max_new_tokens=1), group=group, arrival=0.0)


@pytest.mark.parametrize("seed", range(20))
def test_ahead_matches_the_real_vtc_queue(seed: int) -> None:
    """Random weights, counters, depths, costs and burst credit: pop the real queue, charging
    each pop its group's cost, and count what comes out before the new request."""
    rng = random.Random(seed)
    groups = ["de", "en", "fr", "it"][: rng.randint(2, 4)]
    weights = {g: float(rng.choice([1, 2, 3, 4])) for g in groups}
    costs = {g: float(rng.randint(20, 120)) for g in groups}
    q = VTCQueue(weights, burst_tokens=float(rng.choice([0, 64, 256])))
    depths = {g: rng.choice([0, 0, 1, 3, 8]) for g in groups}
    for g in groups:  # give each group some past service (a counter), then its backlog
        q.push(_req(f"{g}-warm", g))
        q.remove(f"{g}-warm")
        q.charge(_req("x", g), rng.randint(0, 400), 0)
    for g in groups:
        for i in range(depths[g]):
            q.push(_req(f"{g}-{i}", g))
    new = rng.choice(groups)
    snapshot = QueueState(
        {g: GroupState(depths[g], q.counters()[g], weights[g], costs[g]) for g in groups},
        idle_floor=q.idle_floor(),
        burst_tokens=q.burst_tokens,
        service_rate=RATE,
        slot_cost=COST,
    )
    est = vtc_wait(snapshot, new)
    q.push(_req("new", new))
    popped: dict[str, int] = {}
    while True:
        r = q.pop()
        if r.request_id == "new":
            break
        popped[r.group] = popped.get(r.group, 0) + 1
        q.charge(r, int(costs[r.group]), 0)
    assert est.ahead == popped
