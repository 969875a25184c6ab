"""The engine: a step loop over scheduler -> model -> sampler, in its own thread.

`Engine.submit()` is thread-safe and returns a `RequestHandle` at once; the loop thread owns the
scheduler, the KV cache manager and the model, so none of them needs a lock. Each step:

    out = scheduler.schedule()                       # which tokens of which sequences
    model.copy_kv_blocks(out.block_copies)           # prefix hits that end inside a block
    hidden = model(input_ids, positions, metadata)   # one forward over the flattened batch
    sampled = sampler.pick(seqs, hidden[last token of each sampling sequence])  # all greedy:
    # the screened int8 LM head (kernels/greedy_head.py); else full logits, seeded draws
    scheduler.update_from_output(out, sampled, stop) # advance, finish, free blocks

The sampler (`TokenSampler`, workers/engine/sampling.py) holds each sampled request's seeded
generator; `EngineConfig` and `EngineStats` live in workers/engine/engine_config.py and are
re-exported here. The forward itself (eager, compiled or a CUDA graph replay, and the tokens it
samples) is the member `runner`, a `ModelStep` (workers/engine/forward.py), and what a step's
sampled tokens become (the stop rules, the counters, the finished results, and every request
failed after a step raised) is the member `results`, a `StepResults`
(workers/engine/step_results.py).

A translation is `(text, source_lang, target_lang)` turned into prompt ids by `PromptBuilder`;
its prefix (instructions + few-shot examples of the target language) is shared through the
prefix cache, and `warm()` computes it once at start-up so the first request of a language
already prefills only its own tokens. `score_request()` builds the other kind of request:
an answer scored by teacher forcing (`GenerationRequest.score_from`; the result's `logprob`
is its tokens' mean log-probability under this model), one prefill and no decoding, the
quality-aware cascade's deferral signal (workers/stages/cascade/).

The model is prepared once per loaded model (`workers/engine/prepare.py`: the speed swaps of
`swaps.py`), not by each engine: `Engine(loaded_or_prepared, config)` prepares a `LoadedModel`
on first use and refuses one prepared with other swaps than `config.preparation`
(`PreparationMismatch`). Each engine allocates its own KV pools and binds them to the model
around every forward, under the prepared model's lock, so engines over one model never share
pools and take turns per step (the lock is uncontended with one engine).

The engine knows nothing of Kafka: the worker drives it through `submit_translation()` and
handle callbacks (which run on the engine thread and must only enqueue).

One concern, over 400 lines: the step loop and what it owns (the request intake, the loop
thread, start and stop, the switch to another configuration, warm-up). Its forward and its
results are members of their own (`runner`, `results`); what is left shares the loop thread's
state and reads best in one place.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from workers.engine import disk_cache, inductor_setup, linear_backends
from workers.engine.compiled import CompiledDecode
from workers.engine.cuda_graphs import CudaGraphDecode
from workers.engine.engine_config import EngineConfig, EngineStats
from workers.engine.engine_snapshot import EngineSnapshot, snapshot_engine
from workers.engine.fcfs import FCFSRequestQueue
from workers.engine.forward import ModelStep
from workers.engine.kv_cache import KVCacheManager, KVGroupSpec
from workers.engine.loader import LoadedModel, load_model
from workers.engine.prepare import PreparedModel, prepare_model
from workers.engine.prompts import PromptBuilder
from workers.engine.sampling import TokenSampler
from workers.engine.scheduler import (
    AdmissionHook,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from workers.engine.speculative import make_drafter
from workers.engine.step_results import StepResults, step_kind, step_record
from workers.engine.threads import release_openmp_pool, use_threads
from workers.engine.types import (
    GenerationRequest,
    GenerationResult,
    RequestHandle,
    RequestQueue,
    SamplingParams,
    StepRecord,
    TranslationRequest,
)

__all__ = ["Engine", "EngineConfig", "EngineStats"]  # the config and stats: engine_config.py

if TYPE_CHECKING:
    from workers.engine.autoconfig import ConfigReport

log = logging.getLogger(__name__)

YIELD_POLL_S = 0.002  # how often a loop yielding to another engine (`yields_to`) looks again


class Engine:
    def __init__(
        self,
        model: LoadedModel | PreparedModel,
        config: EngineConfig | None = None,
        request_queue: RequestQueue | None = None,
        admission: AdmissionHook | None = None,
    ) -> None:
        """`model`: a `PreparedModel`, or a `LoadedModel`, prepared here on first use. Either
        way the preparation must be `config.preparation` (raises `PreparationMismatch`)."""
        self.config = config or EngineConfig()
        loaded = model.loaded if isinstance(model, PreparedModel) else model
        # the swaps run once per loaded model, shared by its engines (workers/engine/prepare.py)
        self.prepared = prepare_model(loaded, self.config.preparation)
        self.loaded = loaded
        self.model = loaded.model
        self.lm_screen = self.prepared.lm_screen if self.config.screen_lm_head else None
        self.sampler = TokenSampler(self.model, self.lm_screen)
        self.tokenizer = loaded.tokenizer
        mc = loaded.config
        self.device = self.prepared.device
        self.kv_dtype = self.prepared.kv_dtype
        bs = self.config.block_size
        num_blocks = math.ceil(self.config.kv_cache_tokens / bs) + 1  # + the null block
        groups = [
            KVGroupSpec(g, num_blocks, bs, mc.sliding_window if g == "sliding" else None)
            for g in mc.kv_groups
        ]
        self.kv = KVCacheManager(
            groups,
            enable_prefix_caching=self.config.enable_prefix_caching,
            share_partial_blocks=self.config.share_partial_blocks,
        )
        # this engine's own pools (CPU: on huge pages), bound to the model for each forward
        self.kv_pools = self.prepared.allocate_kv_pools({g.name: g.num_blocks for g in groups}, bs)
        self.prepared.bind(self.kv_pools)  # the model's k_cache/v_cache, until another engine's
        self.compiled = (
            CompiledDecode(
                self.model, bs, self.config.compile_max_batch, self.config.compile_max_rows
            )
            if self.config.compile_decode
            else None
        )
        # CUDA only (issue #17): the Triton kernels swapped in, decode steps as CUDA graphs
        self.graphs: CudaGraphDecode | None = None
        if self.device.type == "cuda" and self.config.triton_kernels:
            from workers.engine.triton_swaps import apply_triton_kernels

            apply_triton_kernels(self.model)  # in place, idempotent (see triton_swaps.py)
        if self.device.type == "cuda" and self.config.cuda_graphs:
            self.graphs = CudaGraphDecode(
                self.model, bs, self.config.max_model_len,
                max_batch=self.config.max_num_seqs, use_triton=self.config.triton_kernels,
            )  # fmt: skip
        c = self.config  # drafts within the compiled graph's rows, where checks are exact
        rows = c.compile_max_rows if self.compiled is not None else None
        self.drafter = make_drafter(c.draft, c.draft_max, c.max_model_len, rows)
        self.scheduler = Scheduler(
            SchedulerConfig(
                self.config.max_num_seqs,
                self.config.max_num_batched_tokens,
                self.config.max_model_len,
            ),
            self.kv,
            request_queue if request_queue is not None else FCFSRequestQueue(),
            admission,
        )
        self.prompts = PromptBuilder(
            self.tokenizer,
            mc.arch,
            mc.bos_token_id,
            set(mc.eos_token_ids),
            form=self.config.prompt_form,
        )
        self.model_version = self.config.model_version or loaded.name
        self.languages = self.prompts.languages
        self.stats = EngineStats()
        self._handles: dict[str, RequestHandle] = {}
        # the step's two sides as members: the forward over the model side (rebuilt by a
        # switch), and what its tokens become (over the parts that outlive a switch)
        self.runner = self._model_step()
        self.results = StepResults(
            self.tokenizer, self.prompts, self.stats, self.scheduler, self._handles,
            on_finish=lambda request_id: self.sampler.forget(request_id),
        )  # fmt: skip
        # set to a list to record every step (kind, sizes, wall time): benchmarks measure
        # decode speed on the steps in which every sequence decodes
        self.step_trace: list[StepRecord] | None = None
        self._inbox: queue.SimpleQueue[GenerationRequest] = queue.SimpleQueue()
        self._cancels: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Read by the worker's probes (workers/health.py), written by one thread each:
        self.loop_heartbeat: float | None = None  # monotonic time the loop last came round
        self.warmed_languages: set[str] = set()  # languages whose prompt prefix warm() cached
        self.warm_at_start: tuple[str, ...] = ()  # languages start() warms on the loop thread
        # written by the tuner (workers/engine/tuner.py), read by /readyz and the metrics
        self.config_report: ConfigReport | None = None
        self._pending_switch: tuple[Engine, threading.Event] | None = None
        # set before `start`: while it returns True the loop takes no step, so another engine
        # of the process has the CPU to itself (the cascade's large model yields to its small
        # one, whose answers are most requests' latency: workers/serving/pipeline.py)
        self.yields_to: Callable[[], bool] | None = None
        release_openmp_pool()  # packing and allocation ran here; the loop may run elsewhere

    def _model_step(self) -> ModelStep:
        return ModelStep(
            self.model, self.kv, self.device, self.sampler, self.stats, self.compiled, self.graphs
        )

    def use_sampler(self, sampler: TokenSampler) -> None:
        """Pick tokens with `sampler` from now on (the device check's logit recorder,
        workers/engine/device_select.py); not while the loop runs a step."""
        self.sampler = sampler
        self.runner = self._model_step()

    @classmethod
    def from_config(
        cls, config: EngineConfig, loaded: LoadedModel | None = None, **kwargs: object
    ) -> Engine:
        """Load `config.model` through the disk cache (or take `loaded`, already on
        `config.device`: the device selection's checked model, workers/engine/device_select.py),
        prepare, warm, capture."""
        root = disk_cache.cache_root(config.cache_dir)
        disk_cache.configure_compile_caches(root)  # before the C++ ops build, before compiling
        linear_backends.use_disk_cache(root / "probes" / "linear_backends.json")
        inductor_setup.use_disk_cache(root / "probes")
        if loaded is None:
            dtype = getattr(torch, config.dtype) if config.dtype else None
            loaded = load_model(
                config.model, dtype=dtype, device=config.device, cache_dir=root / "weights"
            )
        prepared = prepare_model(loaded, config.preparation)  # the swaps, once
        engine = cls(prepared, config, **kwargs)  # type: ignore[arg-type]
        compiled, background = engine.compiled, config.compile_in_background
        if compiled is not None and background:
            # the languages first, eagerly (a warm-up step of <= compile_max_rows tokens must not
            # compile a graph in the foreground), then the background compile: its tracing holds
            # the GIL ~10 s a graph and starved a warm-up that ran beside it (Gemma 3 on the
            # Xeon: consuming 46 s after process start instead of ~20)
            compiled.ready = compiled.rows_ready = False
        elif compiled is not None:
            with prepared.bound(engine.kv_pools):  # warm-up writes the null block of its pools
                compiled.warm_up()
            release_openmp_pool()
        warm = [lang for lang in config.warm_languages if lang in engine.languages]
        if warm and config.warm_in_background:
            engine.warm_at_start = tuple(warm)  # submitted by start(), ahead of any request
        elif warm:
            engine.warm(warm)  # synchronous: the loop thread is not running yet
        if compiled is not None and background:
            compiled.warm_up_in_background()  # eager until ready (compiled.py)
        if engine.graphs is not None:
            with prepared.bound(engine.kv_pools):  # captured with this engine's pools bound
                engine.graphs.warm_up()
        return engine

    # -- submission (any thread) -----------------------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestHandle:
        handle = RequestHandle(request.request_id, self.cancel)
        self._handles[request.request_id] = handle
        self._inbox.put(request)
        self._wake.set()
        return handle

    def cancel(self, request_id: str) -> None:
        self._cancels.put(request_id)
        self._wake.set()

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        """Queue one translation; raises UnsupportedLanguage for an unknown pair."""
        return self.submit(self.generation_request(request))

    def generation_request(self, request: TranslationRequest) -> GenerationRequest:
        """The engine's request for one translation: its prompt built (`translation_request`)."""
        return self.translation_request(
            request.text,
            request.source_lang,
            request.target_lang,
            request_id=request.request_id,
            deadline=request.deadline,
            max_new_tokens=request.max_new_tokens,
            prompt_form=request.prompt_form,
            examples=request.examples,
            history=request.history,
            logprobs=request.logprobs,
            stop_below=request.stop_below,
        )

    def translation_request(
        self,
        text: str,
        source_lang: str,
        target_lang: str,
        *,
        request_id: str | None = None,
        deadline: float | None = None,
        max_new_tokens: int | None = None,
        ignore_eos: bool = False,
        prompt_form: str | None = None,
        examples: Sequence[tuple[str, str]] = (),
        history: Sequence[int] = (),
        logprobs: bool = False,
        stop_below: float | None = None,
    ) -> GenerationRequest:
        """`prompt_form`: a form of prompts.json (None: the engine's default form); the
        faithfulness wrapper retries a suspect translation with the template's retry form.
        `examples`: (source, target) pairs after the cached prefix, before the query (the
        retrieved translation-memory examples of workers/stages/examples/stage.py). `history`: token
        ids of
        the conversation so far (workers/stages/context/stage.py), between the cached prefix and the
        rest."""
        ids, prefix_len = self.prompts.build(text, source_lang, target_lang, prompt_form, examples)
        # a translation is about as long as its query (the prompt less its cached prefix;
        # retrieved examples count too): out ~0.85x that on the support mix (docs/BENCHMARKS.md)
        query_tokens = max(1, len(ids) - prefix_len)
        if history:
            ids[prefix_len:prefix_len] = history
        stop_nl = self.prompts.stop_rules.stop_at_newline and not ignore_eos
        params = SamplingParams(
            max_new_tokens=max_new_tokens or self.config.max_new_tokens,
            stop_at_newline=stop_nl,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            stop_below=stop_below if logprobs else None,
        )
        return GenerationRequest(
            request_id or uuid.uuid4().hex,
            ids,
            params,
            group=target_lang,
            deadline=deadline,
            expected_output_tokens=min(params.max_new_tokens, query_tokens),
        )

    def score_request(
        self,
        text: str,
        source_lang: str,
        target_lang: str,
        answer: str,
        *,
        request_id: str | None = None,
        deadline: float | None = None,
        prompt_form: str | None = None,
    ) -> GenerationRequest:
        """A request that scores `answer` as this model's translation of `text`: the prompt
        it would translate from, then the answer as the form's example turn shows one (its
        lead, e.g. the space after "German:"), scored by teacher forcing. The result's
        `logprob` is the answer tokens' mean log-probability: the cascade's deferral signal
        when a large model scores a small model's answer (one prefill, no decoding)."""
        ids, _ = self.prompts.build(text, source_lang, target_lang, prompt_form)
        frame = self.prompts.answer_frame(prompt_form)
        lead = frame[0] if frame is not None else " "
        answer_ids = self.tokenizer.encode(lead + answer, add_special_tokens=False)
        if not answer_ids:
            raise ValueError("nothing to score: the answer has no tokens")
        return GenerationRequest(
            request_id or uuid.uuid4().hex,
            [*ids, *answer_ids],
            SamplingParams(max_new_tokens=1, stop_at_newline=False),
            group=target_lang,
            deadline=deadline,
            expected_output_tokens=1,
            score_from=len(ids),
        )

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def stats_snapshot(self) -> EngineSnapshot:
        """KV use, prefix-cache hits, preemptions... at one instant, from any thread (the
        worker exports it: workers/engine/engine_snapshot.py)."""
        return snapshot_engine(self)

    # -- the loop --------------------------------------------------------------------------
    def start(self) -> None:
        """Run the step loop on its own thread (`tolk-engine`), with the caller's torch thread
        count; the caller's OpenMP pool is released first (see `workers.engine.threads`)."""
        if self._thread is None:
            self._stop.clear()
            if self.warm_at_start:  # first in the inbox: the loop's first step computes them
                self._submit_warm(self.warm_at_start)
                self.warm_at_start = ()
            n_threads = torch.get_num_threads()
            release_openmp_pool()
            self._thread = threading.Thread(
                target=self._loop, args=(n_threads,), name="tolk-engine", daemon=True
            )
            self._thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        if drain:
            end = None if timeout is None else time.monotonic() + timeout
            while self._handles and (end is None or time.monotonic() < end):
                time.sleep(0.01)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:  # the step in progress ends first: a daemon thread still in
            self._thread.join(timeout=120)  # torch at exit aborts the process (issue 26, soak)
            self._thread = None

    def _loop(self, n_threads: int) -> None:
        use_threads(n_threads)
        pooled = True  # this thread holds an OpenMP pool (or may: it ran torch work)
        while not self._stop.is_set():
            self.loop_heartbeat = time.monotonic()  # a step that never returns stops this
            self._switch_when_idle()
            yielding = self.yields_to is not None and self.yields_to()
            if yielding or (not self._drain_inbox() and not self.scheduler.has_work()):
                if pooled and self.config.release_pool_when_idle:
                    release_openmp_pool()  # idle: no threads held beside the other engine's
                    pooled = False
                self._wake.wait(YIELD_POLL_S if yielding else 0.05)
                self._wake.clear()
                continue
            pooled = True
            try:
                self.step()
            except Exception as exc:  # a failed step fails its requests, never the thread
                log.exception("engine step failed")
                self.results.fail_all(f"{type(exc).__name__}: {exc}")

    def _drain_inbox(self) -> bool:
        got = False
        while True:
            try:
                self.scheduler.add_request(self._inbox.get_nowait())
                got = True
            except queue.Empty:
                break
        while True:
            try:
                self.scheduler.cancel(self._cancels.get_nowait())
            except queue.Empty:
                break
        return got

    def has_unfinished(self) -> bool:
        return bool(self._handles)

    def run_until_done(self) -> None:
        """Synchronous driving (tests, benchmarks): step until every submitted request is done."""
        while self.has_unfinished():
            self.step()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Run `requests` to completion on the calling thread (not with the loop running)."""
        handles = [self.submit(r) for r in requests]
        try:
            self.run_until_done()
        finally:
            release_openmp_pool()  # the engine thread may take over next (see threads.py)
        return [h.result(0) for h in handles]

    def warm(self, languages: Sequence[str]) -> None:
        """Compute each language's prompt prefix once so its blocks sit in the prefix cache;
        a language counts as warmed only if its prefix request finished (as `_submit_warm`)."""
        results = self.generate([self._warm_request(lang) for lang in languages])
        self.warmed_languages.update(
            lang for lang, result in zip(languages, results, strict=True) if result.ok
        )

    def _warm_request(self, lang: str) -> GenerationRequest:
        ids = self.prompts.prefix_ids(lang)
        rid = f"warm-{lang}-{uuid.uuid4().hex[:8]}"
        return GenerationRequest(rid, ids, SamplingParams(max_new_tokens=1))

    def _submit_warm(self, languages: Sequence[str]) -> None:
        """`warm` without waiting (`warm_in_background`): each language counts as warmed when
        its prefix request finishes on the loop thread."""

        def warmed(lang: str) -> Callable[[GenerationResult], None]:
            def note(result: GenerationResult) -> None:
                if result.ok:
                    self.warmed_languages.add(lang)

            return note

        for lang in languages:
            self.submit(self._warm_request(lang)).add_done_callback(warmed(lang))

    # -- a change of model side (the tuner's) ----------------------------------------------
    MODEL_SIDE = (
        "prepared", "loaded", "model", "lm_screen", "sampler", "device", "kv_dtype",
        "kv_pools", "kv", "compiled", "graphs", "drafter", "warmed_languages",
    )  # fmt: skip

    def switch_to(self, other: Engine) -> threading.Event:
        """Serve from now on with `other`'s model side (`MODEL_SIDE`: its weights, KV pools and
        prefix cache, compiled graphs, drafter; `other` built from the same model file, warmed,
        never started) and its config; the scheduler, queue, handles and statistics stay.

        Any thread. The change happens on the engine's thread at the first step boundary with
        no sequence running or preempted: meanwhile the scheduler holds the queue's requests
        back (`Scheduler.hold_newcomers`), so no request is dropped and none is computed by
        two models (its KV cache would mix them). The returned event is set once switched."""
        if other.config.model != self.config.model:
            raise ValueError(f"switch_to: {other.config.model!r} is not {self.config.model!r}")
        done = threading.Event()
        self._pending_switch = (other, done)
        self._wake.set()
        return done

    def _switch_when_idle(self) -> None:
        pending = self._pending_switch
        if pending is None:
            return
        sched = self.scheduler
        sched.hold_newcomers = True
        if sched.running or sched.preempted:
            return  # they finish on the model that started them
        other, done = pending
        for name in self.MODEL_SIDE:
            setattr(self, name, getattr(other, name))
        self.config = other.config
        self.runner = self._model_step()  # the forward over the new model side
        sched.kv = self.kv
        sched.config = replace(sched.config, max_num_seqs=other.config.max_num_seqs)
        self._pending_switch = None
        sched.hold_newcomers = False
        done.set()

    # -- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[GenerationResult]:
        started = time.perf_counter()
        self._drain_inbox()
        self._switch_when_idle()
        out = self.scheduler.schedule()
        sampled: dict[str, list[int]] = {}
        if out.chunks:
            t0 = time.perf_counter()
            sampled = self._run_model(out)
            seconds = time.perf_counter() - t0
            stats, kind = self.stats, step_kind(out)
            stats.step_seconds += seconds
            stats.steps += 1
            stats.steps_by_kind[kind] = stats.steps_by_kind.get(kind, 0) + 1
            stats.seconds_by_kind[kind] = stats.seconds_by_kind.get(kind, 0.0) + seconds
            # the tuner's record of the configuration's decode speed (workers/engine/tuner.py):
            # not the eager steps served while its graphs compile in the background
            warming = self.compiled is not None and not self.compiled.ready
            if kind == "decode" and not warming and not any(c.draft for c in out.chunks):
                n, total = stats.decode_by_batch.get(len(out.chunks), (0, 0.0))
                stats.decode_by_batch[len(out.chunks)] = (n + 1, total + seconds)
        finished = self.scheduler.update_from_output(out, sampled, self.results.stop_check)
        self.results.account(out, sampled)
        if self.drafter is not None:  # the next step's drafts, from the tokens known now
            self.drafter.propose(self.scheduler.running)
        results = [self.results.finish(seq) for seq in finished]
        if self.step_trace is not None and out.chunks:
            self.step_trace.append(step_record(out, time.perf_counter() - started))
        return results

    def _run_model(self, out: SchedulerOutput) -> dict[str, list[int]]:
        # this engine's KV pools in the model; engines sharing the model take turns per step
        with self.prepared.bound(self.kv_pools):
            return self.runner.run(out)
