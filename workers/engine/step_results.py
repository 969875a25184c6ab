"""What an engine step's sampled tokens become: stop decisions, counters, finished results.

`StepResults` is a member of the engine (`Engine.results`), over the parts that outlive a
switch of configuration: the tokenizer and prompt rules, the statistics, the scheduler and the
request handles. The seam is after the forward: `Engine.step` runs the model (`ModelStep`,
workers/engine/forward.py) and hands the sampled tokens to the scheduler with `stop_check` as
the stop rule, then

* `stop_check`: EOS (unless `ignore_eos`), the `max_new_tokens` length, a newline for
  one-line prompts, a stop string in the decoded tail, the answer's log-probability under
  `stop_below` (the cascade's early deferral); returns (finish reason or None, whether the
  token is kept);
* `account`: the step's counters in `EngineStats` (preemptions, prefill and decode tokens,
  batch sizes);
* `finish`: a finished sequence as a `GenerationResult` (decoded text cut at the stop rules,
  timings), resolving its `RequestHandle`; `on_finish(request_id)` tells the engine first (its
  sampler drops the request's generator);
* `fail_all`: after a step raised, every live request (running, preempted, queued) finishes
  ERROR with the error and the scheduler starts empty;
* `step_record`: one line of `Engine.step_trace` (kind, sequences, tokens, seconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from workers.engine.engine_config import EngineStats
from workers.engine.prompts import PromptBuilder
from workers.engine.scheduler import Scheduler, SchedulerOutput, SequenceState
from workers.engine.types import (
    FinishReason,
    GenerationResult,
    RequestHandle,
    StepRecord,
    Timings,
)

__all__ = ["StepResults", "step_kind", "step_record"]


class StepResults:
    """The result side of `workers.engine.engine.Engine`'s step (module notes)."""

    def __init__(
        self,
        tokenizer: Any,  # a transformers tokenizer
        prompts: PromptBuilder,
        stats: EngineStats,
        scheduler: Scheduler,
        handles: dict[str, RequestHandle],  # the engine's: submitted, not finished
        on_finish: Callable[[str], None],
    ) -> None:
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.stats = stats
        self.scheduler = scheduler
        self.handles = handles
        self.on_finish = on_finish

    def stop_check(self, seq: SequenceState, token: int) -> tuple[FinishReason | None, bool]:
        p = seq.request.params
        if not p.ignore_eos and token in self.prompts.stop_rules.eos_ids:
            return FinishReason.STOP, False
        if len(seq.output_ids) + 1 >= p.max_new_tokens:
            return FinishReason.LENGTH, True
        if p.stop_at_newline and "\n" in self.tokenizer.decode([token]):
            return FinishReason.STOP, True
        if p.stop_strings:
            tail = self.tokenizer.decode([*seq.output_ids[-8:], token])
            if any(s in tail for s in p.stop_strings):
                return FinishReason.STOP, True
        if p.stop_below is not None and p.logprobs and answer_logprob(seq) < p.stop_below:
            return FinishReason.BELOW, True
        return None, True

    def account(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        s = self.stats
        s.preemptions += len(out.preempted)
        decode = sum(c.num_tokens for c in out.chunks if c.start >= c.seq.num_prompt_tokens)
        s.prefill_tokens += out.num_batched_tokens - decode
        s.decode_tokens += sum(1 + c.num_accepted for c in out.chunks if c.samples)
        drafted = sum(c.num_draft for c in out.chunks)
        if drafted:
            s.draft_steps += 1
            s.draft_tokens += drafted
            s.accepted_draft_tokens += sum(c.num_accepted for c in out.chunks)
        s.last_batch_size = len(out.chunks)
        s.batch_sizes.append(len(out.chunks))
        if len(s.batch_sizes) > 1024:
            del s.batch_sizes[:512]

    def finish(self, seq: SequenceState) -> GenerationResult:
        now = time.monotonic()
        req = seq.request
        reason = seq.finish_reason or FinishReason.ERROR
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        if req.params.stop_at_newline:
            text = text.split("\n", 1)[0]
        for s in req.params.stop_strings:
            text = text.split(s, 1)[0]
        logprob, scored = seq_logprob(seq)
        sched = seq.first_scheduled_at
        first = seq.first_token_at
        timings = Timings(
            queue_s=(sched - req.arrival) if sched else now - req.arrival,
            prefill_s=(first - sched) if (first and sched) else 0.0,
            decode_s=(now - first) if first else 0.0,
            total_s=now - req.arrival,
        )
        result = GenerationResult(
            request_id=req.request_id,
            token_ids=list(seq.output_ids),
            text=text.strip(),
            finish_reason=reason,
            tokens_in=seq.num_prompt_tokens,
            tokens_out=len(seq.output_ids),
            cached_tokens=seq.num_cached,
            timings=timings,
            error=seq.error,
            logprob=logprob,
            scored_tokens=scored,
        )
        self.stats.finished += 1
        self.on_finish(req.request_id)
        handle = self.handles.pop(req.request_id, None)
        if handle is not None:
            handle.set_result(result)  # runs its callbacks: the fair engine's observe among them
        # an admission hook remembers what it admitted until observed; a request submitted to
        # the engine directly (warm-up, a scoring) has no observer: forgotten here, else the hook
        # counts it as running for ever (workers/serving/admission.py, `_typical_batch`)
        forget = getattr(self.scheduler.admission, "forget", None)
        if forget is not None:
            forget(req.request_id)
        return result

    def fail_all(self, error: str) -> None:
        """After a failed step: fail every live request, reset the scheduler's state."""
        sched = self.scheduler
        seqs = [*sched.running, *sched.preempted]
        while len(sched.queue):
            r = sched.queue.pop()
            seqs.append(SequenceState(r, list(r.prompt_ids), len(r.prompt_ids)))
        for seq in sched.running:
            sched.kv.free(seq.request_id)  # the scheduler's: the one in use since any switch
        sched.running.clear()
        sched.preempted.clear()
        for seq in seqs:
            seq.finish_reason = FinishReason.ERROR
            seq.error = error
            self.finish(seq)


def step_kind(out: SchedulerOutput) -> str:
    """ "decode" (every scheduled sequence samples its next token, checking drafts or not),
    "prefill" (none decodes) or "mixed"."""
    decoding = sum(1 for c in out.chunks if c.samples and c.num_tokens == 1 + c.num_draft)
    return "decode" if decoding == len(out.chunks) else "prefill" if decoding == 0 else "mixed"


def step_record(out: SchedulerOutput, seconds: float) -> StepRecord:
    tokens = sum(c.num_tokens for c in out.chunks)
    return StepRecord(step_kind(out), len(out.chunks), tokens, seconds)


def answer_logprob(seq: SequenceState) -> float:
    """The log-probability of the answer so far, the token being checked included (the
    sampler appended its value before the stop check)."""
    return sum(seq.sampled_logprobs[: len(seq.output_ids) + 1])


def seq_logprob(seq: SequenceState) -> tuple[float | None, int]:
    """(mean log-probability, tokens): of the scored prompt tokens (`score_from`), or of the
    answer's generated tokens (`SamplingParams.logprobs`), the stop token's left out as
    teacher forcing leaves it (an EOS is never in `output_ids`; a kept newline or stop string
    is its last token, one sampled per output token then); (None, 0) for neither."""
    if seq.num_scored:
        return seq.logprob_sum / seq.num_scored, seq.num_scored
    n = len(seq.output_ids)
    if seq.finish_reason is FinishReason.STOP and len(seq.sampled_logprobs) == n:
        n -= 1  # the stop token (a newline, a stop string) was kept in the output: not the answer
    kept = seq.sampled_logprobs[:n]
    if seq.request.params.logprobs and kept:
        return sum(kept) / len(kept), len(kept)
    return None, 0
