"""EngineAdmission: the scheduler hook's decisions, the queue-wait estimate, learning from results.

Pure: a fake clock, no model, no threads except FairEngine's handle plumbing on a fake engine.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from workers.engine.types import (
    AdmissionDecision,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RequestHandle,
    SamplingParams,
    Timings,
)
from workers.fairness.latency_model import LatencyModel, LatencyPrior
from workers.fairness.vtc import FCFSQueue, VTCQueue
from workers.serving.admission import EngineAdmission
from workers.serving.fair_engine import FairEngine

# 0.1 s per request + 10 ms per uncached prompt token + 20 ms per output token
PRIOR = LatencyPrior(
    base_s=0.1,
    prefill_s_per_token=0.01,
    cached_s_per_token=0.0,
    decode_s_per_token=0.02,
    batch_s=0.0,
    decode_s_per_token_per_seq=0.0,
)


def req(
    rid: str,
    group: str = "de",
    deadline: float | None = None,
    prompt: int = 20,
    out: int = 10,
    arrival: float = 0.0,
) -> GenerationRequest:
    return GenerationRequest(
        rid,
        list(range(prompt)),
        SamplingParams(max_new_tokens=out),
        group=group,
        deadline=deadline,
        arrival=arrival,
        expected_output_tokens=out,
    )


def result(
    r: GenerationRequest, out: int, total_s: float, queue_s: float = 0.0, cached: int = 0
) -> GenerationResult:
    return GenerationResult(
        r.request_id,
        [1] * out,
        "x",
        FinishReason.STOP,
        tokens_in=len(r.prompt_ids),
        tokens_out=out,
        cached_tokens=cached,
        timings=Timings(queue_s=queue_s, total_s=total_s),
    )


def adm(queue: Any = None, **kw: Any) -> EngineAdmission:
    return EngineAdmission(LatencyModel(PRIOR), queue=queue, margin_s=0.0, margin_ratio=0.0, **kw)


# predicted service of req(prompt=20, out=10) with nothing cached: 0.1 + 0.2 + 0.2 = 0.5 s


def test_no_deadline_is_admitted() -> None:
    d = adm()(req("a"), 100.0, 3, 0)
    assert d == AdmissionDecision(True, None, d.reason)
    assert d.admit


def test_expired_rejected_admitted_by_deadline() -> None:
    a = adm()
    late = a(req("late", deadline=9.0), 10.0, 0, 0)
    assert not late.admit and late.finish_reason is FinishReason.EXPIRED
    assert "deadline passed" in late.reason
    tight = a(req("tight", deadline=10.4), 10.0, 1, 0)  # needs 0.5 s, has 0.4 s
    assert not tight.admit and tight.finish_reason is FinishReason.REJECTED
    assert "would miss deadline" in tight.reason
    ok = a(req("ok", deadline=10.6), 10.0, 0, 0)
    assert ok.admit and ok.finish_reason is None
    assert a.counts == {
        "admitted": 1,
        "rejected": 1,
        "expired": 1,
        "prechecked": 0,
        "explored": 0,
    }


def test_cached_prefix_shortens_the_prediction() -> None:
    a = adm()
    # 20 prompt tokens, 15 cached: service 0.1 + 0.05 + 0.2 = 0.35 s
    assert not a(req("cold", deadline=10.4), 10.0, 1, 0).admit
    assert a(req("warm", deadline=10.4), 10.0, 1, 15).admit


def test_margins_refuse_borderline_requests() -> None:
    a = EngineAdmission(LatencyModel(PRIOR), margin_s=0.05, margin_ratio=0.1)
    # 0.5 s service + 10% + 50 ms = 0.6 s needed
    assert not a(req("a", deadline=10.55), 10.0, 1, 0).admit
    assert a(req("b", deadline=10.65), 10.0, 1, 0).admit


def _admit_at_rate(a: EngineAdmission, clock: list[float], n: int, every_s: float) -> None:
    """n admissions of req(prompt=20, out=10): weighted cost 20 + 2 * 10 = 40 each."""
    for i in range(n):
        clock[0] = i * every_s
        assert a(req(f"d{i}"), clock[0], 3, 0).admit


def test_queue_wait_is_the_wait_in_vtc_order() -> None:
    """Issue 25: a light language below its share waits one service slot behind a heavy
    backlog, the heavy language its own backlog; the same deadline admits one, sheds the
    other."""
    clock = [0.0]
    q = VTCQueue({"de": 4.0, "it": 1.0}, burst_tokens=256.0)
    a = adm(queue=q, clock=lambda: clock[0])
    _admit_at_rate(a, clock, 40, 0.25)  # 4 req/s of cost 40: one slot = 0.25 s
    clock[0] = 10.0
    assert a.queue_wait_estimate("it") == 0.0  # nothing waits: a slot is free
    for i in range(50):
        q.push(req(f"w{i}", "de"))
    q.charge(req("served", "de"), 1000, 0)  # German has been served: counter 1000 / 4 = 250
    light = a.wait_estimate("it")
    assert light.ahead == {}  # lifted to max(0, 250 - 256): before every German request
    assert light.wait_s == pytest.approx(0.25)  # one slot, not 50
    heavy = a.wait_estimate("de")
    assert heavy.ahead == {"de": 50}
    assert heavy.wait_s == pytest.approx(51 * 0.25)
    # 3 s left: the light request (0.25 s + 0.5 s of service) fits, the heavy one does not
    assert a.precheck(req("light", "it", deadline=13.0)).admit
    shed = a.precheck(req("heavy", "de", deadline=13.0))
    assert not shed.admit and shed.finish_reason is FinishReason.REJECTED
    assert "queue 12.750s" in shed.reason


def test_queue_wait_counts_the_other_group_up_to_its_counter() -> None:
    clock = [0.0]
    q = VTCQueue({"de": 3.0, "it": 1.0})  # no burst credit: it ties with German on arrival
    a = adm(queue=q, clock=lambda: clock[0])
    _admit_at_rate(a, clock, 40, 0.25)
    clock[0] = 10.0
    for i in range(8):
        q.push(req(f"w{i}", "de"))
    for i in range(4):
        q.push(req(f"i{i}", "it"))
    # it's new request is picked at counter 4 * 40 / 1 = 160; German picks at 40 / 3 * j:
    # all 8 come first -> 4 + 8 ahead + one slot
    assert a.wait_estimate("it").ahead == {"it": 4, "de": 8}
    assert a.queue_wait_estimate("it") == pytest.approx(13 * 0.25)
    # German's is picked at 8 * 40 / 3 = 106.7: Italian picks at 0, 40, 80 come first
    assert a.wait_estimate("de").ahead == {"de": 8, "it": 3}
    assert a.queue_wait_estimate("de") == pytest.approx(12 * 0.25)


def test_queue_wait_estimate_fcfs_counts_the_whole_queue() -> None:
    clock = [0.0]
    q = FCFSQueue()
    a = adm(queue=q, clock=lambda: clock[0])
    for i in range(20):
        clock[0] = i * 0.5
        a(req(f"a{i}"), clock[0], 1, 0)
    clock[0] = 10.0
    for i in range(6):
        q.push(req(f"w{i}", "es"))
    assert a.queue_wait_estimate("it") == pytest.approx(7 / 2.0, rel=0.1)  # 2 req/s


def _slow_fit(**kw: Any) -> EngineAdmission:
    """An EngineAdmission whose model was fitted on full batches that took 3 s per request."""
    model = LatencyModel(PRIOR, min_samples=8, refit_every=8)
    for i in range(8):
        model.observe(20, 10 + i % 3, 8, 0, 3.0)
    assert model.fitted
    return EngineAdmission(model, margin_s=0.0, margin_ratio=0.0, **kw)


def test_an_idle_engine_admits_what_only_the_fitted_model_would_refuse() -> None:
    """A model fitted on full batches may predict seconds for a request served alone in a
    fraction of one; refusing on it would stop all learning (the simulator's lock-up). The
    prior (0.5 s for this request) decides at an idle engine."""
    a = _slow_fit(queue=VTCQueue(), clock=lambda: 10.0)
    assert a.model.predict(20, 10, 1) > 2.0
    # 1 s left: refused while the engine is busy, admitted when it is idle
    assert not a(req("busy", deadline=11.0), 10.0, 2, 0).admit
    idle = a(req("idle", deadline=11.0), 10.0, 0, 0)
    assert idle.admit and "idle engine" in idle.reason
    assert a.counts["explored"] == 1
    # 0.4 s left: not even the prior fits it; a passed deadline stays EXPIRED
    assert not a(req("hopeless", deadline=10.4), 10.0, 0, 0).admit
    assert a(req("late", deadline=9.0), 10.0, 0, 0).finish_reason is FinishReason.EXPIRED
    # the precheck: idle = nothing admitted and unobserved, nothing waiting
    b = _slow_fit(queue=VTCQueue(), clock=lambda: 10.0)
    assert b.precheck(req("p", deadline=11.0)).admit
    assert not b.precheck(req("p-hopeless", deadline=10.4)).admit
    assert b(req("running", deadline=20.0), 10.0, 0, 0).admit  # now one is in the engine
    assert not b.precheck(req("q", deadline=11.0)).admit
    off = _slow_fit(queue=VTCQueue(), explore=False)
    assert not off(req("x", deadline=11.0), 10.0, 0, 0).admit


def test_no_rate_seen_yet_is_optimistic() -> None:
    q = VTCQueue()
    q.push(req("w", "de"))
    assert adm(queue=q, clock=lambda: 0.0).queue_wait_estimate("de") == 0.0


def test_precheck_rejects_early_with_the_queue_wait() -> None:
    clock = [0.0]
    q = VTCQueue({"de": 1.0})
    a = adm(queue=q, clock=lambda: clock[0])
    for i in range(10):  # 1 req/s
        clock[0] = float(i)
        a(req(f"d{i}"), clock[0], 1, 0)
    clock[0] = 10.0
    for i in range(5):
        q.push(req(f"w{i}"))
    # ~5 s of queue + 0.5 s of service: a 3 s deadline cannot be met -> refused now
    d = a.precheck(req("new", deadline=13.0))
    assert not d.admit and d.finish_reason is FinishReason.REJECTED
    assert "queue" in d.reason
    assert a.precheck(req("roomy", deadline=20.0)).admit
    assert a.precheck(req("none")).admit
    assert a.counts["prechecked"] == 1


def test_latency_model_learns_service_time_from_results() -> None:
    # truth: service = 0.2 + 5 ms/uncached + 40 ms/output token (the prior says 10 / 20 ms)
    a = EngineAdmission(LatencyModel(PRIOR, min_samples=16, refit_every=8))
    before = a.model.predict(30, 12, 2, 0)
    for i in range(64):
        prompt, out = 20 + (i * 7) % 40, 4 + (i * 5) % 16
        r = req(f"r{i}", prompt=prompt, out=out)
        assert a(r, 0.0, i % 3, 0).admit  # the hook remembers the batch size (1..3)
        truth = 0.2 + 0.005 * prompt + 0.04 * out
        queue_s = 1.0 + i * 0.1  # must not leak into the model: it learns service only
        a.observe(result(r, out, total_s=queue_s + truth, queue_s=queue_s))
    assert a.model.fitted
    want = 0.2 + 0.005 * 30 + 0.04 * 12
    assert a.model.predict(30, 12, 2, 0) == pytest.approx(want, rel=0.03)
    assert abs(before - want) > 0.1
    assert a.model.median_abs_error() < 0.1
    assert not a._admitted  # everything observed was forgotten


def test_observe_learns_output_length_per_language() -> None:
    a = adm()
    for i in range(20):
        r = req(f"r{i}", group="fr", out=64)
        a.observe(result(r, 10, total_s=0.5), batch_size=1, group="fr")
    assert a.expected_output(req("x", group="fr", out=64)) == 10
    assert a.expected_output(req("y", group="es", out=64)) == 64  # no data: the request's own
    assert a.expected_output(req("z", group="fr", out=6)) == 6  # never above the cap


def test_failed_results_are_not_learned() -> None:
    a = adm()
    r = req("e")
    bad = result(r, 0, total_s=50.0)
    bad.finish_reason = FinishReason.ERROR
    a.observe(bad)
    assert a.model.observations == 0


# -- FairEngine plumbing on a fake engine -------------------------------------------------------


class _FakeEngine:
    """Just enough of Engine for FairEngine: submit returns a handle the test resolves."""

    def __init__(self, queue: Any) -> None:
        self.scheduler = type("S", (), {"queue": queue})()
        self.model_version = "fake"
        self.languages = ("de", "it")
        self.config = type("C", (), {"block_size": 16})()
        self.handles: dict[str, RequestHandle] = {}
        self.cancelled: list[str] = []

    def submit(self, request: GenerationRequest) -> RequestHandle:
        h = RequestHandle(request.request_id, self.cancel)
        self.handles[request.request_id] = h
        return h

    def cancel(self, rid: str) -> None:
        self.cancelled.append(rid)


def test_fair_engine_turns_a_late_ok_into_expired_and_observes() -> None:
    q = VTCQueue()
    a = adm(queue=q)
    fe = FairEngine(_FakeEngine(q), a, precheck=False)  # type: ignore[arg-type]
    on_time = req("t", deadline=5.0, arrival=0.0)
    late = req("l", deadline=5.0, arrival=0.0)
    h1, h2 = fe.submit(on_time), fe.submit(late)
    engine: Any = fe.engine
    engine.handles["t"].set_result(result(on_time, 5, total_s=4.0))
    engine.handles["l"].set_result(result(late, 5, total_s=6.0))
    assert h1.result(1).finish_reason is FinishReason.STOP
    r2 = h2.result(1)
    assert r2.finish_reason is FinishReason.EXPIRED and r2.text == ""
    assert "after its deadline" in r2.error
    assert fe.late_ok_converted == 1
    assert a.model.observations == 2  # both were served: both teach the model


def test_fair_engine_precheck_answers_at_once() -> None:
    q = VTCQueue()
    a = adm(queue=q, clock=lambda: 100.0)
    fe = FairEngine(_FakeEngine(q), a, warm_prefix=False)  # type: ignore[arg-type]
    h = fe.submit(req("x", deadline=100.2))  # needs 0.5 s
    assert h.done()
    r = h.result(0)
    assert r.finish_reason is FinishReason.REJECTED and r.tokens_out == 0
    assert "x" not in fe.engine.handles  # type: ignore[attr-defined]
    assert math.isnan(fe.stats()["latency_model_mae_s"])
