"""The serving pipeline: `build_served_engine`, the one place that composes the serving stages
around the fair engine, in the order of `STAGES`.

Each stage is a `TranslationEngine` that wraps the one inside it (workers/stages/wrapper.py)
and changes how a request (`workers.engine.types.TranslationRequest`) is submitted or
answered. Their order is part of what each one means, so it is declared here, once; `tolk
worker`, `tolk demo`, the benchmarks and the tests only choose which are on and with what
(`ServingOptions`, one frozen tree with a section per stage: workers/serving/options.py; each
factory below reads its own section). From the outside in:

1. drills (`--drill-inject-latency|errors`, workers/stages/drill/stage.py): outermost, so that every
   reply of the arm is drilled as the flag says: cache hits, and contextual turns, which go
   around everything the context stage wraps (the drill once sat inside the context stage,
   and a context arm's turns with history skipped it: a rollback drill injected less than it
   said). The drill changes what the arm replies, not what the model did: a drilled turn's
   real answer is still the conversation's history (as a cache entry it was already).
2. conversation context (`--context`, workers/stages/context/stage.py): it sends a turn with history
   to `uncached` (what the cache wraps: the cache must not answer it nor keep its answer) and
   any other turn through the cache;
3. the exact-match cache (`--cache`, workers/stages/cache/stage.py): a hit skips 4-6; its key names
   the stages below it (`engine_fingerprint`), so an arm with other stages never shares an
   entry;
4. span protection (`--protect-spans`, workers/stages/protected/stage.py): it masks before the
   faithfulness checks see the answer, and its unmasked retry is checked too;
5. faithfulness (`--faithful`, workers/stages/faithful/stage.py): its retry asks for the template's
   other prompt form (`retry_form`, given here from the engine's prompt builder);
6. retrieved examples (`--tm-examples`, workers/stages/examples/stage.py): it puts the examples
   into the request, so the faithfulness retry shows the same ones;
7. the quality-aware cascade (`--cascade`, workers/stages/cascade/stage.py): innermost, around
   the small model's fair engine: a doubted answer is translated again by the large model,
   and faithfulness (outside) checks whichever answer goes out.

Nothing else constructs a stage (tests/workers/test_pipeline.py checks the source). What the
worker reads of the engine besides the request path (the fair queue's snapshot, the engine's
stats, heartbeat and warm languages) the `ServedEngine` gives it explicitly; no stage lets
attributes of the engine inside show through.

Adding a stage: docs/ARCHITECTURE.md, "Adding a stage".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workers.engine.types import (
    GenerationRequest,
    RequestHandle,
    RequestQueue,
    TranslationEngine,
    TranslationRequest,
)
from workers.serving.fair_engine import FairEngine
from workers.serving.options import (
    CacheOptions,
    ContextOptions,
    DrillOptions,
    FaithfulOptions,
    ServingOptions,
)
from workers.stages.wrapper import EngineWrapper

if TYPE_CHECKING:
    from workers.engine.autoconfig import ConfigReport
    from workers.engine.prompts import PromptBuilder
    from workers.metrics_stages import StageMetrics

__all__ = [
    "STAGES",
    "CacheOptions",
    "ContextOptions",
    "DrillOptions",
    "FaithfulOptions",
    "ServedEngine",
    "ServingOptions",
    "Stage",
    "build_served_engine",
]


@dataclass(slots=True)
class Build:
    """What a stage's factory gets besides the engine it wraps."""

    options: ServingOptions
    core: TranslationEngine  # the fair engine (or a test's engine)
    prompts: PromptBuilder | None  # the engine's prompt builder (None for an engine without one)
    base: object = None  # the Engine that builds the prompts (None for a test's engine)
    below: dict[str, TranslationEngine] = field(default_factory=dict)  # stage -> what it wraps
    layers: list[TranslationEngine] = field(default_factory=list)  # built so far, inside out


@dataclass(frozen=True, slots=True)
class Stage:
    """One serving stage: its name, whether `options` turn it on, and its factory."""

    name: str
    wanted: Callable[[ServingOptions], bool]
    wrap: Callable[[TranslationEngine, Build], TranslationEngine]


