"""The serving pipeline's options: one frozen tree, a section per stage, made once at the edge.

`tolk worker`'s flags (workers/cli.py -> workers/worker_start.py) and `Settings` (the
environment: the cache's and the context's parameters, the arm) meet here, in
`ServingOptions.of`; the builder (`workers/serving/pipeline.py`'s `build_served_engine`) takes
the tree whole and each stage's factory reads its own section. A section's fields are what its
stage is built with, nothing of the process around it: the cache's section carries the Redis
URL and timeouts it connects with, not `Settings`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workers.settings import Settings

if TYPE_CHECKING:
    from workers.cache_ttl import TtlTiers
    from workers.stages.cache.redis_l2 import TranslationStore
    from workers.stages.cascade.stage import CascadeSetup
    from workers.stages.examples.stage import ExampleRetriever

__all__ = ["CacheOptions", "ContextOptions", "DrillOptions", "FaithfulOptions", "ServingOptions"]


@dataclass(frozen=True, slots=True)
class DrillOptions:
    """`--drill-inject-latency` / `--drill-inject-errors`: `lang:value` specs (stage 1)."""

    latency: Sequence[str] = ()
    errors: Sequence[str] = ()


@dataclass(frozen=True, slots=True)
class ContextOptions:
    """`--context` and its `TOLK_CONTEXT_*` parameters (stage 2)."""

    on: bool
    tokens: int  # history token budget per prompt
    idle_s: float  # a conversation's history kept this long idle
    layout: str  # the turns shown (workers/context_layouts.py)


@dataclass(frozen=True, slots=True)
class CacheOptions:
    """`--cache` and the exact-match cache's parameters (stage 3)."""

    on: bool
    l1_entries: int  # L1 capacity, all languages together
    languages: tuple[str, ...]  # each gets an equal share of L1
    redis_url: str  # the L2 (unless `l2` is given)
    timeouts_s: tuple[float, float]  # the L2's socket timeout and retry patience
    ttl: TtlTiers  # the L2 TTL per language
    arm: str | None = None  # part of the fingerprint: arms never share an entry
    variant: str = ""  # part of the fingerprint (e.g. the weight format)
    l2: TranslationStore | None = None  # an L2 store of the caller's (tests); None: Redis


@dataclass(frozen=True, slots=True)
class FaithfulOptions:
    """`--faithful` / `--faithful-policy` (stage 5)."""

    on: bool = True
    policy: str = "withhold"
    max_new_tokens: int = 256  # the length guard's default cap


@dataclass(frozen=True, slots=True)
class ServingOptions:
    """Which stages are on and their parameters: the whole tree the builder takes, made once
    at the edge (`ServingOptions.of`, from `tolk worker`'s flags and `Settings`)."""

    cache: CacheOptions
    context: ContextOptions
    faithful: FaithfulOptions = FaithfulOptions()
    drill: DrillOptions = DrillOptions()
    protect_spans: bool = False  # stage 4
    examples: ExampleRetriever | None = None  # `--tm-examples` (stage 6); None = off
    cascade: CascadeSetup | None = None  # `--cascade` (stage 7); None = off
    extra: Mapping[str, object] = field(default_factory=dict)  # a stage added to `STAGES`

    @classmethod
    def of(
        cls,
        settings: Settings,
        *,
        cache: bool = False,
        cache_variant: str = "",
        cache_l2: TranslationStore | None = None,
        context: bool = False,
        faithful: bool = True,
        faithful_policy: str = "withhold",
        max_new_tokens: int = 256,
        drill_latency: Sequence[str] = (),
        drill_errors: Sequence[str] = (),
        protect_spans: bool = False,
        retriever: ExampleRetriever | None = None,
        cascade: CascadeSetup | None = None,
        extra: Mapping[str, object] | None = None,
    ) -> ServingOptions:
        """The tree from the flags (as `tolk worker` names them; off unless given) and
        `settings` (the environment: cache and context parameters, the arm)."""
        s = settings
        return cls(
            cache=CacheOptions(
                on=cache,
                l1_entries=s.cache_l1_entries,
                languages=tuple(s.languages),
                redis_url=s.redis_url,
                timeouts_s=(s.store_timeout_s, s.store_patience_s),
                ttl=s.cache_ttl,
                arm=s.arm,
                variant=cache_variant,
                l2=cache_l2,
            ),
            context=ContextOptions(context, s.context_tokens, s.context_idle_s, s.context_layout),
            faithful=FaithfulOptions(faithful, faithful_policy, max_new_tokens),
            drill=DrillOptions(tuple(drill_latency), tuple(drill_errors)),
            protect_spans=protect_spans,
            examples=retriever,
            cascade=cascade,
            extra=dict(extra or {}),
        )
