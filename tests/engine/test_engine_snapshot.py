"""`snapshot_engine` reads the engine's counters and pools; the worker's metrics export them.

The engine here is a stand-in holding the real parts the snapshot reads (a `KVCacheManager`
with prefix caching, an `EngineStats`, a scheduler's running list and waiting count): no model
is needed to check what the snapshot says about them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from workers.engine.engine_config import EngineStats
from workers.engine.engine_snapshot import EngineSnapshot, snapshot_engine
from workers.engine.kv_cache import KVCacheManager, KVGroupSpec
from workers.metrics import WorkerMetrics

BS = 4  # tokens per block
NUM_BLOCKS = 11  # 10 usable + the null block


def _engine() -> SimpleNamespace:
    kv = KVCacheManager([KVGroupSpec("full", NUM_BLOCKS, BS, None)], True, True)
    scheduler = SimpleNamespace(running=[], num_waiting=0)
    return SimpleNamespace(kv=kv, stats=EngineStats(), scheduler=scheduler)


def _run(kv: KVCacheManager, seq_id: str, tokens: list[int]) -> None:
    cached = kv.prefix.find_cached_prefix(tokens)
    assert kv.allocate_slots(seq_id, tokens, cached, len(tokens) - cached)
    kv.prefix.take_block_copies()  # the step runs the partial-hit copies and releases their sources
    kv.prefix.commit_computed(seq_id, tokens, len(tokens))


def test_snapshot_counts_blocks_prefix_hits_and_the_engine_tally() -> None:
    engine = _engine()
    prompt = list(range(100, 112))  # 12 tokens: 3 full blocks
    _run(engine.kv, "a", prompt)
    snap = snapshot_engine(engine)
    assert snap.kv_blocks_total == NUM_BLOCKS - 1
    assert snap.kv_blocks_used == 3
    assert snap.kv_usage == pytest.approx(3 / (NUM_BLOCKS - 1))
    assert (snap.prefix_queries_tokens, snap.prefix_hit_tokens) == (12, 0)

    # the same prompt again while "a" runs: served from a's blocks except the last token,
    # which must be computed (so the hit is 11 tokens: 2 full blocks + 3 copied slots)
    _run(engine.kv, "b", prompt)
    snap = snapshot_engine(engine)
    assert snap.prefix_queries_tokens == 24
    assert snap.prefix_hit_tokens == 11
    assert snap.prefix_hit_rate == 11 / 24

    engine.kv.free("a")
    engine.kv.free("b")
    engine.stats.preemptions = 2
    engine.stats.steps = 7
    engine.scheduler.running = ["x", "y"]
    engine.scheduler.num_waiting = 5
    snap = snapshot_engine(engine)
    assert snap.kv_blocks_used == 0 and snap.kv_usage == 0.0  # cached blocks count as free
    assert (snap.preemptions, snap.steps, snap.running, snap.waiting) == (2, 7, 2, 5)


def _snap(**kw: float) -> EngineSnapshot:
    base = dict(
        kv_usage=0.0,
        kv_blocks_used=0,
        kv_blocks_total=10,
        prefix_queries_tokens=0,
        prefix_hit_tokens=0,
        prefix_evictions=0,
        preemptions=0,
        steps=0,
        prefill_tokens=0,
        decode_tokens=0,
        running=0,
        waiting=0,
    )
    base.update(kw)
    return EngineSnapshot(**base)  # type: ignore[arg-type]


def test_worker_metrics_turn_cumulative_snapshots_into_counters() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)

    def value(name: str) -> float:
        got = registry.get_sample_value(name)
        assert got is not None, name
        return got

    metrics.engine.update(
        _snap(
            kv_usage=0.25,
            running=3,
            prefix_queries_tokens=100,
            prefix_hit_tokens=60,
            preemptions=1,
            steps=10,
        )
    )
    metrics.engine.update(
        _snap(
            kv_usage=0.5,
            running=1,
            prefix_queries_tokens=150,
            prefix_hit_tokens=90,
            preemptions=1,
            steps=25,
        )
    )
    assert value("tolk_engine_kv_cache_usage_ratio") == 0.5
    assert value("tolk_engine_running_sequences") == 1
    assert value("tolk_engine_prefix_cache_queries_tokens_total") == 150
    assert value("tolk_engine_prefix_cache_hits_tokens_total") == 90
    assert value("tolk_engine_preemptions_total") == 1
    assert value("tolk_engine_steps_total") == 25
    # a new engine (its counters start again) adds its own counts, never subtracts
    metrics.engine.update(_snap(prefix_queries_tokens=20, prefix_hit_tokens=5, steps=3))
    assert value("tolk_engine_prefix_cache_queries_tokens_total") == 170
    assert value("tolk_engine_prefix_cache_hits_tokens_total") == 95
    assert value("tolk_engine_steps_total") == 28


def test_steps_by_kind_reach_the_metrics_as_counters() -> None:
    engine = _engine()
    engine.stats.steps_by_kind.update(decode=8, mixed=2)
    engine.stats.seconds_by_kind.update(decode=0.2, mixed=0.15)
    snap = snapshot_engine(engine)
    assert snap.steps_by_kind == {"decode": (8, 0.2), "mixed": (2, 0.15)}
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    metrics.engine.update(snap)
    metrics.engine.update(_snap(steps_by_kind={"decode": (10, 0.25), "mixed": (2, 0.15)}))

    def value(name: str, kind: str) -> float | None:
        return registry.get_sample_value(name, {"kind": kind})

    assert value("tolk_engine_kind_steps_total", "decode") == 10
    assert value("tolk_engine_step_seconds_total", "decode") == pytest.approx(0.25)
    assert value("tolk_engine_step_seconds_total", "mixed") == pytest.approx(0.15)
    assert value("tolk_engine_kind_steps_total", "prefill") is None  # no such step yet
