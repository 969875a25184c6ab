"""Scheduler: exact batches for tiny cases, with the real KV cache manager and no model."""

from __future__ import annotations

from workers.engine.fcfs import FCFSRequestQueue as FCFSQueue
from workers.engine.kv_cache import KVCacheManager, KVGroupSpec
from workers.engine.scheduler import Scheduler, SchedulerConfig, SequenceState
from workers.engine.types import AdmissionDecision, FinishReason, GenerationRequest, SamplingParams

BS = 4


def make(num_blocks: int = 32, budget: int = 8, max_seqs: int = 4, **kw) -> Scheduler:
    kv = KVCacheManager([KVGroupSpec("full", num_blocks, BS, None)])
    return Scheduler(SchedulerConfig(max_seqs, budget, 64), kv, FCFSQueue(), **kw)


def req(rid: str, n: int, max_new: int = 3, deadline: float | None = None, base: int = 100):
    ids = list(range(base, base + n))
    return GenerationRequest(rid, ids, SamplingParams(max_new), deadline=deadline)


def never_stop(seq: SequenceState, token: int):
    if len(seq.output_ids) + 1 >= seq.request.params.max_new_tokens:
        return FinishReason.LENGTH, True
    return None, False


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {c.seq.request_id: [token] for c in out.chunks if c.samples}
    return out, s.update_from_output(out, sampled, never_stop)


def plan(out):
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks]


def test_chunked_prefill_does_not_stall_decode():
    s = make(budget=8)
    s.add_request(req("a", 5))
    out, _ = run_step(s)
    assert plan(out) == [("a", 0, 5)]  # whole prompt fits the budget
    s.add_request(req("b", 12, base=500))
    out, _ = run_step(s)
    # a decodes one token, b gets the 7 tokens left of the budget
    assert plan(out) == [("a", 5, 1), ("b", 0, 7)]
    out, _ = run_step(s)
    assert plan(out) == [("a", 6, 1), ("b", 7, 5)]
    assert [c.samples for c in out.chunks] == [True, True]


def test_finished_sequence_frees_blocks_and_returns_output():
    s = make()
    s.add_request(req("a", 4, max_new=2))
    free0 = s.kv.num_free_blocks("full")
    _, fin = run_step(s)
    assert fin == []
    _, fin = run_step(s, token=9)
    assert [f.request_id for f in fin] == ["a"]
    assert fin[0].output_ids == [7, 9]
    assert fin[0].finish_reason is FinishReason.LENGTH
    assert s.kv.num_free_blocks("full") == free0
    assert not s.has_work()


def test_prefix_cache_hit_skips_cached_blocks():
    s = make(budget=64)
    s.add_request(req("a", 10))
    run_step(s)  # computes 10 tokens: blocks [0..3], [4..7] become full and cached
    s.add_request(req("b", 10))
    out, _ = run_step(s)
    assert plan(out) == [("a", 10, 1), ("b", 8, 2)]
    assert s.running[1].num_cached == 8


def test_expired_request_is_not_prefilled():
    clock = [100.0]
    s = make(clock=lambda: clock[0])
    s.add_request(req("late", 4, deadline=99.0))
    s.add_request(req("ok", 4, deadline=200.0))
    out, fin = run_step(s)
    assert plan(out) == [("ok", 0, 4)]
    assert [(f.request_id, f.finish_reason) for f in fin] == [("late", FinishReason.EXPIRED)]
    assert "deadline passed" in fin[0].error


def test_admission_hook_rejects():
    def hook(r, now, running, cached):
        if r.request_id == "no":
            return AdmissionDecision(False, FinishReason.REJECTED, "would miss its deadline")
        return AdmissionDecision(True)

    s = make(admission=hook)
    s.add_request(req("no", 4))
    s.add_request(req("yes", 4))
    out, fin = run_step(s)
    assert plan(out) == [("yes", 0, 4)]
    assert fin[0].finish_reason is FinishReason.REJECTED


