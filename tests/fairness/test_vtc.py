"""VTC and FCFS waiting queues: exact admission orders, written out by hand."""

from __future__ import annotations

import pytest

from workers.engine.types import GenerationRequest, RequestQueue
from workers.fairness.policy import LanguagePolicy
from workers.fairness.vtc import FCFSQueue, VTCQueue, jain_index, service_cost


def req(
    rid: str, group: str, arrival: float = 0.0, deadline: float | None = None
) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid, prompt_ids=[1, 2, 3], group=group, deadline=deadline, arrival=arrival
    )


def drain(q: VTCQueue | FCFSQueue, prefill: int = 0, output: int = 0) -> list[str]:
    """Pop everything, charging each admitted request (prefill, output) right away."""
    order = []
    while len(q):
        peeked = q.peek()
        r = q.pop()
        assert peeked is r
        q.charge(r, prefill, output)
        order.append(r.request_id)
    assert q.peek() is None
    return order


def test_queues_satisfy_the_protocol() -> None:
    queues: list[RequestQueue] = [VTCQueue(), FCFSQueue()]
    assert all(len(q) == 0 for q in queues)


def test_weighted_order_by_hand() -> None:
    # weights a:1, b:2, every admission charged 10 tokens -> a +10, b +5 per request
    q = VTCQueue({"a": 1, "b": 2})
    for i in range(1, 4):
        q.push(req(f"a{i}", "a", arrival=i))
    for i in range(1, 4):
        q.push(req(f"b{i}", "b", arrival=i))
    # counters (a, b): (0,0) tie->a1 (10,0) b1 (10,5) b2 (10,10) tie->a2 (20,10) b3 (20,15) a3
    assert drain(q, prefill=10) == ["a1", "b1", "b2", "a2", "b3", "a3"]
    assert q.counters() == {"a": 30.0, "b": 15.0}
    assert q.service_by_group() == {"a": 30.0, "b": 30.0}
    assert q.service_by_group(normalized=True) == {"a": 30.0, "b": 15.0}


def test_three_groups_ties_broken_by_name() -> None:
    q = VTCQueue()
    for g in ("c", "a", "b"):
        q.push(req(f"{g}1", g))
        q.push(req(f"{g}2", g))
    assert drain(q, output=1) == ["a1", "b1", "c1", "a2", "b2", "c2"]


def test_output_tokens_cost_twice_prompt_tokens() -> None:
    q = VTCQueue({"de": 4.0})
    r = req("x", "de")
    q.push(r)
    q.pop()
    q.charge(r, prefill_tokens=8, output_tokens=6)  # 8 + 2*6 = 20 -> counter 20/4
    assert q.counters()["de"] == pytest.approx(5.0)
    assert q.service_by_group()["de"] == pytest.approx(20.0)
    assert service_cost(8, 6) == 20.0
    with pytest.raises(ValueError):
        q.charge(r, -1, 0)


def test_cached_prefix_is_not_charged_so_the_language_gets_more_requests() -> None:
    # Same weights and prompt lengths (100), but "a" has 80 prompt tokens cached: the engine
    # charges only the 20 uncached ones, so a is admitted 5 times per b admission.
    q = VTCQueue()
    for i in range(1, 7):
        q.push(req(f"a{i}", "a", arrival=i))
    for i in range(1, 3):
        q.push(req(f"b{i}", "b", arrival=i))
    order = []
    while len(q):
        r = q.pop()
        q.charge(r, 20 if r.group == "a" else 100, 0)
        order.append(r.request_id)
    # (a,b): (0,0) a1 (20,0) b1 (20,100) a2 40 a3 60 a4 80 a5 100 tie->a6 120, b2
    assert order == ["a1", "b1", "a2", "a3", "a4", "a5", "a6", "b2"]


