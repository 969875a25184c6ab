"""bench/int8_linear.py on small shapes: every op timed, the int8 op checked against a reference."""

from __future__ import annotations

import pytest

from bench import int8_linear


def test_the_bench_times_every_op_and_checks_the_int8_op(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels import cpu_ops

    if not cpu_ops.load():
        pytest.skip(f"no C++ ops here: {cpu_ops.error()}")
    monkeypatch.setattr(int8_linear, "SHAPES", {"small": (64, 96)})
    out = int8_linear.run([1, 5], repeats=2, threads=1)
    rows = out["shapes"]["small 64x96"]
    assert set(rows) == {"1", "5"}
    for r in rows.values():
        assert r["float32_ms"] > 0 and r["int8_ms"] > 0
        assert r["float32_over_int8"] == pytest.approx(r["float32_ms"] / r["int8_ms"], rel=0.05)
        assert r["int8_float32_loop_ms"] > 0
        ratio = r["int8_float32_loop_ms"] / r["int8_ms"]
        assert r["float32_loop_over_int8"] == pytest.approx(ratio, rel=0.05)
        assert r["int4_ms"] > 0  # K = 96: a multiple of 32, so the int4 op is timed too
        assert r["int8_over_int4"] == pytest.approx(r["int8_ms"] / r["int4_ms"], rel=0.05)
        assert r["max_abs_err"] < 1e-3
    assert isinstance(out["vector_loop"], bool) and out["machine"]["cpu_model"]
