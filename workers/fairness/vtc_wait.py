"""A request's queue wait in VTC order: how much work the fair-share queue serves before it.

Deadline admission (workers.serving.admission) refuses at submission a request whose
predicted wait + service passes its deadline. The wait must be the wait *in the order the
queue serves*, not in the order requests arrived: under one language's overload VTC serves a
light language (below its weighted share) next, so the light request waits about one free batch
slot however deep the heavy backlog is, while the heavy language's request waits behind its own
backlog at its share of the engine. Estimating every language's wait from the whole backlog
turns the light language away with the heavy one (issue 25: English 17 of 31 REJECTED, "queue
~57 s", while German flooded the worker).

The model (pure arithmetic over a frozen description of the queue, `QueueState`):

- VTC picks the backlogged group with the smallest virtual counter; a pick charges the group
  cost / weight (cost: uncached prompt tokens + 2 x output tokens, workers.fairness.vtc). Taking
  a request's whole cost at the pick (the queue charges output tokens as they are decoded) makes
  the order a merge of per-group counter sequences: the j-th waiting request of group h is
  picked at counter `c_h + j * cost_h / w_h`.
- The new request r of group G goes behind G's own backlog (all of it: the engine's deadlines
  are send time + one timeout per client, so EDF inside a group is about arrival order). If G
  has nothing waiting, pushing r lifts G's counter as `VTCQueue._lift` does:
  `max(c_G, floor - burst_tokens / w_G)`, the floor being the smallest backlogged counter (or,
  with nothing backlogged, the counter of the group that left last). So r is picked at
  `c* = c_G' + depth_G * cost_G / w_G`.
- Of another group h, the requests picked before r are those whose pick counter comes before
  c*: `ceil(x)` of them with `x = (c* - c_h) * w_h / cost_h`, `floor(x) + 1` when h wins a tie
  (VTC breaks equal counters by group name), at most `depth_h`, none when x < 0.
- Work ahead = G's backlog + those requests, in weighted tokens; the wait is that work divided
  by the measured service rate (weighted tokens admitted per second), plus one service slot
  (one mean request) for the running batch to make room: something waiting means the scheduler
  could not admit it, so the batch is full. Nothing waiting: no wait.

What it leaves out, knowingly: requests of other groups that *arrive* during the wait and
cut in (a light language keeps cutting ahead of a heavy one: the heavy estimate errs short by
the light language's load, a few percent at a tenth of its share, and a request admitted
that way is EXPIRED at admission before any prefill); the discreteness of output charges; and
EDF reordering inside a group. With an FCFS queue everything waiting is ahead (`fcfs_wait`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["GroupState", "QueueState", "WaitEstimate", "fcfs_wait", "vtc_wait"]


@dataclass(frozen=True, slots=True)
class GroupState:
    """One group (language) of the waiting queue."""

    depth: int  # requests waiting
    counter: float  # VTC virtual counter
    weight: float  # fair-share weight
    mean_cost: float  # weighted tokens of one of its requests (uncached prompt + 2 x output)


@dataclass(frozen=True, slots=True)
class QueueState:
    """What the estimate needs of the queue, at one instant."""

    groups: Mapping[str, GroupState]  # every group seen so far (missing: nothing waits)
    idle_floor: float = 0.0  # lift floor when nothing is backlogged (the last group to leave)
    burst_tokens: float = 0.0  # VTCQueue.burst_tokens
    service_rate: float = 0.0  # weighted tokens admitted per second (0: not measured yet)
    slot_cost: float = 0.0  # weighted tokens of a mean request: one service slot


@dataclass(frozen=True, slots=True)
class WaitEstimate:
    wait_s: float  # predicted seconds from now to admission
    work_ahead: float  # weighted tokens served before the request (its own group's included)
    ahead: Mapping[str, int] = field(default_factory=dict)  # requests ahead, per group
    pick_counter: float = math.nan  # the group's counter when the request is picked
    queued: int = 0  # requests waiting in the queue, all groups


def _lifted_counter(q: QueueState, group: str, own: GroupState) -> float:
    """`VTCQueue._lift`: the counter a group gets when it goes from empty to backlogged."""
    backlogged = [g.counter for g in q.groups.values() if g.depth > 0]
    floor = min(backlogged) if backlogged else q.idle_floor
    return max(own.counter, floor - q.burst_tokens / own.weight)


def _picked_before(h: str, state: GroupState, group: str, pick_counter: float) -> int:
    """How many of h's waiting requests VTC picks before `group`'s request at `pick_counter`."""
    if state.depth <= 0:
        return 0
    gap = pick_counter - state.counter
    if gap < 0 or (gap == 0 and h > group):
        return 0
    if state.mean_cost <= 0:
        return state.depth  # free requests: all of them come first
    x = gap * state.weight / state.mean_cost
    n = math.floor(x) + 1 if h < group else math.ceil(x)  # ties go to the smaller name
    return min(state.depth, n)


def _wait(q: QueueState, work: float) -> float:
    if q.service_rate <= 0:
        return 0.0  # no admission measured yet: unknown, the admission-time check decides
    return (work + q.slot_cost) / q.service_rate


def vtc_wait(q: QueueState, group: str, own: GroupState | None = None) -> WaitEstimate:
    """The wait of a request of `group` pushed now into a VTC queue (see the module notes).

    `own` describes `group` when the queue has not seen it (depth 0, counter 0 and the
    caller's weight and cost); a group in `q.groups` uses that entry.
    """
    me = q.groups.get(group) or own or GroupState(0, 0.0, 1.0, q.slot_cost)
    queued = sum(max(0, g.depth) for g in q.groups.values())
    if not queued:
        return WaitEstimate(0.0, 0.0, {}, _lifted_counter(q, group, me))
    start = me.counter if me.depth > 0 else _lifted_counter(q, group, me)
    pick = start + me.depth * me.mean_cost / me.weight
    ahead = {group: me.depth} if me.depth else {}
    work = me.depth * me.mean_cost
    for h, state in q.groups.items():
        if h == group:
            continue
        n = _picked_before(h, state, group, pick)
        if n:
            ahead[h] = n
            work += n * state.mean_cost
    return WaitEstimate(_wait(q, work), work, ahead, pick, queued)


def fcfs_wait(q: QueueState) -> WaitEstimate:
    """The wait behind everything waiting (an FCFS queue)."""
    ahead = {g: s.depth for g, s in q.groups.items() if s.depth > 0}
    if not ahead:
        return WaitEstimate(0.0, 0.0, {})
    work = sum(s.depth * s.mean_cost for s in q.groups.values() if s.depth > 0)
    return WaitEstimate(_wait(q, work), work, ahead, queued=sum(ahead.values()))
