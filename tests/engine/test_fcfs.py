"""The engine's default waiting queue (workers/engine/fcfs.py): arrival order, cancels, errors."""

from __future__ import annotations

import pytest

from workers.engine.fcfs import FCFSRequestQueue
from workers.engine.types import GenerationRequest


def req(rid: str, group: str = "") -> GenerationRequest:
    return GenerationRequest(rid, [1, 2, 3], group=group)


def drain(q: FCFSRequestQueue) -> list[str]:
    out = []
    while q.peek() is not None:
        out.append(q.pop().request_id)
    return out


def test_admits_in_push_order_whatever_the_group() -> None:
    q = FCFSRequestQueue()
    for rid, group in [("a", "it"), ("b", "de"), ("c", "it"), ("d", "")]:
        q.push(req(rid, group))
    q.charge(req("a", "it"), 100, 5)  # no ledger: changes nothing
    assert len(q) == 4 and [r.request_id for r in q] == ["a", "b", "c", "d"]
    assert drain(q) == ["a", "b", "c", "d"]
    assert len(q) == 0 and q.peek() is None


def test_remove_skips_the_request_and_a_repush_goes_to_the_back() -> None:
    q = FCFSRequestQueue()
    for rid in "abc":
        q.push(req(rid))
    removed = q.remove("a")
    assert removed is not None and removed.request_id == "a"
    assert q.remove("a") is None and q.remove("zz") is None
    head = q.peek()
    assert len(q) == 2 and head is not None and head.request_id == "b"
    q.push(req("a"))  # the same id again: queued at the back, not at its old place
    assert drain(q) == ["b", "c", "a"]


def test_many_removals_stay_bounded() -> None:
    q = FCFSRequestQueue()
    for i in range(200):
        q.push(req(str(i)))
    for i in range(0, 199):
        q.remove(str(i))
    assert len(q) == 1 and len(q._fifo) < 100  # compacted, not 200 dead entries
    assert drain(q) == ["199"]


def test_errors() -> None:
    q = FCFSRequestQueue()
    with pytest.raises(IndexError):
        q.pop()
    q.push(req("a"))
    with pytest.raises(ValueError, match="already queued"):
        q.push(req("a"))
