"""One frozen copy of the engine's own statistics, for readers on other threads.

The engine counts as it runs (`EngineStats`: steps, tokens, preemptions; the KV cache
manager's `PrefixCacheStats`: prompt tokens looked up and found in the prefix cache, evicted
blocks; the block pools' free lists), all written by the engine thread alone. The worker
exports them to Prometheus from its poll thread, and the engine must not import
prometheus_client (tests/test_architecture.py), so the worker asks for an `EngineSnapshot`
every half second (`Engine.stats_snapshot()`) and copies it into its metrics container
(`workers/metrics.py`'s `update_engine`).

No lock: every field is a plain int read once (atomic under the GIL) or `len()` of a free
list, and counters only grow, so a snapshot taken mid-step is at most one step stale and
never torn in a way that matters to a dashboard. The counters are cumulative since the engine
was built; the metrics container turns them into Prometheus counters by their increments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from workers.engine.autoconfig import ConfigReport
from workers.engine.engine_config import EngineStats
from workers.engine.kv_cache import KVCacheManager
from workers.engine.scheduler import Scheduler

__all__ = ["EngineSnapshot", "snapshot_engine"]


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    kv_usage: float  # share of the fullest KV pool's usable blocks held (0..1)
    kv_blocks_used: int  # blocks referenced by sequences, all pools (cached, unreferenced: free)
    kv_blocks_total: int  # usable blocks, all pools (the null block excluded)
    prefix_queries_tokens: int  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_hit_tokens: int  # of those, tokens served from cached blocks (cumulative)
    prefix_evictions: int  # cached blocks evicted for room (cumulative)
    preemptions: int  # running sequences preempted (recomputed later) when blocks ran out
    steps: int  # model steps run
    prefill_tokens: int  # prompt tokens computed (cache hits excluded)
    decode_tokens: int  # tokens sampled
    running: int  # sequences in the running batch
    waiting: int  # requests waiting for admission (the queue plus preempted ones)
    # kind ("decode", "mixed", "prefill") -> (model steps, seconds in them), cumulative
    steps_by_kind: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    # the configuration in use and why, when a tuner reports it (workers/engine/tuner.py)
    config: ConfigReport | None = None

    @property
    def prefix_hit_rate(self) -> float:
        """Cumulative share of looked-up prompt tokens served from the prefix cache."""
        if not self.prefix_queries_tokens:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_queries_tokens


class CountingEngine(Protocol):
    """What a snapshot reads of an engine (`workers.engine.engine.Engine` has it; a protocol,
    so that this module, which the engine imports, does not import the engine back)."""

    @property
    def kv(self) -> KVCacheManager: ...
    @property
    def stats(self) -> EngineStats: ...
    @property
    def scheduler(self) -> Scheduler: ...


def snapshot_engine(engine: CountingEngine) -> EngineSnapshot:
    """Read `engine`'s counters and pools once (any thread; see the module notes)."""
    kv = engine.kv
    used = total = 0
    for group in kv.groups:
        pool = kv.pool(group.name)
        total += pool.num_usable_blocks
        used += pool.num_usable_blocks - pool.num_free_blocks()
    stats = engine.stats
    prefix = kv.stats
    sched = engine.scheduler
    return EngineSnapshot(
        kv_usage=kv.usage(),
        kv_blocks_used=used,
        kv_blocks_total=total,
        prefix_queries_tokens=prefix.queries,
        prefix_hit_tokens=prefix.hits,
        prefix_evictions=prefix.evictions,
        preemptions=stats.preemptions,
        steps=stats.steps,
        prefill_tokens=stats.prefill_tokens,
        decode_tokens=stats.decode_tokens,
        running=len(sched.running),
        waiting=sched.num_waiting,
        steps_by_kind={
            kind: (n, stats.seconds_by_kind.get(kind, 0.0))
            for kind, n in list(stats.steps_by_kind.items())  # a copy: the engine thread adds
        },
        config=getattr(engine, "config_report", None),
    )