def test_counter_lift_to_min_backlogged_after_idle() -> None:
    q = VTCQueue()
    for i in range(1, 5):
        q.push(req(f"a{i}", "a", arrival=i))
    for _ in range(2):
        q.charge(q.pop(), 30, 0)  # a1, a2 served while b is idle: a = 60
    assert q.counters() == {"a": 60.0}
    q.push(req("b1", "b", arrival=10))
    q.push(req("b2", "b", arrival=11))
    q.push(req("b3", "b", arrival=12))
    assert q.counters()["b"] == 60.0  # lifted: no credit banked while idle
    # (a,b): (60,60) tie->a3 (90,60) b1 (90,90) tie->a4 (120,90) b2 (120,120) b3
    assert drain(q, prefill=30) == ["a3", "b1", "a4", "b2", "b3"]


def test_burst_credit_lets_a_returning_group_go_ahead_by_burst_tokens() -> None:
    # weights a:1, b:2; burst 60 tokens. a is backlogged and served up to counter 100.
    q = VTCQueue({"a": 1.0, "b": 2.0}, burst_tokens=60)
    for i in range(1, 4):
        q.push(req(f"a{i}", "a", arrival=i))
    q.charge(q.pop(), 100, 0)  # a1: a = 100
    q.push(req("b1", "b", arrival=10))
    q.push(req("b2", "b", arrival=11))
    q.push(req("b3", "b", arrival=12))
    # b lifted to 100 - 60 / 2 = 70, not to 100: 60 weighted tokens of credit
    assert q.counters()["b"] == 70.0
    # every admission charged 20 tokens: b +10, a +20
    # (a,b): (100,70) b1 (100,80) b2 (100,90) b3 (100,100) -> a2, a3
    assert drain(q, prefill=20) == ["b1", "b2", "b3", "a2", "a3"]
    # the credit bought b exactly 60 tokens of service ahead of its weighted share
    assert q.service_by_group()["b"] == 60.0


def test_burst_credit_is_only_unused_share_of_an_idle_group() -> None:
    # The credit lowers the lift's floor, never a counter: a group that was served up to or
    # beyond the floor (it was not idle long) gets no credit, and the order stays the paper's.
    orders = []
    for burst in (0.0, 1000.0):
        q = VTCQueue({"a": 1.0, "b": 1.0}, burst_tokens=burst)
        for i in range(1, 4):
            q.push(req(f"a{i}", "a", arrival=i))
            q.push(req(f"b{i}", "b", arrival=i))
        assert q.counters() == {"a": 0.0, "b": 0.0}
        order = drain(q, prefill=10)  # both idle now, counters 30 / 30
        q.push(req("b4", "b", arrival=4))  # floor 30 - 1000: b keeps its own 30
        assert q.counters()["b"] == 30.0
        orders.append(order)
    assert orders[0] == orders[1] == ["a1", "b1", "a2", "b2", "a3", "b3"]
    with pytest.raises(ValueError):
        VTCQueue(burst_tokens=-1)


def test_lift_never_lowers_a_counter() -> None:
    q = VTCQueue()
    q.push(req("b1", "b"))
    q.charge(q.pop(), 500, 0)  # b = 500, now idle
    q.push(req("a1", "a"))  # a lifted to b's (last to leave) 500
    q.push(req("a2", "a"))
    q.charge(q.pop(), 10, 0)  # a1: a = 510
    q.push(req("b2", "b"))  # min over backlogged {a} is 510 > 500: b lifted to 510
    assert q.counters() == {"a": 510.0, "b": 510.0}
    q.push(req("c1", "c"))  # lifted to 510 too
    q.charge(q.pop(), 1000, 0)  # three-way tie at 510 -> a2 by name; a = 1510
    assert [q.pop().request_id, q.pop().request_id] == ["b2", "c1"]
    q.push(req("a3", "a"))  # queue empty; last to leave was c (510): a stays 1510
    assert q.counters()["a"] == 1510.0


def test_lift_when_queue_empty_uses_last_group_to_leave() -> None:
    q = VTCQueue()
    q.push(req("a1", "a"))
    q.charge(q.pop(), 40, 0)
    q.push(req("b1", "b"))  # nobody backlogged; a left last with 40
    assert q.counters()["b"] == 40.0