def _drills(inner: TranslationEngine, b: Build) -> TranslationEngine:
    from workers.stages.drill.stage import DrillEngine, parse_drill

    latency, errors = b.options.drill.latency, b.options.drill.errors
    faults = [parse_drill("latency", s) for s in latency] + [
        parse_drill("error", s) for s in errors
    ]
    return DrillEngine(inner, faults)


def _context(inner: TranslationEngine, b: Build) -> TranslationEngine:
    from workers.stages.context.rules import ConversationMemory
    from workers.stages.context.stage import ContextEngine

    if b.prompts is None:
        raise ValueError("conversation context needs the engine's prompt builder")
    c = b.options.context
    memory = ConversationMemory(c.tokens, idle_s=c.idle_s, layout=c.layout)
    # a turn with history goes around the cache: to what the cache wraps, if it is on
    uncached = b.below.get("cache", inner)
    return ContextEngine(inner, prompts=b.prompts, memory=memory, uncached=uncached)


def _cache(inner: TranslationEngine, b: Build) -> TranslationEngine:
    from workers.engine.prompts import prompt_set_version
    from workers.stages.cache.redis_l2 import RedisTranslationCache
    from workers.stages.cache.stage import CachingEngine, engine_fingerprint

    c = b.options.cache
    timeout_s, patience_s = c.timeouts_s
    l2 = c.l2
    if l2 is None:
        l2 = RedisTranslationCache(c.redis_url, c.ttl, socket_timeout_s=timeout_s)
    arm = f"arm={c.arm}" if c.arm else ""
    variant = ",".join(v for v in (arm, c.variant) if v)
    return CachingEngine(
        inner,
        l1_capacity=c.l1_entries,
        l1_shares={lang: 1.0 for lang in c.languages},
        l2=l2,
        prompt_set_version=prompt_set_version(),
        fingerprint=engine_fingerprint(inner.model_version, b.layers[::-1], variant),
        prompt_form=b.prompts.default_form if b.prompts is not None else "",
        l2_patience_s=patience_s,
    )


def _protect_spans(inner: TranslationEngine, b: Build) -> TranslationEngine:
    from workers.stages.protected.stage import ProtectedSpansEngine

    return ProtectedSpansEngine(inner)


def _faithful(inner: TranslationEngine, b: Build) -> TranslationEngine:
    from workers.stages.faithful.stage import FaithfulEngine

    retry_form = b.prompts.retry_form if b.prompts is not None else None
    f = b.options.faithful
    return FaithfulEngine(
        inner, policy=f.policy, default_max_new_tokens=f.max_new_tokens, retry_form=retry_form
    )


def _examples(inner: TranslationEngine, b: Build) -> TranslationEngine:
    from workers.stages.examples.stage import RetrievedExamplesEngine

    assert b.options.examples is not None  # `wanted` says so
    return RetrievedExamplesEngine(inner, b.options.examples)


def _cascade(inner: TranslationEngine, b: Build) -> TranslationEngine:
    from workers.stages.cascade.accounting import FairScoring
    from workers.stages.cascade.stage import CascadeEngine

    setup = b.options.cascade
    assert setup is not None  # `wanted` says so
    scorer = getattr(b.base, "score_request", None)  # the small model's Engine's
    if hasattr(b.base, "has_unfinished") and hasattr(setup.large, "yields_to"):
        # the large model steps only while the small one has nothing to do: the small answers
        # (most requests) never share the cores with a 1.5B step; a deferred run waits for
        # the small model's gaps, within its deadline (stage notes, step 5)
        setup.large.yields_to = b.base.has_unfinished
    charge = None
    if isinstance(b.core, FairEngine):  # score and charge through the small model's fair share
        scorer = FairScoring(scorer, b.core.submit) if scorer is not None else None
        charge = _queue_charge(b.core.queue)
    return CascadeEngine(
        inner,
        large=setup.large,
        thresholds=setup.thresholds,
        small_scorer=scorer,
        charge=charge,
        early=setup.early,
    )


def _queue_charge(queue: RequestQueue) -> Callable[[str, int, int], None]:
    """`queue.charge` by language (the fair queue charges a request's group)."""

    def charge(lang: str, prefill_tokens: int, output_tokens: int) -> None:
        queue.charge(GenerationRequest("~cascade-charge", [], group=lang), prefill_tokens,
                     output_tokens)  # fmt: skip

    return charge