def test_preemption_when_pool_is_full_and_resume_from_cache():
    # 6 usable blocks: a (8 tokens = 2 blocks) and b (12 tokens = 3 blocks) fill 5 blocks.
    s = make(num_blocks=7, budget=32)
    s.add_request(req("a", 8, max_new=8, base=0))
    s.add_request(req("b", 12, max_new=8, base=50))
    out, _ = run_step(s)
    assert plan(out) == [("a", 0, 8), ("b", 0, 12)]
    # a needs a third block at position 8 -> ok (6th block); b needs a 4th at 12 -> none left,
    # so b (the newest) is preempted.
    out, _ = run_step(s)
    assert plan(out) == [("a", 8, 1)]
    assert out.preempted == ["b"]
    assert s.preempted[0].request_id == "b"
    # keep stepping until a finishes; b resumes, reusing its cached full blocks
    for _ in range(10):
        out, fin = run_step(s)
        if any(c.seq.request_id == "b" for c in out.chunks):
            break
    b_chunk = next(c for c in out.chunks if c.seq.request_id == "b")
    # b's 3 full blocks went to the LRU when it was preempted; a's 4th block (position 12)
    # evicted the tail one, so b resumes from its first 2 cached blocks.
    assert b_chunk.start == 8


def test_cancel_waiting_and_running():
    s = make()
    s.add_request(req("run", 4))
    run_step(s)
    s.add_request(req("wait", 4))
    s.cancel("run")
    s.cancel("wait")
    out, fin = run_step(s)
    assert out.chunks == []
    assert sorted((f.request_id, f.finish_reason) for f in fin) == [
        ("run", FinishReason.CANCELLED),
        ("wait", FinishReason.CANCELLED),
    ]
    assert s.kv.num_free_blocks("full") == 31


def test_max_num_seqs_caps_batch():
    s = make(budget=64, max_seqs=2)
    for r in "abc":
        s.add_request(req(r, 4, base=ord(r) * 10))
    out, _ = run_step(s)
    assert [c.seq.request_id for c in out.chunks] == ["a", "b"]
    assert s.num_waiting == 1


def test_partial_prefix_hit_schedules_only_the_rest_and_a_block_copy():
    s = make(budget=16)
    s.add_request(req("a", 6, max_new=1))  # prefills 6, samples one: 1 block + a 2-slot tail
    out, done = run_step(s)
    assert plan(out) == [("a", 0, 6)] and out.block_copies == []
    assert [d.request_id for d in done] == ["a"]  # finished: its tail is offered
    s.add_request(req("b", 9))  # the same first 6 tokens, then 3 of its own
    out, _ = run_step(s)
    assert plan(out) == [("b", 6, 3)]
    (copy,) = out.block_copies
    assert (copy.group, copy.src, copy.num_slots) == ("full", 2, 2)
    assert copy.dst == s.kv.block_table("b", "full")[1]
    assert out.chunks[0].seq.num_cached == 6


def test_pace_hook_holds_other_groups_newcomers_for_a_step():
    s = make(budget=64, max_seqs=4)
    seen: list[list[tuple[str, int]]] = []

    def pace(running, now):
        seen.append([(r.request_id, n) for r, n in running])
        return frozenset({"en"})  # only English newcomers while this hook says so

    s.pace = pace
    light = GenerationRequest("light", list(range(100, 104)), SamplingParams(5), group="en")
    s.add_request(light)
    out, _ = run_step(s)
    assert plan(out) == [("light", 0, 4)]  # nothing ran yet: the hook is not asked
    assert seen == []
    heavy = GenerationRequest("heavy", list(range(200, 204)), SamplingParams(5), group="de")
    light2 = GenerationRequest("light2", list(range(300, 304)), SamplingParams(5), group="en")
    s.add_request(heavy)
    s.add_request(light2)
    out, _ = run_step(s)
    # the queue's head is German: held, and the English one behind it keeps its place (FCFS)
    assert plan(out) == [("light", 4, 1)]
    assert seen == [[("light", 1)]]
    s.pace = None
    out, _ = run_step(s)
    assert [c.seq.request_id for c in out.chunks] == ["light", "heavy", "light2"]


def test_held_newcomers_wait_while_running_and_preempted_ones_go_on():
    """Engine.switch_to: while the scheduler holds newcomers, the running sequence finishes and
    the queue's request waits (none starts on the old model); released, it starts."""
    s = make()
    s.add_request(req("a", 4, max_new=2))
    run_step(s)  # a prefills
    s.hold_newcomers = True
    s.add_request(req("b", 4, base=200))
    out, finished = run_step(s)
    assert plan(out) == [("a", 4, 1)]
    assert [f.request_id for f in finished] == ["a"]
    out, _ = run_step(s)
    assert plan(out) == [] and s.num_waiting == 1 and not s.running
    s.hold_newcomers = False
    out, _ = run_step(s)
    assert plan(out) == [("b", 0, 4)]