def test_edf_inside_a_group() -> None:
    q = VTCQueue()
    q.push(req("none-late", "de", arrival=0.0))
    q.push(req("d10", "de", arrival=1.0, deadline=10.0))
    q.push(req("d5-late", "de", arrival=2.0, deadline=5.0))
    q.push(req("d5-first", "de", arrival=1.5, deadline=5.0))
    q.push(req("d5-second", "de", arrival=1.5, deadline=5.0))  # same key: insertion order
    q.push(req("none-early", "de", arrival=-1.0))
    assert drain(q) == ["d5-first", "d5-second", "d5-late", "d10", "none-early", "none-late"]


def test_remove_and_depths() -> None:
    q = VTCQueue()
    for i in range(1, 4):
        q.push(req(f"a{i}", "a", arrival=i))
    q.push(req("b1", "b"))
    assert q.depths() == {"a": 3, "b": 1}
    assert q.remove("missing") is None
    removed = q.remove("a1")
    assert removed is not None and removed.request_id == "a1"
    assert q.remove("a1") is None
    assert q.remove("b1") is not None
    assert q.backlogged() == {"a"}
    assert len(q) == 2 and q.depths() == {"a": 2, "b": 0}
    assert [r.request_id for r in q] == ["a2", "a3"]
    assert drain(q) == ["a2", "a3"]
    with pytest.raises(IndexError):
        q.pop()


def test_duplicate_ids_and_bad_weights_rejected() -> None:
    q = VTCQueue()
    q.push(req("x", "a"))
    with pytest.raises(ValueError, match="already queued"):
        q.push(req("x", "b"))
    with pytest.raises(ValueError):
        VTCQueue({"a": 0.0})
    with pytest.raises(ValueError):
        VTCQueue(default_weight=-1)


def test_unknown_groups_get_the_default_weight() -> None:
    q = VTCQueue({"de": 4.0}, default_weight=2.0)
    assert q.weight("de") == 4.0 and q.weight("xx") == 2.0
    r = req("x", "xx")
    q.push(r)
    q.charge(q.pop(), 10, 0)
    assert q.counters()["xx"] == 5.0


def test_from_policies_takes_the_weights() -> None:
    policies = {"de": LanguagePolicy(4.0, 2.0, 10, 64), "it": LanguagePolicy(1.0, 6.0, 10, 64)}
    q = VTCQueue.from_policies(policies)
    assert q.weight("de") == 4.0 and q.weight("it") == 1.0 and q.weight("fr") == 1.0


def test_many_removals_compact_without_changing_order() -> None:
    q = VTCQueue()
    for i in range(300):
        q.push(req(f"r{i}", "a", arrival=float(i)))
    for i in range(0, 300, 3):
        q.remove(f"r{i}")
    for i in range(1, 300, 3):
        q.remove(f"r{i}")
    assert drain(q) == [f"r{i}" for i in range(2, 300, 3)]


def test_fcfs_order_and_service_accounting() -> None:
    q = FCFSQueue({"de": 4.0})
    # push order wins, whatever the deadlines and groups
    q.push(req("de1", "de", deadline=50.0))
    q.push(req("it1", "it", deadline=1.0))
    q.push(req("de2", "de"))
    q.push(req("fr1", "fr"))
    q.push(req("it2", "it"))
    assert q.remove("de2") is not None
    assert q.depths() == {"de": 1, "it": 2, "fr": 1}
    assert drain(q, prefill=10, output=5) == ["de1", "it1", "fr1", "it2"]
    assert q.service_by_group() == {"de": 20.0, "it": 40.0, "fr": 20.0}
    assert q.counters() == {"de": 5.0, "it": 40.0, "fr": 20.0}
    with pytest.raises(IndexError):
        q.pop()


def test_fcfs_removing_the_head() -> None:
    q = FCFSQueue()
    for i in range(200):
        q.push(req(f"r{i}", "a"))
    for i in range(150):
        q.remove(f"r{i}")
    peeked = q.peek()
    assert peeked is not None and peeked.request_id == "r150"
    assert len(q) == 50


def test_jain_index() -> None:
    assert jain_index([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain_index([1.0, 2.0]) == pytest.approx(9 / 10)
    assert jain_index([]) == 1.0
    assert jain_index([0.0, 0.0]) == 1.0
    with pytest.raises(ValueError):
        jain_index([-1.0, 1.0])
