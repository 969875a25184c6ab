"""kernels.int8_linear: the C++ op against the float64 reference, on both of its inner loops."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kernels import cpu_ops
from kernels.int8_linear import (
    int8_linear,
    int8_linear_reference,
    pick_streamed_rows,
    quantize_int8,
    streamed_rows,
)

# (M, K, N): decode shapes of SmolLM2 (fused qkv, down) and Gemma 3, tails in K and N, M at
# and past the streamed loop's 4 rows (above 4: the 4x4-row tiles), and K past one int32 chunk
# of the 16-bit loop (2048 columns with AVX2, 4096 with VNNI; on both loops)
SHAPES = [(1, 576, 960), (1, 1536, 576), (3, 575, 577), (5, 64, 6), (33, 576, 192),
          (2, 9000, 8), (6, 9000, 5), (1, 7, 3), (4, 640, 1030), (8, 2048, 64)]  # fmt: skip


@pytest.fixture(scope="module")
def cpu_op() -> None:
    if not cpu_ops.load():
        pytest.fail(f"tolk's C++ ops did not build: {cpu_ops.error()}")


def _case(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    w, s = quantize_int8(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen)
    x[:, 0] *= 30  # an outlier channel, as real hidden states have
    exact = (x.double() @ w.double().T) * s.double()
    return x, w, s, exact


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_exact_float32_loop_matches_reference(cpu_op, m: int, k: int, n: int) -> None:
    x, w, s, exact = _case(m, k, n)
    y = torch.ops.tolk.int8_linear(x, w, s, True)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), exact, atol=1e-4 * k**0.5, rtol=1e-5)


@pytest.fixture(params=[4, 0], ids=["streamed", "blocked"])
def loop_order(cpu_op, request: pytest.FixtureRequest) -> Iterator[int]:
    """The 16-bit loop's two orders: weight rows in memory order up to 4 activation rows, or
    4-row blocks at every size; the process's setting restored after the test."""
    before = streamed_rows()
    streamed_rows(request.param)
    yield request.param
    streamed_rows(before)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_default_loop_beats_bfloat16_activations(loop_order, m: int, k: int, n: int) -> None:
    # The default (16-bit fixed-point activations) must be closer to the exact result
    # than rounding the activations to bfloat16 (what torch's int8 CPU kernel does), in
    # either loop order.
    x, w, s, exact = _case(m, k, n, seed=1)
    y = int8_linear(x, w, s)
    err = (y.double() - exact).abs().max().item()
    bf16 = (x.bfloat16().double() @ w.double().T) * s.double()
    assert err <= (bf16 - exact).abs().max().item() + 1e-6
    assert err <= 1e-3 * exact.abs().max().item()


def test_leading_dims_and_fallbacks(cpu_op) -> None:
    x, w, s, _ = _case(6, 64, 16)
    y = int8_linear(x.view(2, 3, 64), w, s)
    assert y.shape == (2, 3, 16)
    torch.testing.assert_close(y.view(6, 16), int8_linear(x, w, s))
    # bfloat16 activations take the torch reference, in bfloat16
    yb = int8_linear(x.bfloat16(), w, s)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb, int8_linear_reference(x.bfloat16(), w, s))


@pytest.mark.parametrize("m", [1, 3, 4])
def test_loop_orders_agree(cpu_op, m: int) -> None:
    """Both orders sum the same integer products; only the float32 flush of the lanes differs
    (two int32 chains added per lane in the streamed order): at float32 rounding. (N a multiple
    of 4: the blocked order leaves the last N % 4 weight rows to the plain float32 loop.)"""
    x, w, s, _ = _case(m, 640, 1028, seed=2)
    before = streamed_rows()
    try:
        streamed_rows(4)
        streamed = torch.ops.tolk.int8_linear(x, w, s)
        streamed_rows(0)
        blocked = torch.ops.tolk.int8_linear(x, w, s)
    finally:
        streamed_rows(before)
    torch.testing.assert_close(streamed, blocked, atol=1e-5 * blocked.abs().max().item(), rtol=0)


def test_probe_sets_a_limit_and_says_why(cpu_op, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe times both orders on a matrix past the caches and keeps the faster (a smaller
    matrix here: the choice is not asserted, only that it is one the op applies)."""
    from kernels import int8_linear as mod

    monkeypatch.setattr(mod, "PROBE_ROWS", 4096)
    monkeypatch.setattr(mod, "PROBE_REPEATS", 2)
    before = streamed_rows()
    try:
        choice = pick_streamed_rows(force=True)
        assert choice is not None and choice.rows in (0, 1, 4)
        assert streamed_rows() == choice.rows
        assert set(choice.streamed_ms) == set(choice.blocked_ms) == {1, 4}
        assert all(t > 0 for t in (*choice.streamed_ms.values(), *choice.blocked_ms.values()))
        faster_at_1 = choice.streamed_ms[1] < choice.blocked_ms[1]
        assert (choice.rows > 0) == faster_at_1
        assert "activation rows" in choice.describe()
        assert pick_streamed_rows() is choice  # once per process unless forced
    finally:
        streamed_rows(before)
    assert streamed_rows(7) == 4  # clamped to the streamed loop's four rows
    streamed_rows(before)


def test_op_rejects_bad_input(cpu_op) -> None:
    x, w, s, _ = _case(1, 32, 8)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.tolk.int8_linear(torch.ones(1, 31), w, s)
    with pytest.raises(RuntimeError, match="int8"):
        torch.ops.tolk.int8_linear(x, w.float(), s)


def test_the_fast_loop_is_expected_where_the_cpu_has_avx512_f_bw_vl_or_avx2_fma(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kernels import int8_linear

    for flags, fast in (
        ({"sse4_2", "avx"}, False),
        ({"avx2"}, False),
        ({"avx512f", "avx512bw"}, False),
        ({"avx2", "fma"}, True),
        ({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, True),
    ):
        monkeypatch.setattr(cpu_ops, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert int8_linear.fast_loop_expected() is fast


def test_cpu_flags_are_read_from_this_machine() -> None:
    import platform
    from pathlib import Path

    flags = cpu_ops.cpu_flags()
    if platform.machine() == "x86_64" and Path("/proc/cpuinfo").exists():
        assert {"fpu", "sse2"} <= flags  # every x86-64 CPU has them; an unparsed file gives none
    elif not Path("/proc/cpuinfo").exists():
        assert flags == frozenset()
