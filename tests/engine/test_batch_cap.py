"""The running batch's cap from measured speeds (workers/engine/batch_cap.py): pure logic."""

from __future__ import annotations

from workers.engine.batch_cap import TYPICAL_OUTPUT_TOKENS, choose_batch_cap

# Gemma 3 270M int8 + compiled on 2 AMD EPYC (Zen 4) vCPUs (docs/BENCHMARKS.md): tokens/s
# per batch size
EPYC = {1: 50.0, 8: 222.0, 16: 252.0, 32: 215.0}


def test_the_knee_the_smallest_batch_within_the_tolerance_of_the_best() -> None:
    cap = choose_batch_cap(EPYC, None, default=32)
    assert cap.max_num_seqs == 8  # 222 of 252 tok/s, a step 36 ms instead of 64
    assert "b16 252 tok/s (63 ms/step)" in cap.reason


def test_a_batch_that_buys_real_throughput_is_kept() -> None:
    # a GPU-like curve: tokens/s doubles with every doubling of the batch
    scaling = {8: 800.0, 16: 1600.0, 32: 3200.0}
    assert choose_batch_cap(scaling, None, default=32).max_num_seqs == 32
    assert choose_batch_cap(scaling, 10.0, default=32).max_num_seqs == 32  # 10 ms steps


def test_a_tight_slo_lowers_the_cap_but_never_below_the_smallest_choice() -> None:
    scaling = {8: 80.0, 16: 160.0, 32: 320.0}  # 100 ms a step at every batch size
    step_s = 0.1
    loose = TYPICAL_OUTPUT_TOKENS * step_s + 0.5
    assert choose_batch_cap(scaling, loose, default=32).max_num_seqs == 32
    slow_at_32 = {8: 160.0, 16: 320.0, 32: 320.0 * 1.9}  # 50 / 50 / ~53 ms steps
    tight = TYPICAL_OUTPUT_TOKENS * 0.051  # 32 at ~53 ms misses it, 16 at 50 ms makes it
    got = choose_batch_cap(slow_at_32, tight, default=32)
    assert got.max_num_seqs == 16 and "tightest SLO" in got.reason
    assert choose_batch_cap(scaling, 0.01, default=32).max_num_seqs == 8


def test_without_measurements_the_default_stands() -> None:
    assert choose_batch_cap({}, 2.0, default=32).max_num_seqs == 32
    assert choose_batch_cap({1: 50.0, 8: 200.0}, 2.0, default=24).max_num_seqs == 24
    assert "not measured" in choose_batch_cap({}, None, default=32).reason
