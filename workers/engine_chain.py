"""The order of the worker's engine wrappers: what `tolk worker` serves, around the fair engine.

Each wrapper changes how a request is submitted or answered (workers/engine_wrapper.py); their
order is part of what each one means, so it is decided here, once, and `tolk worker`
(workers/cli.py) only chooses which are on. From the inside out:

1. retrieved examples (`--tm-examples`, workers/tm_engine.py): innermost, it builds the
   engine's requests with the examples in the prompt;
2. faithfulness (`--faithful`, workers/faithful_engine.py): its retry needs the engine's
   prompt forms;
3. span protection (`--protect-spans`, workers/protected_engine.py);
   -- `uncached`: the chain so far, which a contextual turn takes (the cache must not answer
   it nor keep its answer: workers/context_engine.py);
4. the exact-match cache (`--cache`, workers/cache_engine.py): a hit skips 1-3;
5. conversation context (`--context`): it sends a turn with history to `uncached`, around the
   cache, and any other turn through the cache;
6. drills (`--drill-inject-latency|errors`, workers/drill_engine.py): outermost, so that every
   reply of the arm is drilled as the flag says: cache hits, and contextual turns, which go
   around everything the context engine wraps (the drill once sat inside the context engine,
   and a context arm's turns with history skipped it: a rollback drill injected less than it
   said). The drill changes what the arm replies, not what the model did: a drilled turn's
   real answer is still the conversation's history (as a cache entry it was already).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workers.engine.types import TranslationEngine

__all__ = ["ChainOptions", "compose_served"]


@dataclass(frozen=True, slots=True)
class ChainOptions:
    """Which wrappers `tolk worker` turns on (its flags), and their parameters."""

    retriever: Any = None  # a phrase-index retriever (--tm-examples), None = off
    faithful: bool = True
    faithful_policy: str = "withhold"
    max_new_tokens: int = 256  # the faithfulness length guard's default cap
    protect_spans: bool = False
    cache: bool = False
    cache_variant: str = ""  # part of the cache's fingerprint (e.g. the quantization)
    cache_l2: Any = None  # the cache's L2 store (None: the Redis of `settings`; tests)
    drill_latency: Sequence[str] = ()
    drill_errors: Sequence[str] = ()
    context: bool = False


def compose_served(
    engine: TranslationEngine, base: Any, settings: Any, options: ChainOptions
) -> TranslationEngine:
    """`engine` (the fair engine) in the wrappers `options` turns on, in the order of the
    module notes; `base`: the engine that builds the prompts (the context engine's hook; only
    needed with `options.context`); `settings`: `workers.settings.Settings` (cache and context
    parameters)."""
    if options.context and base is None:
        raise ValueError("conversation context needs the base engine that builds the prompts")
    served = engine
    if options.retriever is not None:
        from workers.tm_engine import RetrievedExamplesEngine

        served = RetrievedExamplesEngine(served, options.retriever)
    if options.faithful:
        from workers.faithful_engine import faithful

        served = faithful(
            served, policy=options.faithful_policy, default_max_new_tokens=options.max_new_tokens
        )
    if options.protect_spans:
        from workers.protected_engine import protect_spans

        served = protect_spans(served)
    uncached = served  # what a contextual turn goes through: everything but the cache
    if options.cache:
        from workers.cache_engine import with_translation_cache

        served = with_translation_cache(
            served, settings, variant=options.cache_variant, l2=options.cache_l2
        )
    if options.context:
        from workers.context_engine import with_conversation_context

        served = with_conversation_context(
            served,
            base=base,
            uncached=uncached,
            budget_tokens=settings.context_tokens,
            idle_s=settings.context_idle_s,
            layout=settings.context_layout,
        )
    if options.drill_latency or options.drill_errors:
        from workers.drill_engine import with_drills

        served = with_drills(served, options.drill_latency, options.drill_errors)
    return served
