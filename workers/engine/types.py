"""Records that cross the engine's boundary.

The engine is driven by plain dataclasses, the way vLLM v1 drives its core: what goes in is a
`GenerationRequest` (token ids already built from a translation prompt), what comes out is a
`GenerationResult` with the timings the worker puts on the reply. The waiting-queue policy is a
protocol (`RequestQueue`) and the admission check a callable (`AdmissionHook`), so the
fair-share queue of `workers.fairness` and the deadline admission of `workers.serving` plug into
the scheduler without the engine knowing about languages' weights (the engine imports neither;
its default queue is `workers.engine.fcfs`). `workers.fairness` imports only this module of the
engine.

Nothing here imports torch or Kafka.
"""

from __future__ import annotations

import concurrent.futures
import enum
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, newline or a stop string
    LENGTH = "length"  # max_new_tokens reached
    CANCELLED = "cancelled"  # cancel() on the handle
    EXPIRED = "expired"  # deadline passed before it could be served
    REJECTED = "rejected"  # admission refused it (queue full, would miss its deadline)
    ERROR = "error"  # the engine failed on it; `error` says why
    WITHHELD = "withheld"  # an answer failed the faithfulness checks: not sent as a translation
    # its tokens' log-probability fell under `SamplingParams.stop_below`: a partial answer,
    # never sent (the cascade's early deferral, workers/stages/cascade/stage.py)
    BELOW = "below"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 128  # hard cap on generated tokens
    temperature: float = 0.0  # 0 = greedy (the default); > 0 samples
    top_p: float = 1.0  # nucleus cut when sampling
    seed: int | None = None  # per-request generator seed when sampling
    stop_at_newline: bool = True  # a generated "\n" ends a translation
    stop_strings: tuple[str, ...] = ()  # cut the output at the first of these
    ignore_eos: bool = False  # benchmarks: generate exactly max_new_tokens
    # keep each generated token's log-probability (full logits: no screened head, no drafts);
    # the result's `logprob` is their mean over the answer: the cascade's small-model signal
    # read off the generation itself, no second pass (workers/stages/cascade/stage.py)
    logprobs: bool = False
    # with `logprobs`: end the answer (`FinishReason.BELOW`) as soon as the sum of its tokens'
    # log-probabilities falls under this; a sum that only falls cannot climb back, so the
    # cascade knows the whole answer's `small_total` would be under its threshold too
    stop_below: float | None = None


@dataclass(slots=True)
class GenerationRequest:
    request_id: str  # unique while in the engine
    prompt_ids: list[int]  # full prompt, prefix included
    params: SamplingParams = field(default_factory=SamplingParams)
    group: str = ""  # fair-share group (the target language); "" = none
    deadline: float | None = None  # absolute time.monotonic() by which it must finish
    arrival: float = field(default_factory=time.monotonic)  # when it entered the engine
    expected_output_tokens: int = 0  # estimate for admission and cost models (0 = unknown)
    # Teacher forcing: the prompt's tokens from this position on are scored, each by the
    # model's log-probability of it given everything before it; the result's `logprob` is
    # their mean (the cascade's deferral signal: a model scoring another model's answer).
    # Those positions are always computed, never taken from the prefix cache.
    score_from: int | None = None


@dataclass(frozen=True, slots=True)
class TranslationRequest:
    """One translation as it passes down the serving stages (workers/serving/pipeline.py) to
    the engine: everything a stage reads or sets, so nothing travels as a side channel. A stage
    that changes what the engine sees passes on a copy (`dataclasses.replace`)."""

    request_id: str  # the reply's id; a stage's rerun goes under `<id><suffix>`
    text: str  # what the engine translates (the protected-spans stage passes a masked copy)
    source_lang: str  # "" = unknown
    target_lang: str
    deadline: float | None = None  # absolute time.monotonic() by which it must finish
    max_new_tokens: int | None = None  # None: the engine's default (the faithful guard sets it)
    # the request's conversation (the context stage keeps its history; the others pass it on)
    conversation_id: str | None = None
    prompt_form: str | None = None  # a form of prompts.json; None: the engine's default
    # token ids of the conversation so far, put between the cached prefix and the query (set
    # by the context stage on a turn with history; a stage's rerun goes without them)
    history: tuple[int, ...] = ()
    # retrieved (source, target) examples after the prefix, before the query
    # (workers/stages/examples/stage.py)
    examples: tuple[tuple[str, str], ...] = ()
    # the engine keeps the answer's token log-probabilities (`SamplingParams.logprobs`: the
    # cascade asks for them of the small model)
    logprobs: bool = False
    stop_below: float | None = None  # `SamplingParams.stop_below` (the cascade's early deferral)


