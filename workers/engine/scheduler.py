"""Continuous-batching scheduler: pure CPU logic, no torch, no model.

One `schedule()` call decides what the next model step computes; `update_from_output()` takes
what the step sampled. The shape follows vLLM v1's scheduler: there are no separate prefill and
decode phases, every sequence simply has `num_computed` tokens in the KV cache and wants the
rest of its `token_ids` computed. Each step:

1. running sequences first, in admission order: a decoding sequence needs one token, a sequence
   still in (chunked) prefill gets as much of its remaining prompt as the token budget allows.
   When the KV pool is full the most recently admitted running sequence is preempted (its
   blocks freed; it is recomputed later, mostly from the prefix cache);
2. then newcomers from the waiting `RequestQueue` (the engine's FCFS default, `fcfs.py`, or the
   fair-share VTC queue of `workers.fairness`), each charged for its *uncached* prompt tokens,
   while budget, batch slots and KV blocks last. Requests already past their deadline are
   expired here, before any prefill is spent on them; an optional `admission` hook may reject
   those that would miss it, and an optional `pace` hook may hold newcomers back for a step
   (a newcomer's prefill slows the whole step; the hook names the groups still let in while a
   running request needs fast steps to make its SLO, `workers/serving/pace.py`).

So decode of running requests is never stalled by a long newcomer: the newcomer's prefill is
cut into chunks that fit what the budget leaves over.

Speculative decoding (greedy): a decoding sequence may carry draft tokens (`draft_ids`, set by
the engine's proposer after each step, workers/engine/speculative.py). Its chunk then computes
its last token and the drafts in one step (`num_draft` extra rows); the step returns the
target's greedy token after each of those rows, and `update_from_output` keeps the drafts the
target agrees with plus the target's own next token (vLLM v1's shape: the scheduler owns
`num_computed`, so rejecting a draft is only not counting its KV: its slots are overwritten by
the next step, and prefix-cache blocks are published only over verified tokens). Greedy output
is the model's own token for token where a checked row computes as a decode row does (the
compiled graph; speculative.py says where it does not).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.engine.deadlines import expired
from workers.engine.kv_cache import BlockCopy, KVCacheManager
from workers.engine.types import (
    AdmissionDecision,
    AdmissionHook,
    FinishReason,
    GenerationRequest,
    PaceHook,
    RequestQueue,
)

__all__ = [
    "AdmissionDecision",
    "AdmissionHook",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SequenceState",
    "StopCheck",
]


@dataclass(slots=True)
class SequenceState:
    """One admitted request while it lives in the engine."""

    request: GenerationRequest
    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int
    num_computed: int = 0  # tokens whose K/V is in the cache
    num_cached: int = 0  # prompt tokens taken from the prefix cache at (last) admission
    output_ids: list[int] = field(default_factory=list)
    first_scheduled_at: float | None = None
    first_token_at: float | None = None
    finish_reason: FinishReason | None = None
    error: str = ""
    num_preemptions: int = 0
    draft_ids: list[int] = field(default_factory=list)  # proposed next tokens, not yet checked
    draft_len: int = 0  # drafts to ask for next (speculative.py adapts it; 0: not started)
    num_drafted: int = 0  # draft tokens checked by the target, in total
    num_accepted: int = 0  # of those, the ones the target agreed with
    logprob_sum: float = 0.0  # request.score_from: the scored tokens' log-probabilities so far
    num_scored: int = 0  # and how many of them
    # SamplingParams.logprobs: each sampled token's log-probability (step_results.seq_logprob)
    sampled_logprobs: list[float] = field(default_factory=list)

    @property
    def scored_rows(self) -> range:
        """Positions whose next-token distribution scores a prompt token (`score_from`): the
        row at p gives the log-probability of token p + 1. Empty for a plain request."""
        start = self.request.score_from
        if start is None:
            return range(0)
        return range(max(0, start - 1), self.num_prompt_tokens - 1)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_remaining(self) -> int:
        return len(self.token_ids) - self.num_computed


@dataclass(slots=True)
class ScheduledChunk:
    seq: SequenceState
    start: int  # first position computed in this step
    num_tokens: int  # positions [start, start + num_tokens), drafts included
    samples: bool = False  # reaches the end of the known tokens, so a token is sampled after it
    draft: tuple[int, ...] = ()  # the last len(draft) positions are draft tokens to check
    num_accepted: int = 0  # drafts the target agreed with (set by update_from_output)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens - len(self.draft) == len(self.seq.token_ids)

    @property
    def num_draft(self) -> int:
        return len(self.draft)

    @property
    def num_rows_sampled(self) -> int:
        """Rows whose next token the step returns: the last, and one per draft (0 if none)."""
        return 1 + len(self.draft) if self.samples else 0

    @property
    def scored_rows(self) -> range:
        """The positions of this chunk whose rows score a prompt token (see SequenceState)."""
        rows = self.seq.scored_rows
        return range(max(rows.start, self.start), min(rows.stop, self.start + self.num_tokens))

    def input_ids(self) -> list[int]:
        """The token ids this chunk computes, drafts last."""
        known = self.seq.token_ids[self.start : self.start + self.num_tokens - len(self.draft)]
        return [*known, *self.draft]


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # what the model computes this step, in batch order
    num_batched_tokens: int  # sum of chunk sizes
    finished: list[SequenceState]  # finished without a model step (expired, rejected, cancelled)
    preempted: list[str]  # request ids preempted this step
    # partial prefix hits: K/V slots to copy between blocks before the forward (kv_cache.py)
    block_copies: list[BlockCopy] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 32  # running batch size cap
    max_num_batched_tokens: int = 512  # token budget of one step (decode + prefill chunks)
    max_model_len: int = 2048  # prompt + output cap per sequence


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        queue: RequestQueue,
        admission: AdmissionHook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv = kv
        self.queue = queue
        self.admission = admission
        self.pace: PaceHook | None = None  # set by the serving layer (workers/serving/pace.py)
        self.clock = clock
        self.running: list[SequenceState] = []
        self.preempted: deque[SequenceState] = deque()  # resumed before any newcomer
        self._cancelled: set[str] = set()
        # True while the engine waits to change its model (Engine.switch_to): preempted
        # sequences still resume, the queue's requests wait (none runs on two models)
        self.hold_newcomers = False

    # -- intake ---------------------------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> None:
        self.queue.push(request)

    def cancel(self, request_id: str) -> None:
        self._cancelled.add(request_id)

    def has_work(self) -> bool:
        return bool(self.running or self.preempted or len(self.queue) or self._cancelled)

    @property
    def num_waiting(self) -> int:
        return len(self.queue) + len(self.preempted)

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        finished = self._drop_cancelled()
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []

        # 1. running sequences, oldest first; preempt the newest when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_remaining, budget)
            draft: tuple[int, ...] = ()
            if seq.draft_ids and seq.num_remaining == 1:  # decoding, with drafts to check
                room = min(budget, self.config.max_model_len - len(seq.token_ids)) - 1
                draft = tuple(seq.draft_ids[: max(0, room)])
                n += len(draft)
            while not self.kv.allocate_slots(seq.request_id, seq.token_ids, seq.num_computed, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    break
            else:
                chunks.append(ScheduledChunk(seq, seq.num_computed, n, draft=draft))
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted: it was the last running one

        # 2. newcomers: preempted ones first, then the waiting queue's policy order.
        allowed = self._allowed_groups(now)
        if not preempted:
            while budget > 0 and len(self.running) < self.config.max_num_seqs:
                if allowed is not None and not self._head_allowed(allowed):
                    break  # held for this step: the head of the queue would slow a late one
                waiting = self._next_waiting(now, finished)
                if waiting is None:
                    break
                seq, cached = waiting
                if cached is None:  # a resumed sequence: its cached prefix may have changed
                    cached = self._cached_prefix(seq)
                n = min(len(seq.token_ids) - cached, budget)
                if not self.kv.allocate_slots(seq.request_id, seq.token_ids, cached, n):
                    self._unpop(seq)
                    break
                is_new = seq.first_scheduled_at is None
                if is_new:
                    seq.first_scheduled_at = now
                    seq.num_cached = cached
                    self.queue.charge(seq.request, seq.num_prompt_tokens - cached, 0)
                seq.num_computed = cached
                self.running.append(seq)
                chunks.append(ScheduledChunk(seq, cached, n))
                budget -= n

        num_tokens = sum(c.num_tokens for c in chunks)
        copies = self.kv.prefix.take_block_copies()
        return SchedulerOutput(chunks, num_tokens, finished, preempted, copies)

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, list[int]], stop_check: StopCheck
    ) -> list[SequenceState]:
        """Advance sequences by what the step computed; return those that finished.

        `sampled[request id]`: the tokens sampled after each of a sampling chunk's last
        `num_rows_sampled` rows (one token without drafts). Without drafts that token is the
        next one; with drafts, token i follows draft i - 1 and counts only while every draft
        before it matched the token sampled in its place (greedy verification)."""
        now = self.clock()
        finished: list[SequenceState] = list(output.finished)
        for chunk in output.chunks:
            seq = chunk.seq
            if not chunk.samples:  # a prefill chunk that is not the last: nothing sampled yet
                seq.num_computed = chunk.start + chunk.num_tokens
                self.kv.prefix.commit_computed(seq.request_id, seq.token_ids, seq.num_computed)
                continue
            if seq.first_token_at is None:
                seq.first_token_at = now
            last_known = chunk.start + chunk.num_tokens - chunk.num_draft  # rows up to it: real
            reason: FinishReason | None = None
            verified = 0  # rows whose input is a known token (the last one, matched drafts)
            for i, token in enumerate(sampled[seq.request_id]):
                verified = i + 1
                reason, keep = stop_check(seq, token)
                if reason is None or keep:
                    seq.output_ids.append(token)
                    seq.token_ids.append(token)
                    self.queue.charge(seq.request, 0, 1)
                if reason is None and len(seq.token_ids) >= self.config.max_model_len:
                    reason = FinishReason.LENGTH
                if reason is not None or i >= chunk.num_draft or token != chunk.draft[i]:
                    break  # finished, or the draft is wrong from here on
            chunk.num_accepted = verified - 1
            seq.num_drafted += chunk.num_draft
            seq.num_accepted += chunk.num_accepted
            seq.draft_ids = []  # checked: the proposer drafts again from the new tokens
            seq.num_computed = last_known - 1 + verified
            self.kv.prefix.commit_computed(seq.request_id, seq.token_ids, seq.num_computed)
            if reason is not None:
                seq.finish_reason = reason
                finished.append(seq)
        done_ids = {s.request_id for s in finished}
        if done_ids:
            self.running = [s for s in self.running if s.request_id not in done_ids]
            for seq in finished:
                self.kv.free(seq.request_id, seq.token_ids)
        return finished

    # -- helpers --------------------------------------------------------------------------
    def _allowed_groups(self, now: float) -> frozenset[str] | None:
        if self.pace is None or not self.running:
            return None
        return self.pace([(s.request, len(s.output_ids)) for s in self.running], now)

    def _head_allowed(self, allowed: frozenset[str]) -> bool:
        """Whether the next newcomer (a preempted one first, else the queue's head) may start."""
        head = self.preempted[0].request if self.preempted else self.queue.peek()
        return head is None or head.group in allowed

    def _next_waiting(
        self, now: float, finished: list[SequenceState]
    ) -> tuple[SequenceState, int | None] | None:
        """The next sequence to start, with its cached prefix length when already looked up
        (a fresh request: the admission hook needed it) or None (a resumed one)."""
        while True:
            if self.preempted:
                return self.preempted.popleft(), None
            if self.hold_newcomers:
                return None
            request = self.queue.peek()
            if request is None:
                return None
            self.queue.pop()
            seq = SequenceState(request, list(request.prompt_ids), len(request.prompt_ids))
            cached = self._cached_prefix(seq)
            verdict = self._admit(request, now, cached)
            if verdict.admit:
                return seq, cached
            seq.finish_reason = verdict.finish_reason
            seq.error = verdict.reason
            finished.append(seq)

    def _admit(self, request: GenerationRequest, now: float, cached: int) -> AdmissionDecision:
        if request.deadline is not None and expired(request.deadline, now):  # deadlines.py
            late_ms = (now - request.deadline) * 1e3
            return AdmissionDecision(
                False, FinishReason.EXPIRED, f"deadline passed {late_ms:.0f} ms before admission"
            )
        if len(request.prompt_ids) >= self.config.max_model_len:
            return AdmissionDecision(
                False,
                FinishReason.REJECTED,
                f"prompt of {len(request.prompt_ids)} tokens exceeds max_model_len "
                f"{self.config.max_model_len}",
            )
        if self.admission is not None:
            return self.admission(request, now, len(self.running), cached)
        return AdmissionDecision(True)

    def _cached_prefix(self, seq: SequenceState) -> int:
        """The prefix-cache hit of a sequence about to start: never past its first scored row,
        whose log-probability must be computed (`score_from`)."""
        rows = seq.scored_rows
        if rows:
            return self.kv.prefix.find_cached_prefix(seq.token_ids[: rows.start + 1])
        return self.kv.prefix.find_cached_prefix(seq.token_ids)

    def _unpop(self, seq: SequenceState) -> None:
        # Not enough KV blocks for a newcomer: it waits at the front.
        self.preempted.appendleft(seq)

    def _preempt(self, seq: SequenceState) -> None:
        self.kv.free(seq.request_id, seq.token_ids)
        seq.num_computed = 0
        seq.draft_ids = []
        seq.logprob_sum, seq.num_scored = 0.0, 0  # its scored rows are computed again
        seq.num_preemptions += 1
        self.preempted.appendleft(seq)

    def _drop_cancelled(self) -> list[SequenceState]:
        if not self._cancelled:
            return []
        dropped: list[SequenceState] = []
        for rid in self._cancelled:
            running = next((s for s in self.running if s.request_id == rid), None)
            preempted = next((s for s in self.preempted if s.request_id == rid), None)
            if running is not None:
                self.running.remove(running)
                self.kv.free(rid, running.token_ids)
                seq = running
            elif preempted is not None:
                self.preempted.remove(preempted)
                seq = preempted
            else:
                request = self.queue.remove(rid)
                if request is None:
                    continue  # already finished or unknown
                seq = SequenceState(request, list(request.prompt_ids), len(request.prompt_ids))
            seq.finish_reason = FinishReason.CANCELLED
            dropped.append(seq)
        self._cancelled.clear()
        return dropped


# (sequence, newly sampled token) -> (why it stops now or None, keep the token in the output?).
# An EOS token is dropped; a token that completes a stop string is kept and the text is cut.
StopCheck = Callable[[SequenceState, int], tuple[FinishReason | None, bool]]
