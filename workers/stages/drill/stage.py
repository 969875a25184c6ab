"""`DrillEngine`: a canary made bad on purpose, for tests and rollback drills.

An arm option that is off unless a flag whose name says what it does is given:

    tolk worker --arm v2 --drill-inject-latency de:1.0:3000   # every German reply 3 s later
    tolk worker --arm v2 --drill-inject-errors fr:0.2          # a fifth of French runs fail

It is the outermost stage (workers/serving/pipeline.py): around the cache and the context
stage, so a cache hit and a turn
with history are drilled like any other reply of the arm. A request of a drilled language is
hit when its bucket (`workers.arms.bucket` of the request id, so the same request is hit on
every run and every redelivery) is below the fraction. A latency hit
holds the finished result for the given milliseconds before handing it over (on a timer thread,
so the engine keeps stepping): the reply's latency grows by that much and an OK past the
deadline goes out EXPIRED, as with a slow model. An error hit turns the result into an ERROR
("drill: injected error"), which the worker treats like any engine failure (retried, then
dead-lettered as poison and answered ERROR). Every hit is logged at WARNING once per 100 hits
and carries `tolk.drill` in the reply's metadata, so a drilled reply is never mistaken for a
real one.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from workers import reply_metadata as meta
from workers.arms import bucket
from workers.engine.types import (
    FinishReason,
    GenerationResult,
    RequestHandle,
    TranslationEngine,
    TranslationRequest,
)
from workers.stages.wrapper import EngineWrapper

__all__ = ["DRILL_NOTE_KEY", "DrillEngine", "DrillFault", "parse_drill"]

log = logging.getLogger(__name__)

DRILL_NOTE_KEY = meta.DRILL  # the reply metadata key (workers/reply_metadata.py)


@dataclass(frozen=True, slots=True)
class DrillFault:
    """One injected fault: `kind` ("latency" | "error") for `fraction` of `lang`'s requests."""

    kind: str
    lang: str
    fraction: float  # 0..1
    latency_ms: float = 0.0  # latency faults only

    def hits(self, lang: str, request_id: str) -> bool:
        return lang == self.lang and bucket(request_id) < self.fraction * 100


def parse_drill(kind: str, spec: str) -> DrillFault:
    """`"de:1.0:3000"` (latency: lang, fraction, ms) or `"fr:0.2"` (error: lang, fraction)."""
    parts = [p.strip() for p in spec.split(":")]
    want = 3 if kind == "latency" else 2
    if kind not in ("latency", "error") or len(parts) != want:
        form = "lang:fraction:ms" if kind == "latency" else "lang:fraction"
        raise ValueError(f"drill {kind} {spec!r}: expected {form}")
    try:
        fraction = float(parts[1])
        latency = float(parts[2]) if kind == "latency" else 0.0
    except ValueError:
        raise ValueError(f"drill {kind} {spec!r}: not a number") from None
    if not 0 < fraction <= 1 or latency < 0:
        raise ValueError(f"drill {kind} {spec!r}: fraction in (0, 1], latency >= 0")
    return DrillFault(kind, parts[0], fraction, latency)


class DrillEngine(EngineWrapper):
    """Wraps a `TranslationEngine`; injects the configured faults into its results."""

    def __init__(self, inner: TranslationEngine, faults: Sequence[DrillFault]) -> None:
        self.inner = inner
        self.faults = tuple(faults)
        self.hits: Counter[tuple[str, str]] = Counter()  # (lang, kind) -> count
        self._lock = threading.Lock()

    def start(self) -> None:
        for f in self.faults:
            log.warning(
                "DRILL: %s on %.0f%% of %s requests%s",
                f.kind,
                f.fraction * 100,
                f.lang,
                f" (+{f.latency_ms:.0f} ms)" if f.kind == "latency" else "",
            )
        self.inner.start()

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        inner = self.inner.submit_translation(request)
        request_id = request.request_id
        faults = [f for f in self.faults if f.hits(request.target_lang, request_id)]
        if not faults:
            return inner
        handle = RequestHandle(request_id, lambda _rid: inner.cancel())
        inner.add_done_callback(lambda result: self._inject(handle, faults, result))
        return handle

    def _inject(
        self, handle: RequestHandle, faults: list[DrillFault], result: GenerationResult
    ) -> None:
        delay_ms = sum(f.latency_ms for f in faults if f.kind == "latency")
        notes = {**result.notes, DRILL_NOTE_KEY: "+".join(sorted({f.kind for f in faults}))}
        result = dataclasses.replace(result, notes=notes)
        if result.ok and any(f.kind == "error" for f in faults):
            result = dataclasses.replace(
                result, finish_reason=FinishReason.ERROR, text="", error="drill: injected error"
            )
        lang = faults[0].lang
        with self._lock:
            for f in faults:
                self.hits[(lang, f.kind)] += 1
            total = sum(self.hits.values())
        if total % 100 == 1:
            log.warning("DRILL: %d results changed so far (%s)", total, dict(self.hits))
        if delay_ms > 0:
            timer = threading.Timer(delay_ms / 1000, handle.set_result, args=(result,))
            timer.daemon = True
            timer.start()
        else:
            handle.set_result(result)