@dataclass(slots=True)
class Timings:
    queue_s: float = 0.0  # arrival -> first scheduled
    prefill_s: float = 0.0  # first scheduled -> first token (TTFT minus queue)
    decode_s: float = 0.0  # first token -> finish
    total_s: float = 0.0  # arrival -> finish


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    token_ids: list[int]  # generated tokens, stop token excluded
    text: str  # decoded and cut at the stop rule
    finish_reason: FinishReason
    tokens_in: int = 0  # prompt tokens
    tokens_out: int = 0  # generated tokens
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    timings: Timings = field(default_factory=Timings)
    error: str = ""  # set when finish_reason is ERROR / REJECTED / EXPIRED
    # Tags for the reply's metadata (workers.kafka.replies copies them, in this order), e.g. what
    # the
    # protected-span stage did; keys from workers/reply_metadata.py only; never metric labels.
    notes: Mapping[str, str] = field(default_factory=dict)
    # What the serving stages did (workers/serving/pipeline.py), as declared fields: code reads
    # these (the cache's rule, workers/stages/cache/policy.py), never the strings of `notes`
    cache_tier: str = ""  # how the exact-match cache answered: l1 / l2 / miss / joined
    faithful: str = ""  # the faithfulness outcome of a suspect answer: retried/flagged/withheld
    spans: str = ""  # span protection's outcome: restored/skipped/retried_unmasked/flagged
    retries: int = 0  # reruns stages made for it (faithfulness, unmasked, without history)
    flagged: bool = False  # a stage sent it though its checks still doubt it
    finish_detail: str = ""  # a stage's finer finish reason: "length_guard" (the guard's cap)
    examples_used: int = 0  # retrieved translation-memory examples its prompt showed
    # a request with `score_from`: the mean log-probability of its scored prompt tokens; one
    # with `SamplingParams.logprobs`: that of its generated tokens (`token_ids`)
    logprob: float | None = None
    scored_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


class RequestQueue(Protocol):
    """The waiting queue of the batching scheduler: which request is admitted next.

    FCFS is a deque; the weighted fair-share queue (workers.fairness) keeps one queue per
    group and a virtual-token counter per group. The scheduler calls `peek()` to see the next
    candidate, `pop()` once it admitted it, and `charge()` with the service each request
    actually received (uncached prompt tokens when prefilled, output tokens as decoded).
    """

    def push(self, request: GenerationRequest) -> None: ...

    def peek(self) -> GenerationRequest | None: ...

    def pop(self) -> GenerationRequest: ...

    def remove(self, request_id: str) -> GenerationRequest | None: ...

    def charge(
        self, request: GenerationRequest, prefill_tokens: int, output_tokens: int
    ) -> None: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """What the scheduler's admission hook says about one request about to be admitted."""

    admit: bool
    finish_reason: FinishReason | None = None  # EXPIRED / REJECTED when not admitted
    reason: str = ""  # human-readable; goes on the refused request's result


# The scheduler's admission hook: (request, now, running batch size, cached prompt tokens) ->
# decision. The engine takes one as a plain callable; the fair-share deadline admission
# (workers.serving.admission) is the real one.
AdmissionHook = Callable[[GenerationRequest, float, int, int], AdmissionDecision]

# The scheduler's pace hook: (running requests with the tokens each has generated, now) -> the
# fair-share groups a newcomer may come from this step, or None for any. A newcomer's prefill
# makes its step several times slower for every running request; the serving layer's hook
# (workers.serving.pace) holds newcomers back while a running request needs fast steps to make
# its SLO.
PaceHook = Callable[[Sequence[tuple[GenerationRequest, int]], float], frozenset[str] | None]


class RequestHandle:
    """What `Engine.submit()` returns: a thread-safe future for one request.

    The engine thread resolves it; any thread may wait on it, add callbacks or cancel it.
    Callbacks run on the engine thread, so they must be quick (the worker hands the result
    to its poll loop through a queue).
    """

    def __init__(self, request_id: str, canceller: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._canceller = canceller
        self._future: concurrent.futures.Future[GenerationResult] = concurrent.futures.Future()

    def result(self, timeout: float | None = None) -> GenerationResult:
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> None:
        """Ask the engine to drop the request; it resolves with FinishReason.CANCELLED."""
        self._canceller(self.request_id)

    def add_done_callback(self, fn: Callable[[GenerationResult], None]) -> None:
        self._future.add_done_callback(lambda f: fn(f.result()))

    def set_result(self, result: GenerationResult) -> None:
        """Called by the engine only."""
        if not self._future.done():
            self._future.set_result(result)


class UnsupportedLanguage(ValueError):
    """A language pair the loaded model has no prompt template for."""


class TranslationEngine(Protocol):
    """What the Kafka worker needs from an engine (`workers.engine.engine.Engine` is the real one;
    tests may use an in-memory fake with the same methods)."""

    # read-only for the worker: an attribute or a property (a wrapper such as
    # workers.stages.protected.stage passes its inner engine's through)
    @property
    def model_version(self) -> str:  # goes on every reply (an arm's worker adds "@arm")
        ...

    @property
    def languages(self) -> tuple[str, ...]:  # supported language codes (source and target)
        ...

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        """Queue one translation; raises UnsupportedLanguage for an unknown pair."""
        ...

    def count_tokens(self, text: str) -> int: ...

    def start(self) -> None: ...

    def stop(self, drain: bool = True, timeout: float | None = None) -> None: ...


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step, as `Engine.step_trace` records it (benchmarks: decode on decode steps)."""

    kind: str  # "decode" (every scheduled sequence samples its next token), "prefill", "mixed"
    num_seqs: int  # sequences scheduled in the step
    num_tokens: int  # tokens computed in the step (decode tokens + prefill chunk tokens)
    seconds: float  # wall time of the whole step (schedule, model, sampling, bookkeeping)
