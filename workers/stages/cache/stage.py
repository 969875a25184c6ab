"""`CachingEngine`: a `TranslationEngine` that answers repeated texts from the exact-match cache.

Its place in the pipeline is workers/serving/pipeline.py's: around faithfulness, span
protection and retrieved examples (a hit skips them), inside conversation context and drills.
Per request (`submit_translation`, on the worker's poll thread):

1. The key (`workers.stages.cache.key`): engine fingerprint (model version, arm, the stages
   inside with their `key_note`s, runtime variant), prompt-set version, the engine's default
   prompt form, languages, normalized text. Texts longer than
   `max_text_chars` bypass the cache (straight to the engine, no note).
2. L1 (`workers.stages.cache.lru_k.LanguageLRUK`, in this process), then L2
   (`workers.stages.cache.redis_l2`, Redis behind a circuit breaker). A hit returns a handle
   already resolved: status OK (STOP), the cached text, no tokens, `timings.total_s` = the
   look-up time, and the note `tolk.cache` = `l1` / `l2` (copied into the reply's metadata by
   `workers.kafka.replies`). An L2
   hit is copied into L1.
3. A miss runs once however many identical requests arrive meanwhile (single flight): the
   first starts a "flight", the inner engine's run under its own request id; the others join
   it. When the run ends every participant gets its result under its own request id, noted
   `tolk.cache` = `miss` (the one whose id ran) or `joined` (tokens counted once: a joined
   answer reports none). A result that `workers.stages.cache.policy.is_cacheable` accepts (OK by a
   stop rule, not flagged or retried by a stage: its declared fields) goes into L1 at once
   and into L2 through a writer thread (`workers.stages.cache.write_behind`: the engine's
   thread never waits on Redis).
4. A run that ended EXPIRED, REJECTED or CANCELLED does not speak for the joined requests (a
   later deadline, another cancel): those still live start a new flight among themselves. A
   failed run (ERROR) is passed to every participant: the worker's retry rules apply to each,
   and their reruns meet in one flight again.

Cancel (the worker cancels on a drain timeout) detaches one participant, answered CANCELLED
at once; the inner run is cancelled only when no participant is left.

Counts: per target language, hits per tier, misses (inner runs), joins, L1 evictions, hit
look-up time (`tolk_cache_*` once the worker binds its metrics, `bind_metrics`, and always in
`CachingEngine.counts`); L2 outages in `tolk_cache_l2_degraded_total{op}` and
`tolk_cache_l2_up`. `tolk worker` turns it on unless `--no-cache` / `TOLK_CACHE=0`; the builder
(workers/serving/pipeline.py) configures it from the settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from workers import reply_metadata as meta
from workers.engine.types import (
    FinishReason,
    GenerationResult,
    RequestHandle,
    Timings,
    TranslationEngine,
    TranslationRequest,
)
from workers.stages.cache.answers import NOT_FOR_THE_OTHERS, answer_as, cancelled, failed
from workers.stages.cache.key import CacheKey, cache_key
from workers.stages.cache.lru_k import LanguageLRUK
from workers.stages.cache.policy import is_cacheable
from workers.stages.cache.redis_l2 import CacheBreaker, CacheUnavailable, TranslationStore
from workers.stages.cache.write_behind import WriteBehind
from workers.stages.wrapper import EngineWrapper

__all__ = ["CachingEngine", "engine_fingerprint"]

log = logging.getLogger(__name__)

DEFAULT_MAX_TEXT_CHARS = 2000  # longer texts are rarely repeated; not worth the memory


class _CacheMetrics(Protocol):
    cache_hits_total: Any  # Counter (lang, tier)
    cache_misses_total: Any  # Counter (lang)
    cache_joined_total: Any  # Counter (lang)
    cache_evictions_total: Any  # Counter (lang)
    cache_hit_seconds: Any  # Histogram (lang)
    cache_l2_degraded_total: Any  # Counter (op)
    cache_l2_up: Any  # Gauge
    redis_retries_total: Any  # Counter (store, op)


@dataclass(slots=True)
class _Waiter:
    """One request waiting on a flight."""

    request: TranslationRequest
    handle: RequestHandle  # what the worker holds

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class _Flight:
    """One inner run and every request waiting for it."""

    key: CacheKey
    request: TranslationRequest  # the request that started it: its text and cap run
    run_id: str  # the request id the inner run goes under
    waiters: dict[str, _Waiter] = field(default_factory=dict)  # request id -> waiter
    inner: RequestHandle | None = None
    done: bool = False


def engine_fingerprint(model_version: str, layers: Sequence[object], variant: str = "") -> str:
    """`<model version>|<stage>><stage>>...|<variant>`: what the key says about the engine
    below the cache; `layers`: the stages below it, outermost first, and the engine last (the
    builder's list, workers/serving/pipeline.py). A stage whose output depends on its own
    settings says so in its `key_note` (the retrieved-examples stage: k and a digest of its TM)."""
    chain = []
    for layer in layers:
        note = layer.key_note if isinstance(layer, EngineWrapper) else ""
        chain.append(type(layer).__name__ + (f"[{note}]" if note else ""))
    return f"{model_version}|{'>'.join(chain)}|{variant}"


class CachingEngine(EngineWrapper):
    """Wraps a `TranslationEngine` with the two-tier exact-match cache (module notes)."""

    def __init__(
        self,
        inner: TranslationEngine,
        *,
        l1_capacity: int,
        l1_shares: Mapping[str, float],
        l2: TranslationStore | None,
        prompt_set_version: str,
        fingerprint: str = "",
        prompt_form: str = "",
        max_text_chars: int = DEFAULT_MAX_TEXT_CHARS,
        l2_retry_after_s: float = 1.0,
        l2_patience_s: float = 0.0,
        metrics: _CacheMetrics | None = None,
    ) -> None:
        """`fingerprint`: `engine_fingerprint` of what is below (default: `inner` alone);
        `prompt_form`: the engine's default prompt form (an EngineConfig.prompt_form override
        changes the answers)."""
        self.inner = inner
        self.fingerprint = fingerprint or engine_fingerprint(inner.model_version, [inner])
        self.prompt_set_version = prompt_set_version
        self.prompt_form = prompt_form
        self.max_text_chars = max_text_chars
        self._metrics = metrics
        self.l1: LanguageLRUK[str] = LanguageLRUK(l1_capacity, l1_shares, self._evicted)
        self.l2 = (
            None
            if l2 is None
            else CacheBreaker(
                l2,
                on_degraded=self._l2_degraded,
                on_state=self._l2_state,
                retry_after_s=l2_retry_after_s,
                patience_s=l2_patience_s,
                on_retry=self._l2_retried,
            )
        )
        self._lock = threading.Lock()
        self._flights: dict[CacheKey, _Flight] = {}
        self._by_request: dict[str, _Flight] = {}  # request id -> the flight it waits on
        self.counts: Counter[tuple[str, str]] = Counter()  # (lang, outcome) -> count
        self._l2_writes = WriteBehind(self._put_l2, on_dropped=lambda: self._l2_degraded("put"))

    # -- TranslationEngine -------------------------------------------------------------------

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        self.inner.stop(drain=drain, timeout=timeout)
        self._l2_writes.stop()

    def bind_metrics(self, metrics: _CacheMetrics) -> None:
        """Count in the worker's `tolk_cache_*` from now on."""
        self._metrics = metrics
        metrics.cache_l2_up.set(0 if self.l2 is None or self.l2.degraded else 1)

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        """Answer from L1 / L2, join the identical request in flight, or run the engine.

        The conversation id is not part of the key: only context-free requests come here (the
        context stage sends a turn with history around the cache, `uncached`), and their
        answer does not depend on the conversation. It goes on to the inner run the request
        starts; a request that joins a flight shares that run, under the starter's id."""
        t0 = time.perf_counter()
        request_id, text = request.request_id, request.text
        source_lang, target_lang = request.source_lang, request.target_lang
        if len(text) > self.max_text_chars:
            self._count(target_lang, "bypass")
            return self.inner.submit_translation(request)
        key = cache_key(
            engine_fingerprint=self.fingerprint,
            prompt_set_version=self.prompt_set_version,
            source_lang=source_lang,
            target_lang=target_lang,
            text=text,
            prompt_form=self.prompt_form,
        )
        cached = self.l1.get(target_lang, key)
        if cached is not None:
            return self._hit(request_id, key, cached, "l1", t0)
        waiter = _Waiter(request, RequestHandle(request_id, self._cancel))
        if self._join(key, waiter):
            return waiter.handle
        if self.l2 is not None:
            try:
                cached = self.l2.get(key)
            except CacheUnavailable:
                cached = None
            if cached is not None:
                self.l1.put(target_lang, key, cached)
                return self._hit(request_id, key, cached, "l2", t0)
        flight = _Flight(key, request, request_id)
        self._fly(flight, waiter)
        return waiter.handle

    # -- hits ---------------------------------------------------------------------------------

    def _hit(
        self, request_id: str, key: CacheKey, text: str, tier: str, t0: float
    ) -> RequestHandle:
        elapsed = time.perf_counter() - t0
        handle = RequestHandle(request_id, lambda _rid: None)  # done already: nothing to cancel
        handle.set_result(
            GenerationResult(
                request_id=request_id,
                token_ids=[],
                text=text,
                finish_reason=FinishReason.STOP,
                timings=Timings(total_s=elapsed),
                notes={meta.CACHE: tier},
                cache_tier=tier,
            )
        )
        self._count(key.target_lang, tier)
        if self._metrics is not None:
            self._metrics.cache_hits_total.labels(lang=key.target_lang, tier=tier).inc()
            self._metrics.cache_hit_seconds.labels(lang=key.target_lang).observe(elapsed)
        return handle

    # -- flights ------------------------------------------------------------------------------

    def _join(self, key: CacheKey, waiter: _Waiter) -> bool:
        """Join the flight of `key` if one is in the air; False when there is none."""
        with self._lock:
            flight = self._flights.get(key)
            if flight is None or flight.done:
                return False
            flight.waiters[waiter.request_id] = waiter
            self._by_request[waiter.request_id] = flight
        self._count(key.target_lang, "joined")
        if self._metrics is not None:
            self._metrics.cache_joined_total.labels(lang=key.target_lang).inc()
        return True

    def _fly(self, flight: _Flight, waiter: _Waiter) -> None:
        """Start `flight`'s inner run with `waiter` aboard (or join one that just started)."""
        with self._lock:
            current = self._flights.get(flight.key)
            if current is not None and not current.done:  # another thread was faster
                current.waiters[waiter.request_id] = waiter
                self._by_request[waiter.request_id] = current
                return
            flight.waiters[waiter.request_id] = waiter
            self._flights[flight.key] = flight
            self._by_request[waiter.request_id] = flight
        lang = flight.key.target_lang
        self._count(lang, "miss")
        if self._metrics is not None:
            self._metrics.cache_misses_total.labels(lang=lang).inc()
        try:
            inner = self.inner.submit_translation(
                dataclasses.replace(
                    flight.request,
                    request_id=flight.run_id,
                    deadline=waiter.request.deadline,
                    conversation_id=waiter.request.conversation_id,
                )
            )
        except Exception as exc:
            others = self._land(flight)
            others.pop(waiter.request_id, None)
            for other in others.values():  # joined meanwhile: refused with the same reason
                other.handle.set_result(failed(other.request_id, f"engine refused: {exc!r}"))
            raise
        with self._lock:
            flight.inner = inner
            orphaned = not flight.waiters  # every participant cancelled meanwhile
        if orphaned:
            inner.cancel()
        inner.add_done_callback(lambda result: self._on_run_done(flight, result))

    def _land(self, flight: _Flight) -> dict[str, _Waiter]:
        """The flight is over: out of the tables; its waiters."""
        with self._lock:
            flight.done = True
            if self._flights.get(flight.key) is flight:
                del self._flights[flight.key]
            waiters = dict(flight.waiters)
            for rid in waiters:
                if self._by_request.get(rid) is flight:
                    del self._by_request[rid]
        return waiters

    def _on_run_done(self, flight: _Flight, result: GenerationResult) -> None:
        """The inner run ended (engine thread): cache it, answer everyone (module notes)."""
        if is_cacheable(result):
            self.l1.put(flight.key.target_lang, flight.key, result.text)
            self._write_l2(flight.key, result.text)
        waiters = self._land(flight)
        retry: list[_Waiter] = []
        for rid, waiter in waiters.items():
            mine = rid == flight.run_id
            if not mine and result.finish_reason in NOT_FOR_THE_OTHERS:
                retry.append(waiter)
                continue
            waiter.handle.set_result(answer_as(result, rid, "miss" if mine else "joined"))
        if retry:
            self._refly(flight, retry, result)

    def _refly(self, flight: _Flight, waiters: list[_Waiter], result: GenerationResult) -> None:
        """Joined requests whose run ended EXPIRED / REJECTED / CANCELLED for the one that
        ran: the live ones fly again together; those past their deadline get the result."""
        now = time.monotonic()
        live = []
        for w in waiters:
            if w.request.deadline is not None and now >= w.request.deadline:
                w.handle.set_result(answer_as(result, w.request_id, "joined"))
            else:
                live.append(w)
        if not live:
            return
        first, rest = live[0], live[1:]
        again = _Flight(flight.key, flight.request, first.request_id)
        try:
            self._fly(again, first)
        except Exception as exc:
            for w in live:
                w.handle.set_result(failed(w.request_id, f"engine refused: {exc!r}"))
            return
        for w in rest:
            if not self._join(flight.key, w):  # that flight ended already: a new one
                self._refly(flight, [w], result)

    def _cancel(self, request_id: str) -> None:
        with self._lock:
            flight = self._by_request.pop(request_id, None)
            if flight is None:
                return
            waiter = flight.waiters.pop(request_id, None)
            inner = flight.inner if not flight.waiters else None
        if waiter is not None:
            waiter.handle.set_result(cancelled(request_id))
        if inner is not None:
            inner.cancel()  # nobody waits for this run any more

    # -- L2 writes ----------------------------------------------------------------------------

    def _write_l2(self, key: CacheKey, text: str) -> None:
        if self.l2 is not None:
            self._l2_writes.write(key, text)

    def _put_l2(self, key: CacheKey, text: str) -> None:  # the writer thread
        assert self.l2 is not None
        with contextlib.suppress(CacheUnavailable):  # counted by the breaker; L1 has it
            self.l2.put(key, text)

    def flush_l2_writes(self, timeout: float = 5.0) -> bool:
        """Wait until the writer thread has sent every queued L2 write (tests, benchmarks)."""
        return self._l2_writes.flush(timeout)

    # -- counts -------------------------------------------------------------------------------

    def _count(self, lang: str, outcome: str) -> None:
        with self._lock:
            self.counts[(lang, outcome)] += 1

    def _evicted(self, lang: str) -> None:
        self._count(lang, "evicted")
        if self._metrics is not None:
            self._metrics.cache_evictions_total.labels(lang=lang).inc()

    def _l2_degraded(self, op: str) -> None:
        if self._metrics is not None:
            self._metrics.cache_l2_degraded_total.labels(op=op).inc()

    def _l2_retried(self, op: str) -> None:
        if self._metrics is not None:
            self._metrics.redis_retries_total.labels(store="l2", op=op).inc()

    def _l2_state(self, up: bool) -> None:
        if self._metrics is not None:
            self._metrics.cache_l2_up.set(1 if up else 0)