# The order, from the outside in (module notes): the one list.
STAGES: tuple[Stage, ...] = (
    Stage("drill", lambda o: bool(o.drill.latency or o.drill.errors), _drills),
    Stage("context", lambda o: o.context.on, _context),
    Stage("cache", lambda o: o.cache.on, _cache),
    Stage("protect_spans", lambda o: o.protect_spans, _protect_spans),
    Stage("faithful", lambda o: o.faithful.on, _faithful),
    Stage("examples", lambda o: o.examples is not None, _examples),
    Stage("cascade", lambda o: o.cascade is not None, _cascade),
)


class ServedEngine(EngineWrapper):
    """What the worker serves: the outermost stage's request path (the pass-through of
    `EngineWrapper`), the stages by name, and what the worker reads of the engine inside,
    given explicitly."""

    def __init__(
        self,
        entry: TranslationEngine,
        core: TranslationEngine,
        base: object,
        stages: dict[str, TranslationEngine],
    ) -> None:
        self.inner = entry  # the outermost stage (the core when no stage is on)
        self.core = core
        self.base = base  # the Engine that builds the prompts (None for a test's engine)
        self.stages = stages  # name -> stage, as built
        fair = core if isinstance(core, FairEngine) else None
        # read by the worker's gauges (workers/worker.py): None where the engine has none
        self.queue_snapshot = fair.queue_snapshot if fair is not None else None
        self.stats_snapshot = getattr(fair or base, "stats_snapshot", None)

    @property
    def entry(self) -> TranslationEngine:
        return self.inner

    def stage(self, name: str) -> Any:  # each stage is its own class: the caller knows which
        """The stage `name` as built (KeyError when it is off)."""
        return self.stages[name]

    # the health probe's (workers/health.py); None for an engine that does not report them
    @property
    def warmed_languages(self) -> set[str] | None:
        return getattr(self.base, "warmed_languages", None)

    @property
    def loop_heartbeat(self) -> float | None:
        return getattr(self.base, "loop_heartbeat", None)

    @property
    def config_report(self) -> ConfigReport | None:
        return getattr(self.base, "config_report", None)

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        return self.inner.submit_translation(request)

    def set_cache_variant(self, variant: str) -> None:
        """Key the cache's answers from now on by `variant` (the weight format, e.g.
        "quantize=int8"), after the engine moved to another configuration without a restart
        (workers/engine/tuner.py): the fingerprint's runtime variant replaced, the arm kept."""
        cache = self.stages.get("cache")
        if cache is None:
            return
        head, _, old = cache.fingerprint.rpartition("|")  # type: ignore[attr-defined]
        parts = [v for v in old.split(",") if v.startswith("arm=")] + ([variant] if variant else [])
        cache.fingerprint = f"{head}|{','.join(parts)}"  # type: ignore[attr-defined]

    def bind_metrics(self, metrics: StageMetrics) -> None:
        """Every stage counts in the worker's metrics from now on."""
        for stage in self.stages.values():
            stage.bind_metrics(metrics)  # type: ignore[attr-defined]


def build_served_engine(
    core: TranslationEngine,
    options: ServingOptions,
    *,
    base: object = None,
    stages: Sequence[Stage] = STAGES,
) -> ServedEngine:
    """`core` (the fair engine) in the stages `options` turn on, in the order of `stages`
    (outermost first; `STAGES` unless a test adds one). `base`: the engine that builds the
    prompts (default: the fair engine's own `Engine`, else `core` itself)."""
    if base is None:
        base = core.engine if isinstance(core, FairEngine) else core
    prompts = getattr(base, "prompts", None)  # None: no prompt builder (a test's engine)
    b = Build(options, core, prompts, base, layers=[core])
    served = core
    built: dict[str, TranslationEngine] = {}
    for stage in reversed(stages):  # inside out
        if not stage.wanted(options):
            continue
        b.below[stage.name] = served
        served = stage.wrap(served, b)
        built[stage.name] = served
        b.layers.append(served)
    return ServedEngine(served, core, base, built)
